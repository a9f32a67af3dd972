"""The memory budget as the one knob: predicted vs measured memory, torch eager, accuracy, planner time.

Four parts, each printed as a table and written to ``--out`` (``budget_*.json/.md/.png``):

1. **Memory** (default; ``--no-memory`` skips it). On the CNN, MobileNet and transformer
   references (``edgeadapt.models.build_model``, ``--channels`` x ``--time-steps`` input,
   ``--classes`` outputs, seeded initialisation), at ``--budgets`` budgets spaced geometrically
   from the smallest feasible one (``edgeadapt.sched.minimum_budget``) to the predicted peak of
   full fine-tuning (plus ``--extra-budget`` values inside that range): export a bundle with
   ``export_bundle(memory_budget=B, n_windows=N, batch_windows=b)`` (the planner picks what
   trains), then measure one ``Runner.adapt`` call over ``N`` synthetic windows (``--epochs``
   epochs, batch ``b``, the plan's micro-batch) by the project's measuring protocol
   (``edgeadapt.measure``: a fresh process where ``import torch`` fails, as a user has it:
   bundle loaded, progress bar on, nothing warmed up, freed heap returned to the OS before the
   baseline: what the call allocates).
   The figures: the whole call's peak over the process just before it, anonymous (sampled
   RssAnon) and total (VmHWM), next to the plan's predicted whole-call peak (the manifest's
   ``predicted_peak_bytes``); one step's peak is the runner's own (``AdaptResult``).
2. **Torch eager full fine-tuning** at the same batch in the same invocation, fresh process:
   the same weights, BatchNorm on running statistics (the bundle's frozen BatchNorm), AdamW with
   the bundle's settings. Warm-up first (docs/ort_notes.md, "Measuring a step's memory"): one
   2-window step on a throw-away copy of the model pages in torch's code; then the baseline is
   taken with the model loaded. Measured: the first step, and the whole adapt-equivalent loop
   (same epochs, batches, shuffling; no rollback copy, so torch's figure is a lower bound of
   what an equivalent ``adapt`` would hold), total (VmHWM delta) and anonymous (RssAnon sampled
   by ``edgeadapt.memory.AnonPeakSampler``). Each budget row gives torch / runner for both.
3. **Accuracy vs budget** (``--loso``; ``--quick``: 3 subjects): leave-one-subject-out on the
   watch IMU data (``edgeadapt.datasets.load_watch``; 10 subjects, 7 classes), one CNN
   pretrained per fold on the source subjects (``edgeadapt.harness.study.make_split`` /
   ``pretrain_source``), ``--k-per-class`` labelled target windows per class to adapt on, the
   target's other windows to evaluate. Each budget of a ladder made on the watch CNN's graph
   (the planner's own choice of what trains, by the empirical Fisher importance measured on
   labelled source-subject windows of the fold) runs next to the hand-written presets
   (last-layer, bias-norm, sparse, full), every adaptation in a fresh torch-free process that
   also measures the whole-call peak; torch eager full fine-tuning on the watch shape is
   measured once for the ratio column. Learning rate: fixed in advance (``--lr``, default
   ``study.FIXED_LR``) for every method and budget, never tuned on any subject. PNG: mean
   accuracy (worst subject as markers) against the measured whole-call peak, log scale, with
   the Pareto front.
4. **Planner time**: the remat DP (``min_flops_schedule``, ``min_peak_schedule``) on a seeded
   500-op chain, sqrt(n) checkpointing's peak for comparison; ``minimum_budget`` and
   ``plan_for_budget`` on each reference model.

Every measured process pins ``--threads`` intra-op threads. MB = 2**20 bytes, KiB = 2**10.

Usage::

    .venv/bin/python benchmarks/budget_sweep.py                      # memory + planner time
    .venv/bin/python benchmarks/budget_sweep.py --no-memory --loso   # accuracy vs budget only
    .venv/bin/python benchmarks/budget_sweep.py --no-memory --loso --quick
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import logging
import math
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from edgeadapt.harness.budget_check import budget_ladder  # noqa: E402  (after the path setup)
from edgeadapt.harness.validated_selection import IMPORTANCE_WINDOWS, describe_picks  # noqa: E402
from edgeadapt.units import format_bytes  # noqa: E402

log = logging.getLogger("budget_sweep")

KIB, MB = 1024, 2**20
MODELS = ("cnn", "mobilenet", "transformer")
PRESETS = ("last-layer", "bias-norm", "sparse", "full")
# RssAnon sampling interval of the torch worker (the runner's AdaptResult samples every 1 ms too).
ANON_INTERVAL_S = 0.001
WEIGHT_DECAY = 0.01
# Source subjects of each fold on which the validated selection scores its candidates.
VALIDATION_SUBJECTS = 5


# ------------------------------------------------------------------------------------------
# Pure helpers
# ------------------------------------------------------------------------------------------
def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``, None when either is missing or ``b`` is 0."""
    if a is None or b is None or b == 0:
        return None
    return a / b


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points not dominated (lower-or-equal x and higher-or-equal y, one strictly),
    ordered by x."""
    order = sorted(range(len(points)), key=lambda i: (points[i][0], -points[i][1]))
    front, best = [], -math.inf
    for i in order:
        if points[i][1] > best:
            front.append(i)
            best = points[i][1]
    return front


# ------------------------------------------------------------------------------------------
# Worker side: a fresh process per measurement (stdlib + numpy at import; torch only in "torch")
# ------------------------------------------------------------------------------------------
def _synthetic_data(n: int, shape: tuple[int, ...], n_classes: int, seed: int):
    import numpy as np

    rng = np.random.default_rng(seed)
    X = rng.standard_normal((n, *shape)).astype(np.float32)
    return X, (np.arange(n) % n_classes).astype(np.int64)


def _warm_up_python(n: int, seed: int) -> None:
    """First use, before the baseline, of what an adapt loop uses besides the engine.

    numpy's first ``default_rng(...).permutation`` in a process pages in ~2 MiB of code and
    allocates ~0.8 MiB of anonymous memory once (measured); without this the first shuffle of
    the measured call would count it. A temporary directory (the runner's rollback scratch) too.
    """
    import numpy as np

    np.random.default_rng(seed).permutation(n)
    with tempfile.TemporaryDirectory(prefix="budget_sweep-warm-"):
        pass


def torch_job(spec: dict[str, Any]) -> dict[str, Any]:
    """Torch eager full fine-tuning: warm-up on a copy, baseline, first step, whole loop (see part 2)."""
    import numpy as np
    import torch

    from edgeadapt.memory import AnonPeakSampler, peak_rss_bytes, reset_peak_rss, status_fields, trim_heap
    from edgeadapt.models import build_model

    torch.set_num_threads(spec["threads"])
    model = build_model(spec["model"], spec["n_channels"], spec["n_classes"], spec["time_steps"])
    model.load_state_dict(torch.load(spec["state_dict"], weights_only=True))
    model.eval()  # BatchNorm on running statistics, as the bundle's frozen BatchNorm; no dropout
    X, y = _synthetic_data(spec["n_windows"], (spec["n_channels"], spec["time_steps"]), spec["n_classes"],
                           spec["seed"])
    loss_fn = torch.nn.CrossEntropyLoss()

    def optimizer(m):
        return torch.optim.AdamW(m.parameters(), lr=spec["lr"], weight_decay=WEIGHT_DECAY)

    # Warm-up on a throw-away copy with 2 windows: torch's code for forward, backward and AdamW paged in.
    _warm_up_python(len(X), spec["seed"])
    spare = copy.deepcopy(model)
    opt = optimizer(spare)
    loss_fn(spare(torch.from_numpy(X[:2])), torch.from_numpy(y[:2])).backward()
    opt.step()
    del spare, opt
    gc.collect()
    opt = optimizer(model)
    n, b = len(X), spec["batch_windows"]
    step_total = step_anon = None
    steps = 0
    heap_trimmed = trim_heap()  # the measuring protocol, as for the runner
    base = status_fields("VmRSS", "RssAnon")
    reset_ok = reset_peak_rss()
    t0 = time.perf_counter()
    with AnonPeakSampler(ANON_INTERVAL_S) as sampler:
        for epoch in range(spec["epochs"]):
            order = np.random.default_rng(spec["seed"] + epoch).permutation(n)
            for start in range(0, n, b):
                idx = order[start:start + b]
                loss = loss_fn(model(torch.from_numpy(X[idx])), torch.from_numpy(y[idx]))
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                steps += 1
                if step_total is None:  # the first step: gradients and AdamW state are allocated in it
                    sampler.sample()
                    step_total, step_anon = peak_rss_bytes(), sampler.peak_bytes
    elapsed = time.perf_counter() - t0
    return {
        "torch_imported": True, "threads": torch.get_num_threads(), "steps": steps, "loop_time_s": elapsed,
        "total_numel": sum(p.numel() for p in model.parameters()), "peak_reset_ok": reset_ok,
        "heap_trimmed": heap_trimmed, "loaded_rss_bytes": base["VmRSS"], "loaded_anon_bytes": base["RssAnon"],
        "step_peak_bytes": max(0, step_total - base["VmRSS"]),
        "step_peak_anon_bytes": max(0, step_anon - base["RssAnon"]),
        "call_peak_bytes": max(0, peak_rss_bytes() - base["VmRSS"]),
        "call_peak_anon_bytes": max(0, sampler.peak_bytes - base["RssAnon"]),
        "anon_samples": sampler.samples,
    }


def _worker_main(kind: str, spec_path: str, report_path: str) -> int:
    from edgeadapt.atomic import atomic_write_json

    spec = json.loads(Path(spec_path).read_text())
    atomic_write_json(report_path, torch_job(spec))
    return 0


def run_worker(kind: str, spec: dict[str, Any], workdir: Path, timeout_s: float = 900) -> dict[str, Any]:
    """``kind="runner"``: one adapt call measured by the project's protocol (``edgeadapt.measure``:
    a fresh torch-free process as a user has it, progress bar on, nothing warmed up, freed heap
    returned to the OS before the baseline); ``kind="torch"``: :func:`torch_job` in a fresh process.

    Raises:
        RuntimeError: the process failed; the message carries its stderr.
    """
    if kind == "runner":
        from edgeadapt.measure import MeasureSpec, measure_in_fresh_process

        report = measure_in_fresh_process(
            MeasureSpec(bundle=spec["bundle"], n_windows=spec.get("n_windows"), batch_windows=spec["batch_windows"],
                        epochs=spec["epochs"], lr=spec.get("lr"), seed=spec["seed"], threads=spec["threads"],
                        adapt_data=spec.get("adapt_data"), eval_data=spec.get("eval_data"), trim_heap=True),
            timeout_s=timeout_s, env={"OMP_NUM_THREADS": str(spec["threads"]), "MKL_NUM_THREADS": str(spec["threads"])})
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "runner_report.json").write_text(json.dumps(report))
        return report
    workdir.mkdir(parents=True, exist_ok=True)
    spec_path, report_path = workdir / f"{kind}_spec.json", workdir / f"{kind}_report.json"
    spec_path.write_text(json.dumps(spec))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(OMP_NUM_THREADS=str(spec["threads"]), MKL_NUM_THREADS=str(spec["threads"]))
    proc = subprocess.run([sys.executable, os.fspath(Path(__file__).resolve()), "--worker", kind, str(spec_path),
                           str(report_path)], capture_output=True, text=True, timeout=timeout_s, cwd=REPO, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"the {kind} worker failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(report_path.read_text())


# ------------------------------------------------------------------------------------------
# Parent side (torch): models, ladders, exports
# ------------------------------------------------------------------------------------------
def reference_model(name: str, n_channels: int, n_classes: int, time_steps: int, seed: int):
    """A seeded reference model in eval mode."""
    import torch

    from edgeadapt.models import build_model

    torch.manual_seed(seed)
    return build_model(name, n_channels, n_classes, time_steps).eval()


def model_ladder(model, example, *, n_windows: int, batch_windows: int, count: int,
                 extra: tuple[int, ...] = ()) -> dict[str, Any]:
    """The graph IR of ``model`` and its budget ladder: ``minimum_budget`` .. full fine-tuning's
    predicted peak, with the planner times."""
    from edgeadapt import sched
    from edgeadapt.export import plan_cost
    from edgeadapt.export.planning import model_graph

    t0 = time.perf_counter()
    graph, weights = model_graph(model, example, "frozen")
    graph_s = time.perf_counter() - t0
    cost = plan_cost()  # the bundles this sweep exports hold the engines an "auto" export writes
    t0 = time.perf_counter()
    low = sched.minimum_budget(graph, n_windows=n_windows, batch_windows=batch_windows, cost=cost)
    minimum_s = time.perf_counter() - t0
    full = sched.plan_from_policy(graph, sched.UpdatePolicy.full(), weights=weights, batch_windows=batch_windows,
                                  n_windows=n_windows)
    full_peak = sched.predict(graph, full, cost).peak_bytes
    return {"graph": graph, "n_ops": len(graph.ops), "n_params": len(graph.params),
            "minimum_budget_bytes": low, "full_predicted_bytes": full_peak,
            "budgets": budget_ladder(low, max(low, full_peak), count, extra),
            "graph_s": graph_s, "minimum_budget_s": minimum_s}


def plan_summary(plan: dict[str, Any]) -> dict[str, Any]:
    """The manifest plan's main decisions, for tables."""
    trained = [p for p in plan.get("params", []) if p.get("mode", "frozen") != "frozen"]
    acts = plan.get("activations", [])
    return {"trained_params": len(trained), "cut": plan.get("cut"), "cache_features": plan.get("cache_features"),
            "micro_batch_windows": plan.get("micro_batch_windows"),
            "recomputed": sum(1 for _, action in acts if action == "recompute"),
            "predicted_peak_bytes": plan.get("predicted_peak_bytes"),
            "expected_peak_bytes": plan.get("expected_peak_bytes"),
            "predicted_where": (plan.get("predicted") or {}).get("where")}


def export_bundle_at(model, example, out: Path, *, lr: float, budget: int | None = None, policy=None,
                     n_windows: int, batch_windows: int, batchnorm: str = "frozen",
                     importance: dict | None = None) -> tuple[dict[str, Any], float]:
    """Export ``model`` under ``budget`` (the planner picks what trains, by ``importance``;
    default: the exporter measures it on ``example``) or with ``policy`` (an ``UpdatePolicy`` or
    its ``UpdatePolicy.parse`` spec; with a budget: fitted to it); returns the manifest as JSON
    and the export time."""
    from edgeadapt.export import OptimizerConfig, UpdatePolicy, export_bundle

    t0 = time.perf_counter()
    extra = {} if importance is None else {"importance": importance}
    if isinstance(policy, str):
        policy = UpdatePolicy.parse(policy)
    export_bundle(model, example, out, policy=policy,
                  memory_budget=budget, n_windows=n_windows, batch_windows=batch_windows, batchnorm=batchnorm,
                  optimizer=OptimizerConfig("adamw", lr=lr, weight_decay=WEIGHT_DECAY), **extra)
    return json.loads((out / "manifest.json").read_text()), time.perf_counter() - t0


# ------------------------------------------------------------------------------------------
# Part 1 + 2 + 4: memory and planner time
# ------------------------------------------------------------------------------------------
def memory_sweep(args, work: Path) -> dict[str, Any]:
    """Parts 1, 2 and 4 for every model of ``args.models``."""
    import torch

    from edgeadapt import sched

    out: dict[str, Any] = {"models": {}}
    for name in args.models:
        model = reference_model(name, args.channels, args.classes, args.time_steps, args.seed)
        example = torch.randn(2, args.channels, args.time_steps, generator=torch.Generator().manual_seed(args.seed))
        ladder = model_ladder(model, example, n_windows=args.n_windows, batch_windows=args.batch,
                              count=args.budgets, extra=tuple(args.extra_budget))
        graph = ladder.pop("graph")
        mid = ladder["budgets"][len(ladder["budgets"]) // 2]
        t0 = time.perf_counter()
        sched.plan_for_budget(graph, mid, n_windows=args.n_windows, batch_windows=args.batch)
        ladder["plan_for_budget_s"], ladder["plan_for_budget_at_bytes"] = time.perf_counter() - t0, mid
        print(f"{name}: {ladder['n_ops']} ops; smallest feasible budget "
              f"{format_bytes(ladder['minimum_budget_bytes'])}, "
              f"full fine-tuning predicted {format_bytes(ladder['full_predicted_bytes'])}; budgets "
              + ", ".join(format_bytes(b) for b in ladder["budgets"]), flush=True)
        mdir = work / name
        mdir.mkdir(parents=True)
        state = mdir / "state.pt"
        torch.save(model.state_dict(), state)
        torch_spec = {"model": name, "state_dict": str(state), "n_channels": args.channels, "n_classes": args.classes,
                      "time_steps": args.time_steps, "n_windows": args.n_windows, "batch_windows": args.batch,
                      "epochs": args.epochs, "threads": args.threads, "seed": args.seed, "lr": args.lr}
        torch_runs = [run_worker("torch", torch_spec, mdir / f"torch{r}") for r in range(args.repeats)]
        eager = _median_report(torch_runs)
        print(f"  torch eager full FT: step {format_bytes(eager['step_peak_bytes'])} / anon "
              f"{format_bytes(eager['step_peak_anon_bytes'])}, loop {format_bytes(eager['call_peak_bytes'])} / anon "
              f"{format_bytes(eager['call_peak_anon_bytes'])}", flush=True)
        rows = []
        for i, budget in enumerate(ladder["budgets"]):
            bundle = mdir / f"bundle{i}"
            try:
                manifest, export_s = export_bundle_at(model, example, bundle, lr=args.lr, budget=budget,
                                                      n_windows=args.n_windows, batch_windows=args.batch)
            except Exception as e:  # report the failing API precisely, keep the sweep going
                log.exception("export at %d bytes failed", budget)
                rows.append({"budget_bytes": budget, "error": f"export: {type(e).__name__}: {e}"})
                continue
            spec = {"bundle": str(bundle), "n_windows": args.n_windows, "batch_windows": args.batch,
                    "epochs": args.epochs, "threads": args.threads, "seed": args.seed, "lr": args.lr}
            try:
                runs = [run_worker("runner", spec, bundle.parent / f"run{i}-{r}") for r in range(args.repeats)]
            except RuntimeError as e:
                rows.append({"budget_bytes": budget, "error": f"adapt: {str(e)[-600:]}",
                             **plan_summary(manifest["plan"])})
                continue
            measured = _median_report(runs)
            plan = plan_summary(manifest["plan"])
            pred = plan["predicted_peak_bytes"]
            expected = (plan["expected_peak_bytes"] or {}).get(measured.get("backend"))  # the engine that ran it
            row = {"budget_bytes": budget, "export_s": export_s, **plan,
                   "trainable_numel": manifest_trainable(manifest), **measured,
                   "predicted_over_measured": ratio(pred, measured["call_peak_bytes"]),
                   "predicted_over_measured_anon": ratio(pred, measured["call_peak_anon_bytes"]),
                   "expected_peak_bytes": expected,
                   "expected_over_measured_anon": ratio(expected, measured["call_peak_anon_bytes"]),
                   "torch_over_runner": ratio(eager["call_peak_bytes"], measured["call_peak_bytes"]),
                   "torch_over_runner_anon": ratio(eager["call_peak_anon_bytes"], measured["call_peak_anon_bytes"]),
                   "runs": runs}
            rows.append(row)
            print("  " + _memory_line(row), flush=True)
        out["models"][name] = {"ladder": ladder, "torch_eager": {**eager, "runs": torch_runs}, "rows": rows}
    from edgeadapt.sched.remat_timing import time_chain_planner

    out["chain"] = time_chain_planner(500, args.seed)
    return out


def manifest_trainable(manifest: dict[str, Any]) -> int:
    return sum(int(p.get("trainable_numel", 0)) for p in manifest.get("parameters", []))


def _median_report(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Median of each ``*_bytes`` figure over repeated fresh-process runs (the rest from the first)."""
    out = {k: v for k, v in runs[0].items() if not k.endswith("_bytes")}
    for k in runs[0]:
        if k.endswith("_bytes"):
            vals = [r[k] for r in runs if r.get(k) is not None]
            out[k] = int(statistics.median(vals)) if vals else None
    return out


def _memory_line(r: dict[str, Any]) -> str:
    if "error" in r:
        return f"budget {format_bytes(r['budget_bytes'])}: {r['error'][:200]}"
    return (f"budget {format_bytes(r['budget_bytes']):>10}: {r['trainable_numel']:>7,} el., "
            f"micro {r['micro_batch_windows']}, "
            f"cut {r['cut']}{' cached' if r['cache_features'] else ''}, recompute {r['recomputed']}; predicted "
            f"{format_bytes(r['predicted_peak_bytes'])}, measured call {format_bytes(r['call_peak_bytes'])} / anon "
            f"{format_bytes(r['call_peak_anon_bytes'])}, step {format_bytes(r['step_peak_bytes'])}; torch/runner "
            f"{_x(r['torch_over_runner'])} / anon {_x(r['torch_over_runner_anon'])}")


def _count(n: int | None) -> str:
    return "-" if n is None else f"{n:,}"


def _x(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}x"


def memory_markdown(res: dict[str, Any]) -> str:
    cfg = res["config"]
    lines = [
        f"### Memory under a budget: {cfg['channels']} x {cfg['time_steps']} input, {cfg['classes']} classes, "
        f"{cfg['n_windows']} adaptation windows, batch {cfg['batch']}, {cfg['epochs']} epochs, AdamW, "
        f"{cfg['threads']} thread(s)",
        "",
        f"Command: `{res['command']}`",
        "",
        "Each budget: `export_bundle(memory_budget=B)` (the planner picks what trains), then one `Runner.adapt` call "
        "in a fresh torch-free process (median over "
        f"{cfg['repeats']} process(es)). *Predicted*: the plan's whole-call peak, the bound the budget was "
        "checked against; *expected*: the cost model's point estimate of it; "
        "*call* / *step*: measured peak of the "
        "whole adapt call / of one optimizer step over the loaded runner (AdaptResult), total = VmHWM delta, anon = "
        "sampled RssAnon. *pred/meas*: predicted / measured call peak (total; anon in brackets); *exp/anon*: "
        "expected / measured anon call peak. *torch/runner*: "
        "torch eager full fine-tuning at the same batch (whole loop, fresh process, warmed up) over the runner's "
        "call peak, total and anon.",
        "",
    ]
    for name, m in res["models"].items():
        lad, eager = m["ladder"], m["torch_eager"]
        lines += [
            f"**{name}** ({lad['n_ops']} ops): smallest feasible budget {format_bytes(lad['minimum_budget_bytes'])}; "
            f"torch eager full FT: first step {format_bytes(eager['step_peak_bytes'])} (anon "
            f"{format_bytes(eager['step_peak_anon_bytes'])}), "
            f"whole loop {format_bytes(eager['call_peak_bytes'])} (anon "
            f"{format_bytes(eager['call_peak_anon_bytes'])}).",
            "",
            "| budget | trains (elements) | micro-batch | cut (cached) | recompute | expected | predicted "
            "| call total | call anon "
            "| step total | step anon | exp/anon | pred/meas | anon/budget | torch/runner total | torch/runner anon |",
            "|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|",
        ]
        for r in m["rows"]:
            if "error" in r:
                lines.append(f"| {format_bytes(r['budget_bytes'])} | error: {r['error'][:160]} |" + " |" * 14)
                continue
            lines.append(
                f"| {format_bytes(r['budget_bytes'])} | {r['trainable_numel']:,} | {r['micro_batch_windows']} | "
                f"{r['cut']}{' (yes)' if r['cache_features'] else ''} | {r['recomputed']} | "
                f"{format_bytes(r.get('expected_peak_bytes'))} | "
                f"{format_bytes(r['predicted_peak_bytes'])} | {format_bytes(r['call_peak_bytes'])} | "
                f"{format_bytes(r['call_peak_anon_bytes'])} | {format_bytes(r['step_peak_bytes'])} | "
                f"{format_bytes(r['step_peak_anon_bytes'])} | {_x(r.get('expected_over_measured_anon'), 2)} | "
                f"{_x(r['predicted_over_measured'], 2)} "
                f"({_x(r['predicted_over_measured_anon'], 2)}) | "
                f"{_x(ratio(r['call_peak_anon_bytes'], r['budget_bytes']), 2)} | {_x(r['torch_over_runner'])} | "
                f"{_x(r['torch_over_runner_anon'])} |")
        ok = [r for r in m["rows"] if "error" not in r]
        close = sum(1 for r in ok if r.get("expected_over_measured_anon") is not None
                    and abs(r["expected_over_measured_anon"] - 1) <= 0.15)
        bound_close = sum(1 for r in ok if abs(r["predicted_over_measured_anon"] - 1) <= 0.15)
        kept = sum(1 for r in ok if r["call_peak_anon_bytes"] <= r["budget_bytes"])
        lines += ["", f"{name}: expected within +-15% of the measured anonymous call peak at {close} of {len(ok)} "
                      f"budgets (the predicted bound at {bound_close}); "
                      f"the measured anonymous call peak stayed within the budget at {kept} of {len(ok)}; "
                      f"{len(m['rows']) - len(ok)} export(s) failed.", ""]
    lines += ["**Planner time** (this machine, shared; one run each):", ""]
    c = res["chain"]
    lim = c["limits"][0]
    lines.append(f"- remat DP on a {c['n_ops']}-op chain: least peak {c['min_peak_s'] * 1e3:.0f} ms "
                 f"(CPU {c['min_peak_cpu_s'] * 1e3:.0f} ms; {format_bytes(c['min_peak_bytes'])} per window vs keep-all "
                 f"{format_bytes(c['keep_all_peak_bytes'])}, sqrt(n) {format_bytes(c['sqrt_peak_bytes'])}); "
                 "least FLOPs under "
                 f"{format_bytes(lim['limit_bytes'])}: {lim['min_flops_s'] * 1e3:.0f} ms "
                 f"(CPU {lim['min_flops_cpu_s'] * 1e3:.0f} ms)")
    for name, m in res["models"].items():
        lad = m["ladder"]
        lines.append(f"- {name}: graph IR from ONNX {lad['graph_s']:.2f} s, "
                     f"minimum_budget {lad['minimum_budget_s']:.2f} s, "
                     f"plan_for_budget({format_bytes(lad['plan_for_budget_at_bytes'])}) "
                     f"{lad['plan_for_budget_s']:.2f} s")
    lines.append("")
    lines.append(f"Host: {res['host'].get('cpu', {}).get('model', '?')}, load average at start "
                 f"{res['loadavg_start'][0]:.1f}; versions {res['host'].get('versions', {})}.")
    return "\n".join(lines) + "\n"


def _log_ticks(axis) -> None:
    """Log-scale ticks at 1, 2 and 5 per decade, written as plain numbers."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(NullFormatter())


def plot_memory(res: dict[str, Any], path: Path) -> None:
    """Per model: predicted and measured whole-call peaks against the budget (log-log), torch eager as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from edgeadapt.atomic import atomic_path

    names = list(res["models"])
    fig, axes = plt.subplots(1, len(names), figsize=(4.6 * len(names), 4.2), squeeze=False)
    for ax, name in zip(axes[0], names):
        m = res["models"][name]
        rows = [r for r in m["rows"] if "error" not in r]
        b = [r["budget_bytes"] / KIB for r in rows]
        ax.plot(b, [r["predicted_peak_bytes"] / KIB for r in rows], "o-", color="tab:blue", label="predicted")
        ax.plot(b, [r["call_peak_bytes"] / KIB for r in rows], "s-", color="tab:gray", label="measured call, total")
        ax.plot(b, [max(1, r["call_peak_anon_bytes"]) / KIB for r in rows], "^-", color="tab:green",
                label="measured call, anon")
        lo, hi = min(b), max(b)
        ax.plot([lo, hi], [lo, hi], ":", color="tab:red", label="= budget")
        e = m["torch_eager"]
        ax.axhline(e["call_peak_anon_bytes"] / KIB, color="tab:orange", ls="--", label="torch eager full FT, anon")
        ax.set_xscale("log")
        ax.set_yscale("log")
        _log_ticks(ax.xaxis)
        ax.set_xlabel("budget (KiB)")
        ax.set_ylabel("whole adapt call peak (KiB over loaded)")
        ax.set_title(name)
        ax.legend(fontsize=7)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)


# ------------------------------------------------------------------------------------------
# Part 3: accuracy vs budget (watch LOSO)
# ------------------------------------------------------------------------------------------
def loso_sweep(args, work: Path, on_fold=None) -> dict[str, Any]:
    """Part 3: per fold, pretrain, then every budget of the ladder and every preset in fresh processes.

    ``on_fold(result)``, if given, receives the result so far after every fold (``subjects``:
    the folds done), so that an interrupted run still leaves its finished folds behind."""
    import torch

    from edgeadapt.datasets import load_watch
    from edgeadapt.export.pretrain import accuracy
    from edgeadapt.harness.study import METHODS, make_split, pretrain_source, save_target_data
    from edgeadapt.harness.validated_selection import choose_update_for_model, source_importance

    ds = load_watch()
    subjects = [int(s) for s in ds.subjects]
    if args.quick:
        subjects = subjects[:3]
    n_classes, shape = int(ds.n_classes), tuple(ds.X.shape[1:])
    n_windows = args.k_per_class * n_classes
    print(f"LOSO watch / cnn: {len(subjects)} of {len(ds.subjects)} subjects, {n_classes} classes, windows {shape}, "
          f"k={args.k_per_class} ({n_windows} adaptation windows), batch {args.loso_batch}, {args.loso_epochs} epochs, "
          f"lr {args.lr:g} fixed in advance", flush=True)
    # The ladder depends only on the architecture and sizes: made once, on an untrained model.
    probe = reference_model("cnn", shape[0], n_classes, shape[1], args.seed)
    example = torch.zeros(2, *shape)
    ladder = model_ladder(probe, example, n_windows=n_windows, batch_windows=args.loso_batch,
                          count=args.budgets, extra=tuple(args.extra_budget))
    ladder.pop("graph")
    budgets = ladder["budgets"]
    print("budgets: " + ", ".join(format_bytes(b) for b in budgets), flush=True)
    state = work / "probe_state.pt"
    torch.save(probe.state_dict(), state)
    eager = run_worker("torch", {"model": "cnn", "state_dict": str(state), "n_channels": shape[0],
                                 "n_classes": n_classes, "time_steps": shape[1], "n_windows": n_windows,
                                 "batch_windows": args.loso_batch, "epochs": args.loso_epochs, "threads": args.threads,
                                 "seed": args.seed, "lr": args.lr}, work / "torch")
    # Budget rows: (budget index, selection) in the order of the table.
    selections = ["validated", "importance"] if args.selection == "both" else [args.selection]
    budget_rows = [(bi, sel) for sel in selections for bi in range(len(budgets))]
    methods = [budget_method(budgets[bi], sel, args.selection) for bi, sel in budget_rows] + list(PRESETS)
    rows: list[dict[str, Any]] = []
    t_start = time.perf_counter()
    for fi, target in enumerate(subjects):
        t_fold = time.perf_counter()
        fold = work / f"fold{target}"
        split = make_split(ds, target, args.k_per_class, args.seed)
        model = pretrain_source("cnn", split, epochs=args.pretrain_epochs, seed=args.seed, threads=args.threads)
        source_only = accuracy(model, split.target_eval.X, split.target_eval.y)
        rows.append({"subject": target, "method": "source-only", "accuracy": source_only})
        adapt_path, eval_path = save_target_data(split, fold)
        ex = torch.from_numpy(split.target_adapt.X[:2])
        n_adapt = int(len(split.target_adapt.y))
        importance = source_importance(model, ex, split.source_train, seed=args.seed, target_subject=target)
        scorer = validation_scorer(args, ds, target) if "validated" in selections else None
        for mi, method in enumerate(methods):
            bdir = fold / f"m{mi}"
            choice = None
            try:
                if mi < len(budget_rows):
                    bi, sel = budget_rows[mi]
                    policy = None
                    if sel == "validated":
                        choice = choose_update_for_model(model, ex, budgets[bi], scorer, n_windows=n_adapt,
                                                         batch_windows=args.loso_batch, importance=importance)
                        policy = choice.chosen.policy
                    manifest, _ = export_bundle_at(model, ex, bdir / "bundle", lr=args.lr, budget=budgets[bi],
                                                   n_windows=n_adapt, batch_windows=args.loso_batch,
                                                   importance=importance, policy=policy)
                else:
                    spec = METHODS[method].policy_for("cnn")
                    manifest, _ = export_bundle_at(model, ex, bdir / "bundle", lr=args.lr, policy=spec,
                                                   n_windows=n_adapt, batch_windows=args.loso_batch)
                rep = run_worker("runner", {"bundle": str(bdir / "bundle"), "adapt_data": str(adapt_path),
                                            "eval_data": str(eval_path), "batch_windows": args.loso_batch,
                                            "epochs": args.loso_epochs, "threads": args.threads, "seed": args.seed,
                                            "lr": args.lr}, bdir)
            except Exception as e:
                log.exception("subject %s %s failed", target, method)
                rows.append({"subject": target, "method": method, "error": f"{type(e).__name__}: {str(e)[-400:]}"})
                continue
            plan = plan_summary(manifest.get("plan") or {})
            rows.append({"subject": target, "method": method, "accuracy": rep["accuracy"],
                         "budget_bytes": budgets[budget_rows[mi][0]] if mi < len(budget_rows) else None,
                         **({} if choice is None else {"selected": choice.chosen.label,
                                                       "validated_gain": choice.chosen.score,
                                                       "validation": choice.to_dict()}),
                         "trainable_numel": manifest_trainable(manifest), **plan,
                         **{k: rep.get(k) for k in ("call_peak_bytes", "call_peak_anon_bytes", "step_peak_bytes",
                                                    "step_peak_anon_bytes", "adapt_time_s")}})
        done = [r for r in rows if r["subject"] == target and "accuracy" in r]
        print(f"[{fi + 1}/{len(subjects)}] subject {target} in {time.perf_counter() - t_fold:.0f} s: "
              + ", ".join(f"{r['method']} {r['accuracy']:.3f}" for r in done), flush=True)
        result = {"subjects": subjects[:fi + 1], "subjects_planned": subjects, "n_adapt_windows": n_windows,
                  "ladder": ladder, "torch_eager": eager, "methods": methods, "rows": rows,
                  "summary": loso_summary(rows, ["source-only", *methods], eager),
                  "time_s": time.perf_counter() - t_start}
        if on_fold is not None:
            on_fold(result)
    return result


def budget_method(budget: int, selection: str, requested: str) -> str:
    """A budget row's name: ``budget 1.2 MiB``, with the selection named when both are compared."""
    name = f"budget {format_bytes(budget)}"
    return name if requested != "both" or selection == "validated" else f"{name}, importance only"


def validation_scorer(args, ds, target: int):
    """Scores candidate updates on ``VALIDATION_SUBJECTS`` source subjects of the fold (never the
    target), adapting with this sweep's recipe."""
    from edgeadapt.harness.validated_selection import FinetuneRecipe, InnerSubjectScorer

    recipe = FinetuneRecipe(lr=args.lr, weight_decay=WEIGHT_DECAY, epochs=args.loso_epochs,
                            batch_windows=args.loso_batch, seed=args.seed)
    return InnerSubjectScorer(ds.subset(ds.subject != target), "cnn", recipe, k_per_class=args.k_per_class,
                              pretrain_epochs=args.pretrain_epochs, validation_subjects=VALIDATION_SUBJECTS,
                              seed=args.seed, target_subject=target, threads=args.threads)


def loso_summary(rows: list[dict[str, Any]], methods: list[str], eager: dict[str, Any]) -> dict[str, dict]:
    """Per method: mean / worst accuracy, median measured peaks, ratios to torch eager full FT."""
    out = {}
    for m in methods:
        mine = [r for r in rows if r["method"] == m and "accuracy" in r]
        errors = [r["error"] for r in rows if r["method"] == m and "error" in r]
        if not mine:
            out[m] = {"n_subjects": 0, "errors": errors}
            continue
        acc = [r["accuracy"] for r in mine]
        worst = min(mine, key=lambda r: r["accuracy"])

        def med(k):
            vals = [r[k] for r in mine if r.get(k) is not None]
            return int(statistics.median(vals)) if vals else None

        s = {"n_subjects": len(mine), "mean_accuracy": statistics.fmean(acc), "worst_accuracy": worst["accuracy"],
             "worst_subject": worst["subject"], "errors": errors,
             **{f"median_{k}": med(k) for k in ("trainable_numel", "call_peak_bytes", "call_peak_anon_bytes",
                                                 "step_peak_bytes", "predicted_peak_bytes", "budget_bytes",
                                                 "micro_batch_windows")}}
        s["torch_over_runner"] = ratio(eager["call_peak_bytes"], s["median_call_peak_bytes"])
        s["torch_over_runner_anon"] = ratio(eager["call_peak_anon_bytes"], s["median_call_peak_anon_bytes"])
        out[m] = s
    full = out.get("full", {}).get("mean_accuracy")
    for s in out.values():
        s["vs_full_points"] = None if full is None or "mean_accuracy" not in s else 100 * (s["mean_accuracy"] - full)
    return out


def _selection_lines(cfg: dict[str, Any], lo: dict[str, Any]) -> list[str]:
    """How the budget rows chose what trains, and (validated) what each budget picked over the folds."""
    importance = (f"`export_bundle(memory_budget=B)` on each fold's pretrained CNN, the planner choosing what trains "
                  f"by importance measured on {IMPORTANCE_WINDOWS} labelled source-subject windows of the fold "
                  "(empirical Fisher)")
    validated = (f"what trains is validated on {VALIDATION_SUBJECTS} source subjects of each fold (never the target; "
                 "`edgeadapt.harness.validated_selection`): every candidate that fits B (one module, the last "
                 "layer plus one module or a quarter of its channels, every module from one on, the importance "
                 "selection at B, B/2, B/4, B/8) is adapted in torch with this recipe on each validation subject, "
                 "and the largest mean accuracy gain wins unless a candidate with a smaller predicted peak is "
                 "within one standard error of it (paired over the validation subjects), then the smallest such; "
                 "then `export_bundle(memory_budget=B, policy=chosen)`")
    sel = cfg.get("selection", "importance")
    text = {"importance": f"Budget rows: {importance}.",
            "validated": f"Budget rows: {validated}.",
            "both": f"Budget rows: {validated}. Rows marked 'importance only': {importance}."}[sel]
    picks = [(r["method"], r["selected"]) for r in lo["rows"] if r.get("selected")]
    lines = [text, ""]
    if picks:
        lines += [f"Validated picks (folds): {describe_picks(picks)}.", ""]
    return lines


def loso_markdown(res: dict[str, Any]) -> str:
    cfg, lo = res["config"], res["loso"]
    e = lo["torch_eager"]
    lines = [
        f"### Accuracy vs memory budget, LOSO watch / cnn: {len(lo['subjects'])} subjects"
        + (f" (of {len(lo['subjects_planned'])} planned; run in progress or interrupted)"
           if len(lo.get("subjects_planned", lo["subjects"])) > len(lo["subjects"]) else "")
        + f", k={cfg['k_per_class']} per "
        f"class ({lo['n_adapt_windows']} windows), batch {cfg['loso_batch']}, {cfg['loso_epochs']} epochs, "
        f"learning rate {cfg['lr']:g} FIXED IN ADVANCE for every row (not tuned on any subject)",
        "",
        f"Command: `{res['command']}`",
        "",
        *_selection_lines(cfg, lo),
        "Preset rows: hand-written policies (no budget). Each adaptation ran in a fresh torch-free process; memory = "
        "median over subjects of the measured whole adapt call over the loaded runner (total VmHWM delta / anon "
        "RssAnon). Torch eager full fine-tuning, same batch and epochs, whole loop: "
        f"{format_bytes(e['call_peak_bytes'])} "
        f"total, {format_bytes(e['call_peak_anon_bytes'])} anon.",
        "",
        "| method | subjects | mean acc | worst acc (subj) | vs full (points) | trains (el.) | predicted | call total "
        "| call anon | torch/runner total | torch/runner anon |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for m, s in lo["summary"].items():
        if not s.get("n_subjects"):
            lines.append(f"| {m} | 0 | failed: {'; '.join(s.get('errors', []))[:200]} |" + " |" * 8)
            continue
        vs = s["vs_full_points"]
        lines.append(
            f"| {m} | {s['n_subjects']}{'*' if s['errors'] else ''} | {s['mean_accuracy']:.3f} | "
            f"{s['worst_accuracy']:.3f} ({s['worst_subject']}) | "
            f"{'-' if vs is None else f'{vs:+.1f}'} | "
            f"{_count(s['median_trainable_numel'])} | "
            f"{format_bytes(s['median_predicted_peak_bytes'])} | {format_bytes(s['median_call_peak_bytes'])} | "
            f"{format_bytes(s['median_call_peak_anon_bytes'])} | {_x(s['torch_over_runner'])} | "
            f"{_x(s['torch_over_runner_anon'])} |")
    failed = {m: s["errors"] for m, s in lo["summary"].items() if s.get("errors")}
    if failed:
        lines += ["", "\\* some subjects failed (not in the mean): "
                  + "; ".join(f"{m}: {len(e)}x {e[0][:240]}" for m, e in failed.items())]
    lines += ["", f"Total time {lo['time_s'] / 60:.1f} min; load average at start {res['loadavg_start'][0]:.1f}."]
    return "\n".join(lines) + "\n"


def plot_loso(res: dict[str, Any], path: Path) -> None:
    """Mean accuracy (worst subject as markers) vs measured whole-call peak (log x), Pareto front."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from edgeadapt.atomic import atomic_path

    summ = res["loso"]["summary"]
    pts, labels = [], []
    for m, s in summ.items():
        if s.get("n_subjects") and s.get("median_call_peak_bytes"):
            pts.append((s["median_call_peak_bytes"] / KIB, s["mean_accuracy"], s["worst_accuracy"]))
            labels.append(m)
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for (x, y, w), m in zip(pts, labels):
        budget = m.startswith("budget")
        ax.scatter([x], [y], marker="o" if budget else "s", color="tab:blue" if budget else "tab:orange", zorder=3)
        ax.scatter([x], [w], marker="v", color="tab:blue" if budget else "tab:orange", alpha=0.4, zorder=2)
        # Budgets labelled above their point, presets below: a budget that chose a preset's policy overlaps it.
        ax.annotate(m.replace("budget ", ""), (x, y), textcoords="offset points", xytext=(4, 4) if budget else (4, -11),
                    fontsize=7)
    front = pareto_front([(x, y) for x, y, _ in pts])
    ax.plot([pts[i][0] for i in front], [pts[i][1] for i in front], "-", color="tab:gray", lw=1, label="Pareto front")
    if "source-only" in summ and summ["source-only"].get("n_subjects"):
        ax.axhline(summ["source-only"]["mean_accuracy"], color="tab:gray", ls="--", lw=1, label="source only")
    e = res["loso"]["torch_eager"]
    ax.axvline(e["call_peak_bytes"] / KIB, color="tab:red", ls=":", lw=1, label="torch eager full FT (total)")
    ax.scatter([], [], marker="o", color="tab:blue", label="budget (planner's policy)")
    ax.scatter([], [], marker="s", color="tab:orange", label="hand-written preset")
    ax.scatter([], [], marker="v", color="gray", alpha=0.4, label="worst subject")
    ax.set_xscale("log")
    _log_ticks(ax.xaxis)
    ax.set_xlabel("measured whole adapt-call peak (total, VmHWM), KiB over the loaded runner, median over subjects")
    ax.set_ylabel("mean target accuracy")
    cfg = res["config"]
    ax.set_title(f"watch LOSO, cnn, {len(res['loso']['subjects'])} subjects, k={cfg['k_per_class']}, "
                 f"lr {cfg['lr']:g} fixed in advance", fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=120, format="png")
    plt.close(fig)


# ------------------------------------------------------------------------------------------
# Command line
# ------------------------------------------------------------------------------------------
def _bytes_arg(text: str) -> int:
    from edgeadapt.units import parse_bytes

    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _host() -> dict[str, Any]:
    try:
        from edgeadapt.versions import host_info

        return host_info()
    except ImportError:
        return {}


def build_parser() -> argparse.ArgumentParser:
    from edgeadapt.harness.study import FIXED_LR

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    p.add_argument("--budgets", type=int, default=6, help="budgets per ladder, >= 2 (default 6)")
    p.add_argument("--extra-budget", type=_bytes_arg, nargs="*", default=[256 * KIB],
                   help="budgets added to each ladder when inside it (default 256KiB)")
    p.add_argument("--channels", type=int, default=8)
    p.add_argument("--time-steps", type=int, default=256)
    p.add_argument("--classes", type=int, default=7)
    p.add_argument("--n-windows", type=int, default=35, help="adaptation windows (default 35 = 5 per class x 7)")
    p.add_argument("--batch", type=int, default=32, help="windows per optimizer step (default 32)")
    p.add_argument("--epochs", type=int, default=2, help="epochs of the measured adapt call (default 2)")
    p.add_argument("--repeats", type=int, default=1, help="fresh processes per measurement; median (default 1)")
    p.add_argument("--lr", type=float, default=FIXED_LR, help=f"learning rate, fixed in advance (default {FIXED_LR:g})")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-memory", dest="memory", action="store_false", help="skip parts 1, 2 and 4")
    p.add_argument("--loso", action="store_true", help="run part 3 (accuracy vs budget on watch LOSO; minutes)")
    p.add_argument("--quick", action="store_true", help="part 3 on 3 subjects only (a smoke run)")
    p.add_argument("--k-per-class", type=int, default=5)
    p.add_argument("--loso-batch", type=int, default=16)
    p.add_argument("--loso-epochs", type=int, default=40)
    p.add_argument("--pretrain-epochs", type=int, default=15)
    p.add_argument("--selection", choices=("validated", "importance", "both"), default="validated",
                   help="part 3's budget rows: what trains is validated on source subjects (default), the "
                        "planner's importance selection alone, or both rows per budget")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    p.add_argument("--tag", default="", help="suffix of the output file names")
    p.add_argument("-v", "--verbose", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return _worker_main(*argv[1:4])
    p = build_parser()
    args = p.parse_args(argv)
    if args.budgets < 2 or min(args.n_windows, args.batch, args.epochs, args.repeats, args.threads) < 1:
        p.error("--budgets must be >= 2; --n-windows, --batch, --epochs, --repeats, --threads >= 1")
    if not (args.memory or args.loso):
        p.error("nothing to do: drop --no-memory or add --loso")
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    from edgeadapt.atomic import atomic_write_bytes, atomic_write_json
    from edgeadapt.versions import code_version

    command = " ".join([".venv/bin/python", "benchmarks/budget_sweep.py", *map(shlex.quote, argv)])
    print(command, flush=True)
    base = {"command": command, "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "host": _host(), "code": code_version(REPO), "loadavg_start": list(os.getloadavg())}
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="budget_sweep-") as tmp:
        work = Path(tmp)
        if args.memory:
            res = {**base, **memory_sweep(args, work / "memory")}
            stem = args.out / f"budget_memory{args.tag}"
            atomic_write_json(f"{stem}.json", res)
            md = memory_markdown(res)
            atomic_write_bytes(f"{stem}.md", md.encode())
            plot_memory(res, Path(f"{stem}.png"))
            print("\n" + md + f"wrote {stem}.json / .md / .png", flush=True)
        if args.loso:
            (work / "loso").mkdir()
            stem = args.out / f"budget_loso_watch{args.tag}{'_quick' if args.quick else ''}"

            def publish(lo: dict[str, Any]) -> str:
                res = {**base, "loso": lo}
                atomic_write_json(f"{stem}.json", res)
                md = loso_markdown(res)
                atomic_write_bytes(f"{stem}.md", md.encode())
                plot_loso(res, Path(f"{stem}.png"))
                return md

            md = publish(loso_sweep(args, work / "loso", on_fold=publish))
            print("\n" + md + f"wrote {stem}.json / .md / .png", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
