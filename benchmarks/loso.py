"""Leave-one-subject-out k-shot adaptation: every method side by side, every subject held out once.

For each target subject of the dataset (one *fold*):

1. ``study.make_split``: the other subjects are the source (80 % to pretrain on, 20 % held out
   for in-distribution accuracy); the target gives ``--k-per-class`` labelled windows per class
   to adapt on and its remaining windows (minus any that share samples with an adaptation
   window) to evaluate on, so adaptation and evaluation data are disjoint.
2. ``study.pretrain_source``: one source model per fold, pretrained once; every method starts
   from this same model.
3. ``study.select_learning_rates``: each method's learning rate is chosen on the fold's source
   subjects only, never on the held-out one: ``--validation-subjects`` source subjects (seeded
   choice) each play the new subject once (pretrain on the other source subjects, adapt from k
   windows per class at every rate of ``--lr-grid``, accuracy on its other windows); the rate
   with the best mean accuracy wins. ``--fixed-lr`` skips this and uses one rate for all.
4. ``study.run_method`` for each method: export a bundle for the method and adapt it to the
   target at the chosen rate in a fresh torch-free process (``edgeadapt.harness.adapt_job``),
   which reports accuracy on the target's evaluation windows before and after, the trained
   elements and memory over the loaded runner (docs/design.md, "Measuring"): the peak of one
   training step and of the whole adapt call (which also opens the training session and holds
   the rollback copy of the trained values), each total (VmHWM) and anonymous-only (sampled RssAnon).

Methods (``study.METHODS``, the one registry): ``source-only`` (the pretrained model unchanged =
``accuracy_before``), ``last-layer``, ``bias-norm`` (biases + norm affine), ``bn-stats``
(BatchNorm statistics re-estimated on the target's adaptation windows, label-free, learning rate
0), ``entropy`` (entropy minimisation, Tent, label-free), ``sparse`` (the model's default
channel-subset policy, ``study.sparse_policy``: head + 25 % of the last block's channels),
``sparse-12`` (the same policy with 12.5 % of the channels) and ``full`` fine-tuning.

Summary per method: mean and worst-subject accuracy on the target's evaluation windows; the
learning rates chosen across folds; trained elements and trained bytes (float32 parameters:
elements x 4; the gradients plus the two AdamW moments add 3x that again); memory, median over
folds, MB = 2**20 bytes; adaptation time as a ratio to full fine-tuning in the same fold (speed
only as ratios: the machines are shared). Pretraining and adaptation run on ``--threads``
pinned threads (default 1) with deterministic torch algorithms.

Writes ``<out>/loso_<dataset>_<model>.json`` (config, host, per-fold and per-subject per-method
rows, learning-rate selections, summary; rewritten after every fold), ``.md`` (Markdown table)
and ``.png`` (two panels: mean accuracy with worst-subject markers, step and call peaks).
Prints the table at the end.

``--memory-budget B`` adds a budget method. What it trains is validated on
``--selection-subjects`` source subjects of each fold (``--budget-selection validated``, the
default; docs/scheduler.md): every candidate update that fits B is adapted with the study's
recipe on each of them, and the best (or the smallest within one standard error of it) wins.
``--budget-selection importance`` leaves the choice to the planner's importance selection.

``--target-shift`` applies a sensor shift to each held-out subject (covariate shift);
``--adapt-classes K`` makes the adaptation windows show only K of its classes, in recording
order, as a user who adapts on a stretch of one or two activities has them (label shift: the
evaluation windows still cover every class).

Usage::

    .venv/bin/python benchmarks/loso.py --dataset synthetic --model cnn
    .venv/bin/python benchmarks/loso.py --dataset watch --subjects 1 2 --epochs 10 --fixed-lr 3e-3  # quick look
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
    ALL_METHODS, FIXED_LR, LABEL_FREE, LR_GRID, METHODS, budget_method, make_split, per_subject_accuracy,
    pretrain_source,
    run_method, save_target_data, select_learning_rates,
)
from edgeadapt.datasets.shifts import SHIFTS, shift_subject  # noqa: E402
from edgeadapt.harness.label_free import select_label_free_settings  # noqa: E402
from edgeadapt.harness.validated_selection import describe_picks  # noqa: E402
from edgeadapt.export.selfcheck import SelfCheckError  # noqa: E402
from edgeadapt.export.unsupported import UnsupportedOpError  # noqa: E402
from edgeadapt.sched import BudgetExceeded  # noqa: E402
from edgeadapt.units import format_bytes  # noqa: E402
from edgeadapt.versions import code_version, host_info  # noqa: E402

log = logging.getLogger("loso")

MB = 2**20
# A subject counts as improved / hurt when its accuracy moves by more than this (1 point).
HURT_POINT = 0.01
FLOAT32_BYTES = 4
# Memory figures of each adapted row (bytes over the loaded runner; see edgeadapt.harness.adapt_job).
PEAKS = ("step_peak_bytes", "call_peak_bytes", "step_peak_anon_bytes", "call_peak_anon_bytes")


def study_dataset(name: str, seed: int) -> WindowDataset:
    """The dataset a study of ``--dataset name --seed seed`` runs on (also for scripts that
    rebuild a finished study's folds, e.g. ``labelled_gate_bound.py``)."""
    if name == "synthetic":  # seeded like the quickstart
        return make_synthetic(SyntheticConfig(seed=seed))
    return load_dataset(name)


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _summary(rows: list[dict], methods: list[str]) -> dict[str, dict]:
    out = {}
    for m in methods:
        mine = [r for r in rows if r["method"] == m]
        if not mine:
            continue
        acc = [r["accuracy"] for r in mine]
        worst = min(mine, key=lambda r: r["accuracy"])
        gains = [r["accuracy"] - r["accuracy_source_only"] for r in mine]
        lrs = [r["lr"] for r in mine if r.get("lr") is not None]
        out[m] = {
            "n_subjects": len(mine),
            "mean_accuracy": statistics.fmean(acc),
            "std_accuracy": statistics.pstdev(acc),
            "worst_accuracy": worst["accuracy"],
            "worst_subject": worst["subject"],
            "mean_gain_over_source_only": statistics.fmean(gains),
            "subjects_improved": sum(g > HURT_POINT for g in gains),
            "subjects_hurt": sum(g < -HURT_POINT for g in gains),
            "lr_chosen": {f"{lr:g}": lrs.count(lr) for lr in sorted(set(lrs))},
            "trainable_numel": int(statistics.median(r["trainable_numel"] for r in mine)),
            "trained_bytes": int(statistics.median(r["trained_bytes"] for r in mine)),
            "grad_adamw_bytes": int(statistics.median(r["grad_adamw_bytes"] for r in mine)),
            **{f"median_{k}": _median([r.get(k) for r in mine]) for k in (*PEAKS, "loaded_rss_bytes")},
            "max_call_peak_bytes": max((r["call_peak_bytes"] for r in mine if r.get("call_peak_bytes") is not None),
                                       default=None),
            "median_adapt_time_vs_full": _median([r.get("adapt_time_vs_full") for r in mine]),
        }
    return out


def _mb(n: float | None) -> str:
    return "-" if n is None else f"{n / MB:.2f}"


def _lr_cell(s: dict) -> str:
    chosen = s["lr_chosen"]
    if not chosen:
        return "-"
    return ", ".join(f"{lr}" + (f" ({n}x)" if len(chosen) > 1 else "") for lr, n in chosen.items())


def _markdown(result: dict) -> str:
    cfg, summ = result["config"], result["summary"]
    full = summ.get("full")
    sel = result["lr_selection"]
    if sel["mode"] == "fixed":
        lr_note = (f"Learning rate fixed in advance at {sel['lr']:g} for every method that trains "
                   "(not tuned on any subject).")
    else:
        lr_note = ("Learning rates chosen per fold on source subjects only, never on the held-out subject: "
                   f"leave-one-source-subject-out over {sel['validation_subjects']} source subjects of the fold "
                   f"(seeded), grid {', '.join(f'{g:g}' for g in sel['grid'])}, best mean accuracy; "
                   "the lr column counts the folds that chose each rate.")
    lines = [
        f"### LOSO {cfg['dataset']} / {cfg['model']}: {len(result['subjects_done'])} subjects, "
        f"k={cfg['k_per_class']} per class, {cfg['epochs']} adaptation epochs"
        + (f", sensor shift {cfg['target_shift']}" if cfg.get("target_shift") else "")
        + (f", adaptation windows of {cfg['adapt_classes']} class(es) only (label shift)"
           if cfg.get("adapt_classes") else "")
        + (f", unlabelled adaptation on the first {cfg['unlabeled_fraction']:g} of each recording"
           if cfg.get("unlabeled_fraction") else ""),
        "",
        f"Command: `{result['command']}`",
        "",
        lr_note,
        "",
        "| method | mean acc | worst acc (subj) | Δ vs source (mean) | improved/hurt (>1 pt) | lr (chosen on source) | "
        "trained el. | trained bytes | +grad+AdamW | step peak MB total / anon | adapt-call peak MB total / anon "
        "| call vs full | adapt time vs full |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m, s in summ.items():
        call = s["median_call_peak_bytes"]
        vs_full = (f"{call / full['median_call_peak_bytes']:.2f}x"
                   if call is not None and full and full["median_call_peak_bytes"] else "-")
        t = s["median_adapt_time_vs_full"]
        lines.append(
            f"| {m}{' (label-free)' if m in LABEL_FREE else ''} | {s['mean_accuracy']:.3f} | "
            f"{s['worst_accuracy']:.3f} ({s['worst_subject']}) | "
            f"{s['mean_gain_over_source_only']:+.3f} | "
            f"{'-' if m == 'source-only' else str(s['subjects_improved']) + '/' + str(s['subjects_hurt'])} | "
            f"{_lr_cell(s)} | "
            f"{s['trainable_numel']:,} | {format_bytes(s['trained_bytes'])} | {format_bytes(s['grad_adamw_bytes'])} | "
            f"{_mb(s['median_step_peak_bytes'])} / {_mb(s['median_step_peak_anon_bytes'])} | "
            f"{_mb(call)} / {_mb(s['median_call_peak_anon_bytes'])} | {vs_full} | "
            f"{'-' if t is None else f'{t:.2f}'} |"
        )
    base = [s["median_loaded_rss_bytes"] for s in summ.values() if s["median_loaded_rss_bytes"]]
    host = result["host"]
    picks = [(m, c["chosen"]) for f in result["folds"] for m, c in f.get("budget_selection", {}).items()]
    if picks:  # what each budget method trained, validated on source subjects (folds per choice)
        lines += ["", f"Budget methods, what trains (validated on source subjects; folds): {describe_picks(picks)}"]
    refused = [(f["subject"], m, why) for f in result["folds"] for m, why in f.get("refused", {}).items()]
    if refused:  # those subjects are missing from that method's row (its mean is over the others)
        lines += ["", "Exports refused (the method did not run for that subject; its row covers the others): "
                  + "; ".join(f"subject {subj} {m}: {why}" for subj, m, why in refused)]
    lines += [
        "",
        "Accuracy on each held-out subject's evaluation windows (disjoint from its "
        + (f"adaptation windows, the first {cfg['unlabeled_fraction']:g} of each of its recordings)"
           if cfg.get("unlabeled_fraction") else f"{cfg['k_per_class']}-per-class adaptation windows)")
        + "; source-only = the fold's pretrained model. "
        f"Pretrained source models reach {result['source_val_accuracy_mean']:.3f} on held-out windows of "
        "their own source subjects (mean over folds). Trained bytes = trained elements x 4 (float32); "
        "gradients + AdamW moments add 3x that.",
        "Memory over the adaptation process with the model loaded (torch-free runner, CPU), median over "
        "subjects: *step peak* = the largest high-water mark of a single training step; *adapt-call peak* = "
        "the high-water mark of the whole adapt call (it also opens the training session and holds the rollback "
        "copy of the trained values); "
        "*total* = resident memory (VmHWM), *anon* = anonymous memory only (sampled RssAnon, no library code"
        + (f" or file pages); loaded baseline median {statistics.median(base) / MB:.0f} MB." if base else ")."),
        "bn-stats runs at learning rate 0, which the runner carries out forward-only "
        "(Runner.update_bn_statistics): it trains no parameter, only BatchNorm running statistics change."
        if "bn-stats" in summ else "",
        f"Threads: {cfg['threads']} for pretraining and adaptation, deterministic torch algorithms; "
        f"{host['cpu']['model']} ({host.get('torch_cpu_capability', '?')} torch kernels), torch "
        f"{host['versions'].get('torch', '-')}, onnxruntime {host['versions'].get('onnxruntime', '-')}. "
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
    ax1.set_title(f"LOSO accuracy, {len(result['subjects_done'])} subjects (lr chosen on source subjects)")
    ax1.legend(loc="lower right", fontsize=8)

    adapted = [m for m in names if summ[m]["median_call_peak_bytes"] is not None]
    step = [(summ[m]["median_step_peak_bytes"] or 0) / MB for m in adapted]
    call = [summ[m]["median_call_peak_bytes"] / MB for m in adapted]
    xs = range(len(adapted))
    ax2.bar([i - 0.2 for i in xs], step, width=0.4, color=[colors[names.index(m)] for m in adapted],
            label="one training step")
    ax2.bar([i + 0.2 for i in xs], call, width=0.4, color="#cfd8dc", edgecolor="#607d8b", label="whole adapt call")
    for i, m in enumerate(adapted):
        ax2.text(i, max(step[i], call[i]), f"{summ[m]['trainable_numel']:,} el.", ha="center", va="bottom", fontsize=7)
    ax2.set_xticks(list(xs), adapted, rotation=30, ha="right")
    ax2.set_ylim(0, max(step + call + [0.1]) * 1.3)
    ax2.set_ylabel("peak resident memory (VmHWM), MB over loaded model")
    ax2.set_title("Adaptation memory (median over subjects)")
    ax2.legend(loc="upper left", fontsize=8)
    cfg = result["config"]
    fig.suptitle(f"{cfg['dataset']} / {cfg['model']}, k={cfg['k_per_class']}, {cfg['epochs']} epochs", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def validated_update(args, fold_ds: WindowDataset, target: int, model, split, method: str, lr: float):
    """What budget ``method`` trains, validated on ``--selection-subjects`` source subjects of the
    fold with this study's adaptation recipe (docs/scheduler.md). Only source windows are read:
    the importance of the planner's candidates is measured on labelled source windows."""
    import torch

    from edgeadapt.harness.validated_selection import (FinetuneRecipe, InnerSubjectScorer, choose_update_for_model,
                                                       source_importance)

    recipe = FinetuneRecipe(lr=lr if lr > 0 else FIXED_LR, weight_decay=0.01, epochs=args.epochs, batch_windows=16,
                            seed=args.seed)
    scorer = InnerSubjectScorer(fold_ds.subset(fold_ds.subject != target), args.model, recipe,
                                k_per_class=args.k_per_class, pretrain_epochs=args.pretrain_epochs,
                                validation_subjects=args.selection_subjects, seed=args.seed, target_subject=target,
                                threads=args.threads)
    src = split.source_train
    importance = source_importance(model, torch.from_numpy(src.X[:2]), src, seed=args.seed, target_subject=target)
    return choose_update_for_model(model, torch.from_numpy(src.X[:2]), METHODS[method].memory_budget, scorer,
                                   n_windows=len(split.target_adapt.y), batch_windows=16, importance=importance)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", default="synthetic", help="synthetic, watch, or a .npz/.csv path")
    p.add_argument("--model", default="cnn", choices=("cnn", "mobilenet", "transformer"))
    p.add_argument("--k-per-class", type=int, default=5, help="labelled target windows per class to adapt on")
    p.add_argument("--epochs", type=int, default=40, help="adaptation epochs")
    p.add_argument("--pretrain-epochs", type=int, default=15)
    p.add_argument("--lr-grid", type=_positive, nargs="+", default=list(LR_GRID),
                   help="learning rates tried per method on the source subjects (default: %(default)s)")
    p.add_argument("--validation-subjects", type=int, default=2,
                   help="source subjects that play the new subject in turn when choosing learning rates")
    p.add_argument("--fixed-lr", type=_positive, nargs="?", const=FIXED_LR, default=None,
                   help=f"skip the selection: one learning rate for every method (default value {FIXED_LR:g})")
    p.add_argument("--subjects", type=int, nargs="+", help="target subjects to hold out (default: all)")
    p.add_argument("--methods", nargs="+", choices=ALL_METHODS[1:], default=list(ALL_METHODS[1:]),
                   help="adapted methods to run (source-only always)")
    p.add_argument("--memory-budget", metavar="BYTES",
                   help="also run a budget method: the planner picks what trains within this budget per adapt call "
                        "(bytes or e.g. 256KiB)")
    p.add_argument("--budget-selection", choices=("validated", "importance"), default="validated",
                   help="what a --memory-budget method trains: validated on source subjects (default; "
                        "edgeadapt.harness.validated_selection) or the planner's importance selection")
    p.add_argument("--selection-subjects", type=int, default=5,
                   help="source subjects the validated selection scores its candidates on (default 5)")
    p.add_argument("--target-shift", choices=SHIFTS, default=None,
                   help="a sensor shift applied to each held-out subject's windows (datasets/shifts.py)")
    p.add_argument("--adapt-classes", type=int, default=None, metavar="K",
                   help="label shift: each held-out subject's adaptation windows (as many as --k-per-class x "
                        "classes) show only K of its classes, in recording order; evaluation on all its other windows")
    p.add_argument("--unlabeled-fraction", type=float, default=None, metavar="F",
                   help="label-free methods only: each held-out subject adapts on the first F (0 < F < 1) of each of "
                        "its recordings, labels unused, and evaluates on the rest (a wearable's unlabelled "
                        "windows are many); default: as many windows as --k-per-class x classes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="threads for pretraining and adaptation (default 1)")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    p.add_argument("--tag", default="", help="suffix of the output file names")
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    if min(args.validation_subjects, args.selection_subjects, args.threads) < 1:
        p.error("--validation-subjects, --selection-subjects and --threads must be >= 1")
    if args.adapt_classes is not None and args.adapt_classes < 1:
        p.error("--adapt-classes must be >= 1")
    if args.unlabeled_fraction is not None:
        if not 0 < args.unlabeled_fraction < 1:
            p.error(f"--unlabeled-fraction must be in (0, 1), got {args.unlabeled_fraction}")
        labelled = [m for m in args.methods if not METHODS[m].label_free]
        if labelled or args.memory_budget or args.adapt_classes is not None:
            p.error("--unlabeled-fraction is for label-free methods only; drop "
                    + ", ".join([*labelled, *(["--memory-budget"] if args.memory_budget else []),
                                 *(["--adapt-classes"] if args.adapt_classes is not None else [])]))
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")

    command = " ".join([".venv/bin/python", "benchmarks/loso.py",
                        *map(shlex.quote, sys.argv[1:] if argv is None else argv)])
    start = time.perf_counter()
    ds = study_dataset(args.dataset, args.seed)
    subjects = [int(s) for s in ds.subjects]
    if args.subjects:
        unknown = sorted(set(args.subjects) - set(subjects))
        if unknown:
            p.error(f"subjects {unknown} are not in the dataset (subjects: {subjects})")
        subjects = [s for s in subjects if s in set(args.subjects)]
    methods = [m for m in METHODS if m in args.methods]
    if args.memory_budget:
        methods.append(budget_method(args.memory_budget))
    dataset_tag = Path(args.dataset).stem if args.dataset not in ("synthetic", "watch") else args.dataset
    stem = f"loso_{dataset_tag}_{args.model}{args.tag}"
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"{command}\ndata: {args.dataset}, {len(ds.subjects)} subjects, {ds.n_classes} classes, windows "
          f"{ds.X.shape[1]} ch x {ds.X.shape[2]} steps; holding out {subjects}; methods {methods}", flush=True)

    import torch  # noqa: F401  (so that host_info reports torch's kernel level)

    result: dict = {
        "command": command,
        "code": code_version(REPO),
        "host": host_info(),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "dataset_shape": {"windows": int(ds.X.shape[0]), "channels": int(ds.X.shape[1]),
                          "time_steps": int(ds.X.shape[2]), "classes": int(ds.n_classes),
                          "subjects": [int(s) for s in ds.subjects]},
        "policies": {m: METHODS[m].policy_for(args.model) for m in methods},
        "lr_selection": ({"mode": "fixed", "lr": args.fixed_lr} if args.fixed_lr is not None else
                         {"mode": "leave-one-source-subject-out", "grid": list(args.lr_grid),
                          "validation_subjects": args.validation_subjects}),
        "folds": [], "rows": [], "subjects_done": [],
    }
    for i, target in enumerate(subjects):
        t_fold = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix=f"loso_{target}_") as work:
            if args.fixed_lr is not None:
                lrs = {m: args.fixed_lr for m in methods}
                selection = {}
            else:
                t0 = time.perf_counter()
                selection = select_learning_rates(
                    ds, target, methods, args.model, workdir=Path(work), validation_subjects=args.validation_subjects,
                    grid=tuple(args.lr_grid), k_per_class=args.k_per_class, epochs=args.epochs,
                    pretrain_epochs=args.pretrain_epochs, seed=args.seed, threads=args.threads,
                    unlabeled_fraction=args.unlabeled_fraction)
                lrs = {m: (selection[m].lr if m in selection else 0.0) for m in methods}
                print(f"  [{i + 1}/{len(subjects)}] subject {target}: learning rates chosen on source subjects "
                      f"{next(iter(selection.values())).validation_subjects if selection else '-'} in "
                      f"{time.perf_counter() - t0:.0f} s: " + ", ".join(f"{m} {lr:g}" for m, lr in lrs.items()),
                      flush=True)
            fold_ds = ds if args.target_shift is None else shift_subject(ds, target, args.target_shift, args.seed)
            label_free = {}
            for m in (m for m in methods if m == "label-free"):
                t0 = time.perf_counter()
                label_free[m] = select_label_free_settings(
                    fold_ds, target, args.model, workdir=Path(work), validation_subjects=args.validation_subjects,
                    k_per_class=args.k_per_class, pretrain_epochs=args.pretrain_epochs, seed=args.seed,
                    threads=args.threads, unlabeled_fraction=args.unlabeled_fraction)
                print(f"  [{i + 1}/{len(subjects)}] subject {target}: {m} settings chosen on source subjects "
                      f"{label_free[m].validation_subjects} in {time.perf_counter() - t0:.0f} s: "
                      f"{label_free[m].settings}",
                      flush=True)
            split = make_split(fold_ds, target, args.k_per_class, args.seed, adapt_classes=args.adapt_classes,
                               unlabeled_fraction=args.unlabeled_fraction)
            t0 = time.perf_counter()
            model = pretrain_source(args.model, split, epochs=args.pretrain_epochs, seed=args.seed,
                                    threads=args.threads)
            pretrain_s = time.perf_counter() - t0
            val_acc = per_subject_accuracy(model, split.source_val)
            total_numel = sum(int(q.numel()) for q in model.parameters())
            fold = {"subject": target, "pretrain_time_s": pretrain_s, "total_numel": total_numel,
                    "n_adapt_windows": int(len(split.target_adapt.y)), "n_eval_windows": int(len(split.target_eval.y)),
                    "source_val_accuracy": {str(k): v for k, v in val_acc.items()},
                    "source_val_accuracy_mean": statistics.fmean(val_acc.values()),
                    "lr_selection": {m: {"lr": v.lr, "grid": list(v.grid), "mean_accuracy": list(v.mean_accuracy),
                                         "validation_subjects": list(v.validation_subjects)}
                                     for m, v in selection.items()},
                    "label_free_selection": {m: {"settings": v.settings, "grid": list(v.grid), "gains": list(v.gains),
                                                 "scores": list(v.scores),
                                                 "validation_subjects": list(v.validation_subjects)}
                                             for m, v in label_free.items()}}
            reports = {}
            target_data = save_target_data(split, Path(work))
            chosen = {}
            if args.budget_selection == "validated":
                for m in (m for m in methods if METHODS[m].memory_budget is not None):
                    t0 = time.perf_counter()
                    try:
                        choice = validated_update(args, fold_ds, target, model, split, m, lrs[m])
                    except BudgetExceeded as e:  # nothing fits: the export would refuse it too (reported there)
                        print(f"  [{i + 1}/{len(subjects)}] subject {target}: {m}: no update fits ({e})", flush=True)
                        continue
                    chosen[m] = choice.chosen.policy
                    fold.setdefault("budget_selection", {})[m] = choice.to_dict()
                    print(f"  [{i + 1}/{len(subjects)}] subject {target}: {m} trains {choice.chosen.label} (chosen on "
                          f"source subjects in {time.perf_counter() - t0:.0f} s)", flush=True)
            for m in methods:
                try:
                    r = run_method(m, model, args.model, split, target_data, Path(work) / m, epochs=args.epochs,
                                   lr=lrs[m], seed=args.seed, threads=args.threads, policy=chosen.get(m),
                                   unlabeled=label_free[m].settings if m in label_free else None)
                except (SelfCheckError, UnsupportedOpError, BudgetExceeded) as e:
                    # the export refused this subject's bundle: the method does not run for it (no row)
                    reason = str(e).splitlines()[0][:400]
                    fold.setdefault("refused", {})[m] = reason
                    print(f"  [{i + 1}/{len(subjects)}] subject {target} {m:<10} export refused: {reason}",
                          flush=True)
                    continue
                if r["torch_imported"]:
                    raise RuntimeError("internal: the adaptation process imported torch")
                manifest = json.loads((Path(work) / m / "bundle" / "manifest.json").read_text())
                r["session"] = manifest.get("session")  # ORT session settings the exporter chose
                reports[m] = r
                print(f"  [{i + 1}/{len(subjects)}] subject {target} {m:<10} lr {r['lr']:<6g} acc "
                      f"{'  -  ' if r['accuracy_before'] is None else format(r['accuracy_before'], '.3f')} -> "
                      f"{r['accuracy_after']:.3f}  {r['trainable_numel']:>7,} el.  step/call peak "
                      f"{_mb(r['step_peak_bytes'])}/{_mb(r['call_peak_bytes'])} MB  "
                      f"{r['adapt_time_s']:.1f} s", flush=True)
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
                               "grad_adamw_bytes": 0, "lr": None, **{k: None for k in PEAKS},
                               "loaded_rss_bytes": None, "adapt_time_s": None, "adapt_time_vs_full": None})
        full_t = reports["full"]["adapt_time_s"] if "full" in reports else None
        for m, r in reports.items():
            # A method at learning rate 0 (bn-stats) trains no parameter, whatever its bundle could train.
            trained = r["trainable_numel"] if METHODS[m].trains else 0
            result["rows"].append({
                "subject": target, "method": m, "accuracy": r["accuracy_after"], "accuracy_source_only": source_only,
                "lr": r["lr"] if METHODS[m].trains else None,
                "trainable_numel": trained, "bundle_trainable_numel": r["trainable_numel"],
                "trained_bytes": trained * FLOAT32_BYTES, "grad_adamw_bytes": 3 * trained * FLOAT32_BYTES,
                **{k: r[k] for k in PEAKS},
                "loaded_rss_bytes": r["loaded_rss_bytes"], "load_rss_bytes": r["load_rss_bytes"],
                "adapt_time_s": r["adapt_time_s"], "adapt_time_vs_full": r["adapt_time_s"] / full_t if full_t else None,
                "policy": r["policy"], "loss": r["loss"], "batchnorm": r["batchnorm"], "steps": r["steps"],
                "epoch_losses": r["epoch_losses"], "accuracy_before": r["accuracy_before"], "session": r["session"],
                "label_free": r.get("label_free"),
            })
        fold["time_s"] = time.perf_counter() - t_fold
        result["folds"].append(fold)
        result["subjects_done"].append(target)
        result["source_val_accuracy_mean"] = statistics.fmean(f["source_val_accuracy_mean"] for f in result["folds"])
        result["summary"] = _summary(result["rows"], ["source-only", *methods])
        result["total_time_s"] = time.perf_counter() - start
        atomic_write_json(args.out / f"{stem}.json", result)
        s = result["summary"]
        print(f"[{i + 1}/{len(subjects)}] subject {target} done in {fold['time_s']:.0f} s "
              f"(pretrain {pretrain_s:.0f} s, "
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
