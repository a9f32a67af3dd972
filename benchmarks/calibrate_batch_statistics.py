"""Measure what BatchNorm with batch statistics costs on each engine and write the constants down.

Bundles exported with ``batchnorm="batch"`` pay for batch statistics twice, and the main
calibration (``benchmarks/calibrate_cost.py``, frozen statistics) sees neither:

1. **Training steps.** Each BatchNormalization computes its moments and updates the running
   statistics inside the training graph. For each model (the reference CNN and MobileNet, and
   the user-style Conv2d + BatchNorm net of ``edgeadapt.harness.budget_check``; 8 x 256 windows)
   exported under the three budgets of its ladder (the planner picks what trains; 40 windows,
   batch 16, 2 epochs), one
   ``adapt`` call is measured by the project's protocol (``edgeadapt.measure``: a fresh torch-free
   process, freed heap returned to the OS before the baseline) and compared with the prediction
   without batch-statistics terms. The excess is fitted as

       excess <= batch_norm_op_bytes * (BatchNorm ops)
                 + batch_norm_activation_factor * m * (output bytes of those a gradient flows through)

   (``m`` the micro-batch): the two constants are the least total over the plans that covers
   every measured excess plus ``MARGIN`` of the measured peak (a linear programme,
   ``scipy.optimize.linprog``; a budget must hold, and a measurement repeated moves by a few KiB).
2. **Statistics passes** (label-free adaptation, :mod:`edgeadapt.sched.label_free_cost`): the
   training graph's forward with batch statistics in a session of its own. One
   ``update_bn_statistics`` batch of ``s`` windows is measured at ``s`` = 4 and 16 and fitted as

       anon(s) = statistics_session_bytes + statistics_op_bytes * ops
                 + statistics_activation_factor * s * live

   (``ops``: the graph IR's ops; ``live``: its largest forward live bytes per window): the factor
   is the largest per-model slope over ``live``, the fixed terms a non-negative least-squares fit
   of the rest whose intercept is then raised until no measurement exceeds its prediction.

The constants are written, with the measurements and the command, into
``edgeadapt/sched/cost_model.json`` and ``cost_model_portable.json`` (atomically; ``--dry-run``:
printed only). The exported budgets are planned with the shipped constants of that moment.

Usage::

    .venv/bin/python benchmarks/calibrate_batch_statistics.py [--dry-run]
    .venv/bin/python benchmarks/calibrate_batch_statistics.py --refit   # from the stored measurements
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np
from scipy.optimize import linprog, nnls

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODELS = ("cnn", "mobilenet", "conv2d")
PASS_WINDOWS = (4, 16)
# Share of a measured training peak the batch-statistics terms must cover beyond its excess.
MARGIN = 0.02
ENV = {"OMP_NUM_THREADS": "1"}


def _settings(engine: str):
    from edgeadapt.harness.budget_check import CheckSettings

    return CheckSettings(n_windows=40, batch_windows=16, epochs=2, channels=8, time_steps=256, classes=7,
                         backend=engine, batchnorm="batch")


def measure_training(workdir: Path, model: str, engine: str) -> list[dict]:
    """Adapt calls of ``model``'s batch-statistics bundles against the prediction without the
    batch-statistics terms."""
    from edgeadapt import sched
    from edgeadapt.harness.budget_check import build, check_budget, model_budgets
    from edgeadapt.sched.cost import activation_arrays, batch_norm_ops

    settings = _settings(engine)
    net, example = build(model, settings)
    rows = []
    for budget in model_budgets(net, example, settings, 3):
        try:
            row = check_budget(model, budget, workdir, settings)
        except sched.BudgetExceeded as e:
            print(f"{engine:12s} {model:10s} budget {budget}: not exported ({str(e)[:120]})", flush=True)
            continue
        graph, plan = sched.Graph.from_dict(row["graph"]), sched.Plan.from_dict(row["plan"])
        plain = replace(sched.CostModel.default(engine), batch_norm_op_bytes=0, batch_norm_activation_factor=0.0)
        start = plan.cut + 1 if plan.cache_features and plan.cut >= 0 else 0
        grad = activation_arrays(graph, {p.name for p in plan.params if p.trains}, start).grad
        n_bn, through = batch_norm_ops(graph, start, grad)
        rows.append({"model": model, "engine": engine, "budget_bytes": budget, "bn_ops": n_bn,
                     "bn_window_bytes": plan.micro_batch_windows * through,
                     "predicted_plain_bytes": sched.predict(graph, plan, plain).peak_bytes,
                     "anon_bytes": row["call_peak_anon_bytes"]})
        r = rows[-1]
        print(f"{engine:12s} {model:10s} budget {budget:9d} bn={r['bn_ops']:2d} predicted (plain) "
              f"{r['predicted_plain_bytes'] / 1024:8.1f} KiB measured {r['anon_bytes'] / 1024:8.1f} KiB", flush=True)
    return rows


def fit_training(rows: list[dict]) -> dict:
    """The least (summed over the plans) per-op and per-byte terms covering every excess."""
    A = np.array([[r["bn_ops"], r["bn_window_bytes"]] for r in rows], dtype=float)
    excess = np.array([r["anon_bytes"] * (1 + MARGIN) - r["predicted_plain_bytes"] for r in rows], dtype=float)
    need = excess > 0
    if not need.any():
        return {"batch_norm_op_bytes": 0, "batch_norm_activation_factor": 0.0}
    scale = np.array([1.0, 1e-5])  # bytes per op vs bytes per byte: comparable columns for the solver
    result = linprog(A.sum(axis=0) * scale, A_ub=-A[need] * scale, b_ub=-excess[need], bounds=[(0, None)] * 2)
    if not result.success:
        raise RuntimeError(f"no batch-statistics constants cover the measurements: {result.message}")
    per_op, factor = result.x * scale
    # both rounded up: the constants must still cover every excess
    return {"batch_norm_op_bytes": int(np.ceil(per_op)),
            "batch_norm_activation_factor": float(np.ceil(factor * 1e4) / 1e4)}


def measure_statistics(workdir: Path, model: str, engine: str) -> list[dict]:
    """One statistics pass per size on ``model``'s batch-statistics bundle."""
    from edgeadapt.export import export_bundle
    from edgeadapt.harness.budget_check import build
    from edgeadapt.measure import MeasureSpec, measure_in_fresh_process
    from edgeadapt.sched import Graph
    from edgeadapt.sched.cost import live_bytes

    net, example = build(model, _settings(engine))
    out = workdir / f"{model}-{engine}-statistics"
    manifest = export_bundle(net, example, out, loss="entropy", batchnorm="batch", backend=engine)
    graph = Graph.from_dict(manifest.graph)
    rows = []
    for s in PASS_WINDOWS:
        spec = MeasureSpec(bundle=str(out), n_windows=s, batch_windows=s, method="bn-stats", progress=False,
                           trim_heap=True, backend=engine)
        report = measure_in_fresh_process(spec, env=ENV)
        rows.append({"model": model, "engine": engine, "windows": s, "ops": len(graph.ops),
                     "live_bytes": max(live_bytes(graph)), "anon_bytes": report["call_peak_anon_bytes"]})
        print(f"{engine:12s} {model:10s} statistics pass of {s:3d} windows: "
              f"{report['call_peak_anon_bytes'] / 1024:8.1f} KiB", flush=True)
    return rows


def fit_statistics(rows: list[dict]) -> dict:
    by_model: dict[str, list[dict]] = {}
    for r in rows:
        by_model.setdefault(r["model"], []).append(r)
    slopes = []
    for group in by_model.values():
        lo, hi = min(group, key=lambda r: r["windows"]), max(group, key=lambda r: r["windows"])
        slopes.append((hi["anon_bytes"] - lo["anon_bytes"]) / (hi["windows"] - lo["windows"]) / hi["live_bytes"])
    factor = max(0.0, *slopes)
    rest = {m: max(r["anon_bytes"] - factor * r["windows"] * r["live_bytes"] for r in g) for m, g in by_model.items()}
    A = np.array([[1.0, by_model[m][0]["ops"]] for m in rest])
    b = np.array(list(rest.values()))
    (fixed, per_op), _ = nnls(A, b)
    fixed += max(0.0, float(np.max(b - (fixed + per_op * A[:, 1]))))
    return {"statistics_session_bytes": int(np.ceil(fixed)), "statistics_op_bytes": int(np.ceil(per_op)),
            "statistics_activation_factor": round(float(factor), 4)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="print the constants, write nothing")
    parser.add_argument("--refit", action="store_true",
                        help="fit again from the measurements stored in the constants files (no measuring)")
    args = parser.parse_args()
    from edgeadapt.atomic import atomic_write_json
    from edgeadapt.sched.cost import CONSTANTS_FILES

    with tempfile.TemporaryDirectory(prefix="edgeadapt-bn-cal-") as scratch:
        for engine, name in CONSTANTS_FILES.items():
            path = ROOT / "edgeadapt" / "sched" / name
            if args.refit:
                stored = json.loads(path.read_text())["calibration"]["batch_statistics"]
                training, statistics = stored["training"], stored["statistics"]
            else:
                training = [r for m in MODELS for r in measure_training(Path(scratch), m, engine)]
                statistics = [r for m in MODELS for r in measure_statistics(Path(scratch), m, engine)]
            constants = {**fit_training(training), **fit_statistics(statistics)}
            print(engine, constants, flush=True)
            if args.dry_run:
                continue
            shipped = json.loads(path.read_text())
            shipped.update(constants)
            if "expected" in shipped:  # fitted to cover every point: the point estimate takes them as they are
                shipped["expected"].update(constants)
            shipped.setdefault("calibration", {})["batch_statistics"] = {
                "date": dt.date.today().isoformat(), "command": "benchmarks/calibrate_batch_statistics.py",
                "figure": "call_peak_anon_bytes (edgeadapt.measure, fresh process, heap trimmed)",
                "training": training, "statistics": statistics}
            atomic_write_json(path, shipped)
    return 0


if __name__ == "__main__":
    sys.exit(main())
