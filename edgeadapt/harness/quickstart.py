"""``edgeadapt quickstart``: the main job on built-in data, end to end, in one command.

Generate (or load) data, pretrain on the source subjects, export a sparse-update bundle, adapt
it to a held-out subject in a separate torch-free process, and report accuracy before/after,
what was trained, memory (the peak of one training step and of the whole adapt call, each as
total resident and anonymous-only memory over the loaded model) and the time, next to
last-layer, biases + norm affine and full fine-tuning. Writes ``report.json``, ``accuracy.png``,
``memory.png``.

Every setting is fixed in advance, none is tuned on the new subject: AdamW at
``study.FIXED_LR`` (3e-3) for every method, 40 adaptation epochs (3 with ``small``), batch 16,
15 pretraining epochs (2 with ``small``), seed 0. Threads are pinned (``threads``, default 1,
for pretraining and adaptation) with deterministic torch algorithms, so that a rerun on the same
machine gives the same figures; the report records them with the CPU model, its kernel ISA flags
and the library versions, on which the figures also depend.
"""

from __future__ import annotations

import logging
import math
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from ..atomic import atomic_write_json
from ..sched.errors import NoFeasiblePlan
from ..units import format_bytes, parse_bytes
from ..datasets import SyntheticConfig, WindowDataset, load_dataset, make_synthetic
from ..versions import host_info
from .study import (FIXED_LR, METHODS, budget_method, make_split, per_subject_accuracy, pretrain_source, run_method,
                    save_target_data)

__all__ = ["QuickstartConfig", "run_quickstart", "quickstart_command", "readme_table"]

log = logging.getLogger(__name__)

COMPARED = ("last-layer", "bias-norm", "full")
MAIN = "sparse"
MB = 2**20
BATCH_SIZE = 16  # windows per adaptation step (run_method's default)


@dataclass(frozen=True)
class QuickstartConfig:
    """Options of the quickstart; the defaults finish in well under a minute on 2 cores.

    Attributes:
        dataset: ``synthetic``, ``watch`` or a path to a ``.npz``/``.csv`` file.
        model: ``cnn``, ``mobilenet`` or ``transformer``.
        policy: ``sparse`` (the model's default sparse policy), ``last-layer``, ``bias-norm``,
            ``full``, or an ``UpdatePolicy.parse`` spec.
        out_dir: report folder.
        k_per_class: labelled windows per class of the new subject used for adaptation.
        epochs: adaptation epochs (default 40 on the few-shot set).
        seed: seeds data, pretraining and splits.
        small: a tiny setting for smoke tests (seconds, not minutes).
        target_subject: the held-out subject (default: the last one).
        memory_budget: also run the planner's choice within this budget per adapt call
            (e.g. ``"256KiB"``) next to the compared methods.
        threads: intra-op threads of pretraining (torch) and adaptation (ONNX Runtime), pinned
            so that the figures do not depend on the machine's core count.
        progress: progress bars (stderr) over pretraining epochs and each export's stages.
    """

    dataset: str = "synthetic"
    model: str = "cnn"
    policy: str = "sparse"
    out_dir: Path = Path("runs/quickstart")
    k_per_class: int = 5
    epochs: int | None = None
    seed: int = 0
    small: bool = False
    target_subject: int | None = None
    threads: int = 1
    memory_budget: str | None = None
    progress: bool = False


def _mb(n: int | None) -> str:
    """Bytes as MB (2**20) with one decimal; "-" where the runner measured nothing (no step ran)."""
    return "-" if n is None else f"{n / MB:.1f}"


def _load(cfg: QuickstartConfig) -> WindowDataset:
    if cfg.dataset == "synthetic":
        size = dict(n_subjects=4, windows_per_subject=90, n_time_steps=128) if cfg.small else {}
        return make_synthetic(SyntheticConfig(seed=cfg.seed, **size))
    return load_dataset(cfg.dataset)


def _plots(report: dict, out_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    subj = report["per_subject_source_only"]
    names = [f"S{s}" + (" (new)" if int(s) == report["target_subject"] else "") for s in subj]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.bar(range(len(subj)), list(subj.values()), color="#9db4c0", label="source model")
    t = list(subj).index(str(report["target_subject"]))
    ax.bar([t + 0.3], [report["main"]["accuracy_after"]], width=0.4, color="#c2185b",
           label=f"after adapting ({report['main']['method']})")
    ax.set_xticks(range(len(subj)), names, rotation=0)
    ax.set_ylim(0, 1)
    ax.set_ylabel("accuracy")
    ax.set_title("Per-subject accuracy (source subjects: held-out windows)")
    ax.legend(loc="lower left")
    fig.tight_layout()
    fig.savefig(out_dir / "accuracy.png", dpi=120)
    plt.close(fig)

    rows = [r for r in (report["main"], *report["compared"]) if r["feasible"]]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    x = list(range(len(rows)))
    step = [(r["step_peak_bytes"] or 0) / MB for r in rows]
    call = [(r["call_peak_bytes"] or 0) / MB for r in rows]
    ax.bar([i - 0.2 for i in x], step, width=0.4, color="#c2185b", label="one training step")
    ax.bar([i + 0.2 for i in x], call, width=0.4, color="#607d8b", label="whole adapt call")
    for i, r in enumerate(rows):
        ax.text(i, max(step[i], call[i]), f"acc {r['accuracy_after']:.2f}\n{r['trainable_numel']:,} el.",
                ha="center", va="bottom", fontsize=8)
    ax.set_xticks(x, [r["method"] for r in rows])
    ax.set_ylabel("peak resident memory, MB over loaded model")
    ax.set_title("Adaptation memory per method (torch-free runner, CPU; total, VmHWM)")
    ax.legend(loc="upper left", fontsize=8)
    ax.set_ylim(0, max(step + call) * 1.35 + 0.1)
    fig.tight_layout()
    fig.savefig(out_dir / "memory.png", dpi=120)
    plt.close(fig)


def run_quickstart(cfg: QuickstartConfig, echo: Callable[[str], None] = log.info) -> dict:
    """Run the quickstart; returns the report that is also written to ``out_dir/report.json``."""
    start = time.perf_counter()
    out_dir = Path(cfg.out_dir)
    work = out_dir / "work"
    if work.exists():
        if not (out_dir / "report.json").exists():
            raise FileExistsError(f"{work} exists but is not from a quickstart; choose another --out")
        shutil.rmtree(work)
    work.mkdir(parents=True)

    ds = _load(cfg)
    target = int(ds.subjects[-1] if cfg.target_subject is None else cfg.target_subject)
    split = make_split(ds, target, cfg.k_per_class, cfg.seed)
    echo(f"data: {cfg.dataset}, {len(ds.subjects)} subjects, {ds.n_classes} classes, windows "
         f"{ds.X.shape[1]} ch x {ds.X.shape[2]} steps; new subject {target}: "
         f"{len(split.target_adapt.y)} labelled windows to adapt on, {len(split.target_eval.y)} to evaluate")

    budget_name = None if cfg.memory_budget is None else budget_method(cfg.memory_budget)
    smallest = None if cfg.memory_budget is None else _smallest_budget_bytes(cfg.model, split)
    if smallest is not None and smallest > parse_bytes(cfg.memory_budget):
        echo(f"--memory-budget {cfg.memory_budget} is below the smallest plan for this model and data "
             f"({format_bytes(smallest)}): its row is reported as infeasible; --memory-budget "
             f"{math.ceil(smallest / 1024)}KiB or more runs it")

    pre_epochs = 2 if cfg.small else 15
    t0 = time.perf_counter()
    model = pretrain_source(cfg.model, split, epochs=pre_epochs, seed=cfg.seed, threads=cfg.threads,
                            progress=cfg.progress)
    pretrain_s = time.perf_counter() - t0
    source_acc = per_subject_accuracy(model, split.source_val)
    from ..export.pretrain import accuracy

    source_acc[target] = accuracy(model, split.target_eval.X, split.target_eval.y)
    known = [v for s, v in source_acc.items() if s != target]
    echo(f"pretrained {cfg.model} on the source subjects in {pretrain_s:.0f} s: accuracy "
         f"{sum(known) / len(known):.3f} on their held-out windows, {source_acc[target]:.3f} on the new subject")

    epochs = cfg.epochs or (3 if cfg.small else 40)
    # The chosen policy first, then the comparisons; any policy spec that is not a method name
    # runs as the sparse method with that policy. Every method at the same fixed learning rate.
    if cfg.policy in METHODS:
        runs = [(cfg.policy, None, cfg.policy, "main")]
    else:
        runs = [(MAIN, cfg.policy, cfg.policy, "main")]
    runs += [(m, None, m, m) for m in COMPARED if m != cfg.policy]
    if budget_name is not None:
        runs.append((budget_name, None, budget_name, "budget"))
    reports = []
    target_data = save_target_data(split, work)
    for method, policy, label, folder in runs:
        if folder == "budget" and smallest is not None and smallest > parse_bytes(cfg.memory_budget):
            reports.append(_infeasible(label, cfg.memory_budget, smallest))
            continue
        try:
            r = run_method(method, model, cfg.model, split, target_data, work / folder, epochs=epochs, lr=FIXED_LR,
                           seed=cfg.seed, threads=cfg.threads, policy=policy, progress=cfg.progress)
        except NoFeasiblePlan as e:  # the planner's own check, with the measured importance
            if folder != "budget":
                raise
            echo(f"  {label:<11} infeasible: {e}")
            reports.append(_infeasible(label, cfg.memory_budget, e.need_bytes))
            continue
        r["method"] = label
        r["feasible"] = True
        r["trained_modules"] = _trained_modules(work / folder / "bundle")
        if r["torch_imported"]:
            raise RuntimeError("internal: the adaptation process imported torch")
        reports.append(r)
        echo(f"  {r['method']:<11} accuracy {r['accuracy_before']:.3f} -> {r['accuracy_after']:.3f}, "
             f"trains {r['trainable_numel']:,} elements; memory over the loaded model: "
             f"one step {_mb(r['step_peak_bytes'])} MB, whole adapt call {_mb(r['call_peak_bytes'])} MB "
             f"(anonymous only {_mb(r['step_peak_anon_bytes'])} / {_mb(r['call_peak_anon_bytes'])} MB); "
             f"adapted in {r['adapt_time_s']:.1f} s")

    main = reports[0]
    report = {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()},
        "target_subject": target,
        "policy": main["policy"],
        "per_subject_source_only": {str(k): v for k, v in sorted(source_acc.items())},
        "pretrain_time_s": pretrain_s,
        "settings": {"fixed_in_advance": True, "lr": FIXED_LR, "optimizer": "adamw", "weight_decay": 0.01,
                     "epochs": epochs, "batch_size": BATCH_SIZE, "pretrain_epochs": pre_epochs, "seed": cfg.seed,
                     "pretrain_threads": cfg.threads, "adapt_threads": cfg.threads,
                     "deterministic_algorithms": True},
        "host": host_info(),
        "main": main,
        "compared": reports[1:],
        "total_time_s": time.perf_counter() - start,
    }
    atomic_write_json(out_dir / "report.json", report)
    _plots(report, out_dir)
    echo(f"new subject {target}: accuracy {main['accuracy_before']:.3f} before, {main['accuracy_after']:.3f} after "
         f"adapting with '{main['policy']}' ({main['trainable_numel']:,} elements; peak over the loaded model "
         f"{_mb(main['step_peak_bytes'])} MB for one step, {_mb(main['call_peak_bytes'])} MB for the whole "
         f"adapt call) in a torch-free process")
    host = report["host"]
    echo(f"settings fixed in advance: lr {FIXED_LR:g}, {epochs} epochs, seed {cfg.seed}, {cfg.threads} thread(s) "
         f"for pretraining and adaptation, deterministic torch algorithms; {host['cpu']['model']} "
         f"({host.get('torch_cpu_capability', '?')} torch kernels), torch {host['versions'].get('torch', '-')}, "
         f"onnxruntime {host['versions'].get('onnxruntime', '-')}")
    echo(f"report: {out_dir / 'report.json'}, plots: {out_dir / 'accuracy.png'}, {out_dir / 'memory.png'} "
         f"({report['total_time_s']:.0f} s in all); the table as README.md shows it:\n\n{readme_table(report)}")
    return report


def _smallest_budget_bytes(model_name: str, split) -> int:
    """The least budget any plan of the budget method fits (the model's architecture, the adapt
    call's window count and step size), known before pretraining: ``minimum_budget`` without the
    importance measured on the trained model, so never above the budget the export needs."""
    import torch

    from ..export import plan_cost
    from ..export.planning import model_graph
    from ..models import build_model
    from ..sched import minimum_budget

    X = split.target_adapt.X
    model = build_model(model_name, X.shape[1], split.source_train.n_classes, X.shape[2])
    graph, _ = model_graph(model, torch.from_numpy(X[:2]), "frozen")
    return minimum_budget(graph, n_windows=len(X), batch_windows=BATCH_SIZE, optimizer="adamw", allow_remat=False,
                          cost=plan_cost())


def _infeasible(method: str, memory_budget: str, smallest_bytes: int) -> dict:
    """The report row of a budget no plan fits: nothing ran; the smallest budget that would."""
    return {"method": method, "feasible": False, "policy": f"planned within {memory_budget}",
            "memory_budget_bytes": parse_bytes(memory_budget), "minimum_budget_bytes": int(smallest_bytes)}


def _trained_modules(bundle: Path) -> list[str]:
    """The modules whose parameters the bundle trains (in the model's order)."""
    from ..bundle import read_manifest

    names = [p.name.rsplit(".", 1)[0] for p in read_manifest(bundle, verify=False).parameters if p.trainable_numel]
    return list(dict.fromkeys(names))


def quickstart_command(config: dict) -> str:
    """The ``edgeadapt quickstart`` command line that reproduces a report's ``config`` (options
    left at their defaults, the report folder and progress bars omitted)."""
    args = []
    for key, default in asdict(QuickstartConfig()).items():  # in the options' order
        value = config.get(key, default)
        if key in ("out_dir", "progress") or value == default:
            continue
        flag = "--" + key.replace("_", "-")
        args += [flag] if value is True else [f"{flag} {value}"]
    return " ".join(["edgeadapt quickstart", *args])


def _label(row: dict) -> str:
    method = row["method"]
    if method.startswith("budget-"):
        what = ", ".join(row["trained_modules"]) if row["feasible"] else "no plan fits"
        return f"`--memory-budget {method.removeprefix('budget-')}` (the planner's choice: {what})"
    return f"{method} ({METHODS[method].description})" if method in METHODS else f"`--policy {row['policy']}`"


def readme_table(report: dict) -> str:
    """The quickstart's results as README.md shows them (markdown): the command and setting, a
    table of accuracy before → after, trained elements and memory per method, and the source
    model's accuracy. Every figure comes from ``report``; ``benchmarks/quickstart_readme.py``
    writes it into README.md and checks it against a fresh run."""
    host = report["host"]
    # the vector instructions torch and ONNX Runtime pick kernels by: on other ones every figure may move
    kernels = "kernels: " + (" ".join(host["cpu"].get("isa_flags", [])) or "none listed")
    source = {int(k): v for k, v in report["per_subject_source_only"].items() if int(k) != report["target_subject"]}
    lines = [f"Measured with `{quickstart_command(report['config'])}` ({report['total_time_s']:.0f} s; "
             f"{host['cpu']['model']}, {kernels}, {report['settings']['adapt_threads']} thread(s); subject "
             f"{report['target_subject']} held out; memory is over the loaded runner, total VmHWM delta with "
             f"anonymous-only in brackets):", "",
             "| method | accuracy on the new subject (before → after) | trained elements | engine | one step MB "
             "| whole adapt call MB |",
             "|---|---|---:|---|---:|---:|"]
    for i, r in enumerate([report["main"], *report["compared"]]):
        if not r["feasible"]:
            lines.append(f"| {_label(r)} | infeasible: the smallest plan needs "
                         f"{format_bytes(r['minimum_budget_bytes'])} | - | - | - | - |")
            continue
        after = f"{r['accuracy_after']:.3f}"
        lines.append(f"| {_label(r)} | {r['accuracy_before']:.3f} → {f'**{after}**' if i == 0 else after} "
                     f"| {r['trainable_numel']:,} | {r['backend']} "
                     f"| {_mb(r['step_peak_bytes'])} ({_mb(r['step_peak_anon_bytes'])}) "
                     f"| {_mb(r['call_peak_bytes'])} ({_mb(r['call_peak_anon_bytes'])}) |")
    lines += ["", f"(The source model scores {sum(source.values()) / len(source):.3f} on held-out windows of the "
                  f"{len(source)} training subjects.)"]
    return "\n".join(lines)

