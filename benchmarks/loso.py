"""Leave-one-subject-out k-shot adaptation: every method side by side, every subject held out once.

For each target subject of the dataset (one *fold*):

1. ``study.make_split``: the other subjects are the source (80 % to pretrain on, 20 % held out
   for in-distribution accuracy); the target gives ``--k-per-class`` labelled windows per class
   to adapt on and its remaining windows (minus any that share samples with an adaptation
   window) to evaluate on, so adaptation and evaluation data are disjoint.
2. ``study.pretrain_source``: one source model per fold, pretrained once; every method starts
   from this same model.
3. ``study.run_method`` for each method: export a bundle for the method and adapt it to the
   target in a fresh torch-free process (``edgeadapt.harness.adapt_job``), which reports accuracy on the
   target's evaluation windows before and after, the trained elements, and the peak memory of
   the adaptation as DESIGN.md defines it (VmHWM delta over the same process with the model
   loaded and no step run; that loaded baseline is reported too).

Methods: ``source-only`` (the pretrained model unchanged = ``accuracy_before``), ``last-layer``,
``bias-norm`` (biases + norm affine), ``bn-stats`` (BatchNorm statistics re-estimated on the
target's adaptation windows, label-free), ``entropy`` (entropy minimisation, Tent, label-free),
``sparse`` (the model's default channel-subset policy, ``study.sparse_policy``: head + 25 % of
the last block's channels), ``sparse-12`` (the same policy with 12.5 % of the channels) and
``full`` fine-tuning. Learning rate ``--lr`` times the method's ``lr_scale`` from
``study.method_recipe``.

Summary per method: mean and worst-subject accuracy on the target's evaluation windows; trained
elements and trained bytes (float32 parameters: elements x 4; the gradients plus the two AdamW
moments add 3x that again); peak step memory (median over folds of ``peak_step_delta_bytes``,
MB = 2**20 bytes); adaptation time as a ratio to full fine-tuning in the same fold (speed only as
ratios: the machines are shared).

Writes ``<out>/loso_<dataset>_<model>.json`` (config, per-fold and per-subject per-method rows,
summary; rewritten after every fold), ``.md`` (Markdown table) and ``.png`` (two panels: mean
accuracy with worst-subject markers, peak step memory). Prints the table at the end.

Usage::

    .venv/bin/python benchmarks/loso.py --dataset synthetic --model cnn
    .venv/bin/python benchmarks/loso.py --dataset watch --subjects 1 2 --epochs 10   # quick look
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from edgeadapt.atomic import atomic_write_bytes, atomic_write_json  # noqa: E402
from edgeadapt.datasets import SyntheticConfig, WindowDataset, load_dataset, make_synthetic  # noqa: E402
from edgeadapt.harness.study import (  # noqa: E402
    LABEL_FREE, make_split, method_recipe, per_subject_accuracy, pretrain_source, run_method,
    save_target_data, sparse_policy,
)

log = logging.getLogger("loso")

MB = 2**20
FLOAT32_BYTES = 4
# Method name -> (study method, policy override or None). Order = table order.
ADAPTED = {
    "last-layer": ("last-layer", None),
    "bias-norm": ("bias-norm", None),
    "bn-stats": ("bn-stats", None),
    "entropy": ("entropy", None),
    "sparse": ("sparse", None),
    "sparse-12": ("sparse", "ratio:0.125"),
    "full": ("full", None),
}
ALL_METHODS = ("source-only", *ADAPTED)


def _policy_for(name: str, model_name: str) -> str | None:
    _, override = ADAPTED[name]
    if override is None:
        return None
    ratio = override.split(":", 1)[1]
    spec = sparse_policy(model_name)
    return ",".join(
        f"{item.split('=')[0]}=channels:{ratio}" if "=channels:" in item else item for item in spec.split(",")
    )


def _code_version() -> dict:
    """The commit the library code comes from and whether the tree differs from it (read-only git)."""
    import subprocess

    import edgeadapt

    def git(*a: str) -> str | None:
        try:
            return subprocess.run(["git", "-C", str(REPO), *a], capture_output=True, text=True, timeout=30,
                                  check=True).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": git("rev-parse", "HEAD"), "tracked_files_modified": None if status is None else bool(status),
            "edgeadapt_path": str(Path(edgeadapt.__file__).parent)}


def _load(name: str, seed: int) -> WindowDataset:
    if name == "synthetic":  # seeded like the quickstart
        return make_synthetic(SyntheticConfig(seed=seed))
    return load_dataset(name)


def _summary(rows: list[dict], methods: list[str]) -> dict[str, dict]:
    out = {}
    for m in methods:
        mine = [r for r in rows if r["method"] == m]
        if not mine:
            continue
        acc = [r["accuracy"] for r in mine]
        worst = min(mine, key=lambda r: r["accuracy"])
        peaks = [r["peak_step_delta_bytes"] for r in mine if r["peak_step_delta_bytes"] is not None]
        bases = [r["loaded_rss_bytes"] for r in mine if r["loaded_rss_bytes"] is not None]
        ratios = [r["adapt_time_vs_full"] for r in mine if r.get("adapt_time_vs_full") is not None]
        gains = [r["accuracy"] - r["accuracy_source_only"] for r in mine]
        out[m] = {
            "n_subjects": len(mine),
            "mean_accuracy": statistics.fmean(acc),
            "std_accuracy": statistics.pstdev(acc),
            "worst_accuracy": worst["accuracy"],
            "worst_subject": worst["subject"],
            "mean_gain_over_source_only": statistics.fmean(gains),
            "subjects_improved": sum(g > 0 for g in gains),
            "subjects_hurt": sum(g < 0 for g in gains),
            "trainable_numel": int(statistics.median(r["trainable_numel"] for r in mine)),
            "trained_bytes": int(statistics.median(r["trained_bytes"] for r in mine)),
            "grad_adamw_bytes": int(statistics.median(r["grad_adamw_bytes"] for r in mine)),
            "median_peak_step_delta_bytes": int(statistics.median(peaks)) if peaks else None,
            "max_peak_step_delta_bytes": max(peaks) if peaks else None,
            "median_loaded_rss_bytes": int(statistics.median(bases)) if bases else None,
            "median_adapt_time_vs_full": statistics.median(ratios) if ratios else None,
        }
    return out


def _fmt_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    return f"{n / MB:.2f} MB" if n >= MB else f"{n / 1024:.1f} KB"


def _markdown(result: dict) -> str:
    cfg, summ = result["config"], result["summary"]
    full = summ.get("full")
    lines = [
        f"### LOSO {cfg['dataset']} / {cfg['model']}: {len(result['subjects_done'])} subjects, "
        f"k={cfg['k_per_class']} per class, {cfg['epochs']} adaptation epochs",
        "",
        f"Command: `{result['command']}`",
        "",
        "| method | mean acc | worst acc (subj) | Δ vs source (mean) | improved/hurt | trained el. | "
        "trained bytes | +grad+AdamW | peak step MB (median) | vs full | adapt time vs full |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m, s in summ.items():
        peak = s["median_peak_step_delta_bytes"]
        vs_full = (f"{peak / full['median_peak_step_delta_bytes']:.2f}x"
                   if peak is not None and full and full["median_peak_step_delta_bytes"] else "-")
        t = s["median_adapt_time_vs_full"]
        lines.append(
            f"| {m}{' (label-free)' if m in LABEL_FREE else ''} | {s['mean_accuracy']:.3f} | "
            f"{s['worst_accuracy']:.3f} ({s['worst_subject']}) | "
            f"{s['mean_gain_over_source_only']:+.3f} | "
            f"{'-' if m == 'source-only' else str(s['subjects_improved']) + '/' + str(s['subjects_hurt'])} | "
            f"{s['trainable_numel']:,} | {_fmt_bytes(s['trained_bytes'])} | {_fmt_bytes(s['grad_adamw_bytes'])} | "
            f"{'-' if peak is None else f'{peak / MB:.2f}'} | {vs_full} | {'-' if t is None else f'{t:.2f}'} |"
        )
    base = [s["median_loaded_rss_bytes"] for s in summ.values() if s["median_loaded_rss_bytes"]]
    lines += [
        "",
        f"Accuracy on each held-out subject's evaluation windows (disjoint from its "
        f"{cfg['k_per_class']}-per-class adaptation windows); source-only = the fold's pretrained model. "
        f"Pretrained source models reach {result['source_val_accuracy_mean']:.3f} on held-out windows of "
        "their own source subjects (mean over folds). Trained bytes = trained elements x 4 (float32); "
        "gradients + AdamW moments add 3x that. Peak step memory: VmHWM delta over the adaptation "
        "process with the model loaded (torch-free runner, CPU), median over subjects; loaded baseline "
        f"median {statistics.median(base) / MB:.0f} MB." if base else "",
        "bn-stats runs its bundle (last layer trainable) at learning rate 0: it trains no parameter, only "
        "BatchNorm running statistics change, yet its peak includes that bundle's backward pass."
        if "bn-stats" in summ else "",
        f"Total time {result['total_time_s'] / 60:.1f} min.",
    ]
    return "\n".join(lines) + "\n"


def _plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summ = result["summary"]
    names = list(summ)
    colors = ["#9e9e9e" if m == "source-only" else "#43a047" if m in LABEL_FREE else
              "#c2185b" if m.startswith("sparse") else "#607d8b" for m in names]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    x = range(len(names))
    ax1.bar(x, [summ[m]["mean_accuracy"] for m in names], color=colors, label="mean over subjects")
    ax1.scatter(x, [summ[m]["worst_accuracy"] for m in names], marker="v", color="black", zorder=3,
                label="worst subject")
    for i, m in enumerate(names):
        ax1.text(i, summ[m]["mean_accuracy"] + 0.01, f"{summ[m]['mean_accuracy']:.2f}", ha="center",
                 va="bottom", fontsize=8)
    src = summ["source-only"]["mean_accuracy"]
    ax1.axhline(src, color="#9e9e9e", linestyle="--", linewidth=1)
    ax1.set_xticks(list(x), names, rotation=30, ha="right")
    ax1.set_ylim(0, 1.05)
    ax1.set_ylabel("target accuracy")
    ax1.set_title(f"LOSO accuracy, {len(result['subjects_done'])} subjects")
    ax1.legend(loc="lower right", fontsize=8)

    adapted = [m for m in names if summ[m]["median_peak_step_delta_bytes"] is not None]
    mb = [summ[m]["median_peak_step_delta_bytes"] / MB for m in adapted]
    ax2.bar(range(len(adapted)), mb, color=[colors[names.index(m)] for m in adapted])
    for i, m in enumerate(adapted):
        ax2.text(i, mb[i], f"{mb[i]:.2f}\n{summ[m]['trainable_numel']:,} el.", ha="center", va="bottom", fontsize=7)
    ax2.set_xticks(range(len(adapted)), adapted, rotation=30, ha="right")
    ax2.set_ylim(0, max(mb + [0.1]) * 1.3)
    ax2.set_ylabel("peak step memory, MB over loaded model")
    ax2.set_title("Adaptation memory (median over subjects)")
    cfg = result["config"]
    fig.suptitle(f"{cfg['dataset']} / {cfg['model']}, k={cfg['k_per_class']}, {cfg['epochs']} epochs", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", default="synthetic", help="synthetic, watch, or a .npz/.csv path")
    p.add_argument("--model", default="cnn", choices=("cnn", "mobilenet", "transformer"))
    p.add_argument("--k-per-class", type=int, default=5, help="labelled target windows per class to adapt on")
    p.add_argument("--epochs", type=int, default=40, help="adaptation epochs")
    p.add_argument("--pretrain-epochs", type=int, default=15)
    p.add_argument("--lr", type=float, default=3e-3, help="adaptation learning rate (times each method's lr_scale)")
    p.add_argument("--subjects", type=int, nargs="+", help="target subjects to hold out (default: all)")
    p.add_argument("--methods", nargs="+", choices=ALL_METHODS[1:], default=list(ALL_METHODS[1:]),
                   help="adapted methods to run (source-only always)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="runner threads (default: runner's choice)")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    p.add_argument("--tag", default="", help="suffix of the output file names")
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")

    command = " ".join([".venv/bin/python", "benchmarks/loso.py", *map(shlex.quote, sys.argv[1:] if argv is None else argv)])
    start = time.perf_counter()
    ds = _load(args.dataset, args.seed)
    subjects = [int(s) for s in ds.subjects]
    if args.subjects:
        unknown = sorted(set(args.subjects) - set(subjects))
        if unknown:
            p.error(f"subjects {unknown} are not in the dataset (subjects: {subjects})")
        subjects = [s for s in subjects if s in set(args.subjects)]
    methods = [m for m in ADAPTED if m in args.methods]
    dataset_tag = Path(args.dataset).stem if args.dataset not in ("synthetic", "watch") else args.dataset
    stem = f"loso_{dataset_tag}_{args.model}{args.tag}"
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"{command}\ndata: {args.dataset}, {len(ds.subjects)} subjects, {ds.n_classes} classes, windows "
          f"{ds.X.shape[1]} ch x {ds.X.shape[2]} steps; holding out {subjects}; methods {methods}", flush=True)

    result: dict = {
        "command": command,
        "code": _code_version(),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "dataset_shape": {"windows": int(ds.X.shape[0]), "channels": int(ds.X.shape[1]),
                          "time_steps": int(ds.X.shape[2]), "classes": int(ds.n_classes),
                          "subjects": [int(s) for s in ds.subjects]},
        "policies": {m: (_policy_for(m, args.model) or None) for m in methods},
        "folds": [], "rows": [], "subjects_done": [],
    }
    for i, target in enumerate(subjects):
        t_fold = time.perf_counter()
        split = make_split(ds, target, args.k_per_class, args.seed)
        t0 = time.perf_counter()
        model = pretrain_source(args.model, split, epochs=args.pretrain_epochs, seed=args.seed)
        pretrain_s = time.perf_counter() - t0
        val_acc = per_subject_accuracy(model, split.source_val)
        total_numel = sum(int(q.numel()) for q in model.parameters())
        fold = {"subject": target, "pretrain_time_s": pretrain_s, "total_numel": total_numel,
                "n_adapt_windows": int(len(split.target_adapt.y)), "n_eval_windows": int(len(split.target_eval.y)),
                "source_val_accuracy": {str(k): v for k, v in val_acc.items()},
                "source_val_accuracy_mean": statistics.fmean(val_acc.values())}
        reports = {}
        with tempfile.TemporaryDirectory(prefix=f"loso_{target}_") as work:
            target_data = save_target_data(split, Path(work))
            for m in methods:
                study_method, _ = ADAPTED[m]
                r = run_method(study_method, model, args.model, split, target_data, Path(work) / m, epochs=args.epochs,
                               lr=args.lr, seed=args.seed, threads=args.threads, policy=_policy_for(m, args.model))
                if r["torch_imported"]:
                    raise RuntimeError("internal: the adaptation process imported torch")
                manifest = json.loads((Path(work) / m / "bundle" / "manifest.json").read_text())
                r["session"] = manifest.get("session")  # ORT session settings the exporter chose
                reports[m] = r
                print(f"  [{i + 1}/{len(subjects)}] subject {target} {m:<10} acc "
                      f"{'  -  ' if r['accuracy_before'] is None else format(r['accuracy_before'], '.3f')} -> "
                      f"{r['accuracy_after']:.3f}  {r['trainable_numel']:>7,} el.  peak "
                      f"{r['peak_step_delta_bytes'] / MB:6.2f} MB  {r['adapt_time_s']:.1f} s", flush=True)
        befores = {round(r["accuracy_before"], 6) for r in reports.values() if r["accuracy_before"] is not None}
        if len(befores) > 1:
            log.warning("subject %s: accuracy_before differs between bundles: %s", target, sorted(befores))
        from edgeadapt.export.pretrain import accuracy

        source_only = accuracy(model, split.target_eval.X, split.target_eval.y)
        if befores and abs(min(befores) - source_only) > 1e-3:
            log.warning("subject %s: runner accuracy_before %s vs torch %.4f", target, sorted(befores), source_only)
        # source-only = accuracy_before of the runner (torch's figure if every method was label-free)
        source_only = next((r["accuracy_before"] for r in reports.values() if r["accuracy_before"] is not None),
                           source_only)
        fold["source_only_accuracy"] = source_only
        result["rows"].append({"subject": target, "method": "source-only", "accuracy": source_only,
                               "accuracy_source_only": source_only, "trainable_numel": 0, "trained_bytes": 0,
                               "grad_adamw_bytes": 0, "peak_step_delta_bytes": None, "loaded_rss_bytes": None,
                               "adapt_time_s": None, "adapt_time_vs_full": None})
        full_t = reports["full"]["adapt_time_s"] if "full" in reports else None
        for m, r in reports.items():
            # A method at learning rate 0 (bn-stats) trains no parameter, whatever its bundle could train.
            trained = 0 if method_recipe(ADAPTED[m][0], args.model)["lr_scale"] == 0 else r["trainable_numel"]
            result["rows"].append({
                "subject": target, "method": m, "accuracy": r["accuracy_after"], "accuracy_source_only": source_only,
                "trainable_numel": trained, "bundle_trainable_numel": r["trainable_numel"],
                "trained_bytes": trained * FLOAT32_BYTES, "grad_adamw_bytes": 3 * trained * FLOAT32_BYTES,
                "peak_step_delta_bytes": r["peak_step_delta_bytes"], "peak_reset_ok": r["peak_reset_ok"],
                "loaded_rss_bytes": r["loaded_rss_bytes"], "adapt_time_s": r["adapt_time_s"],
                "adapt_time_vs_full": r["adapt_time_s"] / full_t if full_t else None,
                "policy": r["policy"], "loss": r["loss"], "batchnorm": r["batchnorm"], "steps": r["steps"],
                "epoch_losses": r["epoch_losses"], "accuracy_before": r["accuracy_before"], "session": r["session"],
            })
        fold["time_s"] = time.perf_counter() - t_fold
        result["folds"].append(fold)
        result["subjects_done"].append(target)
        result["source_val_accuracy_mean"] = statistics.fmean(f["source_val_accuracy_mean"] for f in result["folds"])
        result["summary"] = _summary(result["rows"], ["source-only", *methods])
        result["total_time_s"] = time.perf_counter() - start
        atomic_write_json(args.out / f"{stem}.json", result)
        s = result["summary"]
        print(f"[{i + 1}/{len(subjects)}] subject {target} done in {fold['time_s']:.0f} s (pretrain {pretrain_s:.0f} s, "
              f"source val {fold['source_val_accuracy_mean']:.3f}); running mean: "
              + ", ".join(f"{m} {v['mean_accuracy']:.3f}" for m, v in s.items()), flush=True)

    result["total_time_s"] = time.perf_counter() - start
    atomic_write_json(args.out / f"{stem}.json", result)
    md = _markdown(result)
    atomic_write_bytes(args.out / f"{stem}.md", md.encode())
    _plot(result, args.out / f"{stem}.png")
    print()
    print(md)
    print(f"wrote {args.out / stem}.json / .md / .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
