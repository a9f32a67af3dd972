"""Measure the constants of the scheduler's device cost model and write them down.

For a set of hand-written plans on a reference model (update policy x micro-batch x feature
caching), this script exports a bundle (``export_bundle``; the manifest carries the plan and the
sched graph), then measures one ``Runner.adapt`` call per bundle by the project's measuring
protocol (``edgeadapt.measure``: a fresh torch-free process as a user has it) and reads the
whole call's peak (``call_peak_bytes``: VmHWM delta; ``call_peak_anon_bytes``: sampled RssAnon).

The prediction with zero overheads splits each plan's peak into what the cost model takes as
exact (gradient buffers, optimizer state, the rollback copy of the trained values, the feature
cache: ``held``) and the activation part of the peaking phase: one micro-batch's training
activations ``train``, or the prefix's inference activations ``inf`` when the features phase
peaks. Two fits of

    measured - held = session_overhead_bytes + grad_op_bytes * (ops needing a gradient)
                      + graph_op_bytes * (ops of the training graph)
                      + channel_weight_factor * (whole bytes of channel-split weights)
                      + activation_factor * train + inference_activation_factor * inf
                      + (gradient_factor - 1) * trained

over the plans (``trained``: bytes of the trained tensors, whose backward also produces each
gradient as a transient before adding it into the kept buffer, hence a fitted
``gradient_factor`` >= 1; iterated, since which phase peaks depends on the constants) give

* the **expected** peak: non-negative least squares of the relative error (``scipy.optimize.nnls``),
  the point estimate reported beside each plan;
* the **bound**: a linear programme (``scipy.optimize.linprog``) that minimises the summed relative
  over-prediction subject to every plan predicted at least ``1 + --margin`` times its measured
  peak (default 5 %), no constant below the point estimate's. Plans are made with the bound: a
  budget must hold.

The calibration plans span architectures: the CNN's ``PLANS``, a tiny model's ``TINY_PLANS``
(the fixed cost of a session) and, with ``--models``, ``GENERIC_PLANS`` on other reference
models (depthwise/pointwise convolutions, attention). The constants of the chosen figure
(``--fit``, default ``anon``: library code paged in on first use is file-backed and depends on
the page cache, not on the plan) are written with the date, the versions, the command and the
per-plan residuals to ``--out`` (default: the packaged ``edgeadapt/sched/cost_model.json``, the
bound at the top level and the point estimate under ``expected``), atomically.

Usage::

    .venv/bin/python benchmarks/calibrate_cost.py --models mobilenet transformer   # the shipped constants
    .venv/bin/python benchmarks/calibrate_cost.py --out /tmp/c.json --fit total
    .venv/bin/python benchmarks/calibrate_cost.py --model transformer --check   # shipped constants vs measured
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import math
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np
from scipy.optimize import nnls

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

log = logging.getLogger("calibrate_cost")

# (policy, micro_batch_windows, cache_features)
PLANS = (
    ("last-layer", 30, False), ("last-layer", 30, True), ("last-layer", 10, True), ("last-layer", 2, True),
    ("bias-norm", 30, False), ("bias-norm", 6, False), ("bias-norm", 2, False),
    ("full", 30, False), ("full", 5, False), ("full", 2, False),
    # The planner's mid-range picks: a gradient through the last blocks only (a training graph over
    # the whole model with few ops needing a gradient: graph_op_bytes), with channel-sparse
    # convolutions (whole-weight copies: channel_weight_factor). Fitted since 2026-12-03.
    ("head=full", 1, False), ("head=full", 4, False),
    ("blocks.3.*=full,head=full", 1, False), ("blocks.2.*=full,blocks.3.*=full,head=full", 4, False),
    ("blocks.3.conv=channels:0.25,blocks.3.bn=full,head=full", 2, False),
    ("blocks.2.conv=channels:0.25,blocks.3.conv=channels:0.25,blocks.2.bn=full,blocks.3.bn=full,head=full", 16, False),
)
# Plans on a tiny model (``_tiny_model``: a pointwise Conv1d, ReLU, mean over time, the head),
# whose training graphs have 1-4 ops: the fixed cost of opening a training session and of its
# first step, which the CNN's plans alone cannot tell apart from the per-op costs (fitted since
# 2026-12-03, with freed heap trimmed before the baseline). (policy, micro, cache, model)
TINY_PLANS = (
    ("last-layer", 30, True, "tiny"), ("last-layer", 4, True, "tiny"), ("last-layer", 30, False, "tiny"),
    ("full", 30, False, "tiny"), ("full", 4, False, "tiny"),
)
# Plans for any other reference model (``--models mobilenet transformer``): the policies that name
# no module of the CNN (last layer with and without cached features, biases + norm affines,
# full fine-tuning, head uncached), so per-op and activation costs are fitted over several
# architectures (depthwise/pointwise convolutions, attention) and not the CNN's dense
# convolutions alone. (policy, micro, cache)
GENERIC_PLANS = (
    ("last-layer", 30, True), ("last-layer", 4, True), ("last-layer", 30, False),
    ("bias-norm", 30, False), ("bias-norm", 4, False),
    ("full", 30, False), ("full", 8, False), ("full", 2, False),
    ("head=full", 1, False), ("head=full", 8, False),
)
# Calibration-only small nets (``_small_model``), measured with GENERIC_PLANS when named in --models.
SMALL_MODELS = ("small-lstm", "small-mlp", "small-conv2d", "small-tcn")
# Checked (``--check``) in addition to PLANS, not fitted. The check of the fitted constants is
# ``benchmarks/budget_sweep.py`` (the planner's own plans, other runs and settings).
CHECK_PLANS: tuple = ()

def _tiny_model(channels: int, classes: int):
    """Conv1d(channels, 8, 1) + ReLU + mean over time + Linear(8, classes) as ``head``: a model
    whose training graphs are a few ops (1 with cached features and the head only)."""
    from torch import nn

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv1d(channels, 8, 1)
            self.head = nn.Linear(8, classes)

        def forward(self, x):
            return self.head(nn.functional.relu(self.conv(x)).mean(dim=-1))

    return Tiny().eval()


def _small_model(name: str, channels: int, classes: int, time_steps: int):
    """Small user-style nets measured only for calibration (``--models small-lstm ...``): layer
    kinds the reference models lack (a recurrent layer, 2-D convolutions, dilated 1-D ones, a wide
    first ``Linear``), each ending in a ``head``. None is one of the check's nets
    (``edgeadapt.harness.budget_check``)."""
    from torch import nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            if name == "small-lstm":
                self.body = nn.LSTM(channels, 12, batch_first=True)
                width = 12
            elif name == "small-mlp":
                self.body = nn.Sequential(nn.Flatten(), nn.Linear(channels * time_steps, 48), nn.ReLU(),
                                          nn.Linear(48, 24), nn.Tanh())
                width = 24
            elif name == "small-conv2d":
                self.body = nn.Sequential(nn.Conv2d(1, 6, (3, 5)), nn.ReLU(), nn.Conv2d(6, 6, (3, 5), stride=2),
                                          nn.ReLU())
                width = 6
            elif name == "small-tcn":
                self.body = nn.Sequential(nn.Conv1d(channels, 12, 3), nn.ReLU(), nn.Conv1d(12, 12, 3, dilation=4),
                                          nn.ReLU())
                width = 12
            else:
                raise ValueError(f"unknown calibration net {name!r}; use one of {SMALL_MODELS}")
            self.head = nn.Linear(width, classes)

        def forward(self, x):  # x: (batch, channels, time)
            if name == "small-lstm":
                return self.head(self.body(x.transpose(1, 2))[0].mean(dim=1))
            if name == "small-mlp":
                return self.head(self.body(x))
            if name == "small-conv2d":
                return self.head(self.body(x.unsqueeze(1)).mean(dim=(2, 3)))
            return self.head(self.body(x).mean(dim=-1))

    return Net().eval()


def _export(args, policy: str, micro: int, cache: bool, directory: Path, model_name: str | None = None):
    import torch

    from edgeadapt.export import UpdatePolicy, export_bundle
    from edgeadapt.models import build_model

    torch.manual_seed(args.seed)
    model_name = model_name or args.model
    if model_name == "tiny":
        model = _tiny_model(args.channels, args.classes)
    elif model_name in SMALL_MODELS:
        model = _small_model(model_name, args.channels, args.classes, args.time_steps)
    else:
        model = build_model(model_name, args.channels, args.classes, args.time_steps)
    example = torch.randn(args.batch, args.channels, args.time_steps, generator=torch.Generator().manual_seed(1))
    out = directory / f"{model_name}-{policy}-{micro}-{int(cache)}"
    manifest = export_bundle(model, example, out, policy=UpdatePolicy.parse(policy), n_windows=args.n_windows,
                             batch_windows=args.batch, cache_features=cache, backend=args.backend)
    return out, manifest


def _measure(bundle: Path, args, micro: int) -> dict:
    """One adapt call over the plan's windows with ``micro`` windows per forward/backward, by the
    project's measuring protocol (``edgeadapt.measure``: a fresh torch-free process as a user
    has it, progress bar on, nothing warmed up), freed heap returned to the OS before the
    baseline: what the call itself allocates, the bound for any earlier history of the process
    (without it the call reuses what loading freed, an amount that depends on the bundle)."""
    from edgeadapt.measure import MeasureSpec, measure_in_fresh_process

    spec = MeasureSpec(bundle=str(bundle), n_windows=args.n_windows, batch_windows=args.batch, micro_batch=micro,
                       threads=args.threads, seed=args.seed, backend=args.backend, trim_heap=True)
    return measure_in_fresh_process(spec, timeout_s=600, env={"OMP_NUM_THREADS": str(args.threads)})


def _split(graph, plan, cost):
    """(held, training activations, inference activations, ops needing a gradient, trained
    bytes, ops of the training graph, whole bytes of channel-split weights) of the prediction under ``cost``
    with zero overheads and unit activation factors, at the larger of the features and the
    training peaks (rescaled by ``cost``'s factors to choose which one peaks)."""

    from edgeadapt.sched import predict
    from edgeadapt.sched.cost import activation_arrays, channel_weight_bytes

    from edgeadapt.sched.resolve import trained_bytes

    unit = replace(cost, session_overhead_bytes=0, grad_op_bytes=0, graph_op_bytes=0, channel_weight_factor=0.0,
                   activation_factor=1.0, inference_activation_factor=1.0, gradient_factor=1.0)
    phases = predict(graph, plan, unit).phases_bytes
    held = phases["rollback"]
    train = max(phases["forward"], phases.get("backward", 0)) - held
    options = [(held + cost.activation_factor * train, held, train, 0)]
    if "features" in phases:
        f_held = phases["session"] + plan.n_windows * graph.ops[plan.cut].output_bytes
        inf = phases["features"] - f_held
        options.append((f_held + cost.inference_activation_factor * inf, f_held, 0, inf))
    _, held, train, inf = max(options)
    start = plan.cut + 1 if plan.cache_features and plan.cut >= 0 else 0
    n_grad = sum(activation_arrays(graph, {p.name for p in plan.trained}, start).grad)
    return (held, train, inf, n_grad, trained_bytes(graph, plan.params), len(graph.ops) - start,
            channel_weight_bytes(graph, plan.params))


# The fitted constants in the order of _split's columns (after ``held``).
_COLUMNS = ("activation_factor", "inference_activation_factor", "grad_op_bytes", "session_overhead_bytes",
            "gradient_factor", "graph_op_bytes", "channel_weight_factor")


def _cost_from(w, base, up: bool = False):
    """``base`` (the constants this script does not fit) with the linear model's weights ``w``
    (``_COLUMNS`` order), bytes as ints and factors to 4 decimals: rounded to the nearest, or
    ``up`` (a bound stays a bound: every phase of predict grows with every constant)."""
    from dataclasses import replace

    def byte(v: float) -> int:
        return int(math.ceil(v - 1e-9)) if up else int(round(v))

    def factor(v: float) -> float:
        return math.ceil(v * 1e4 - 1e-6) / 1e4 if up else round(v, 4)

    d = dict(zip(_COLUMNS, (float(v) for v in w)))
    return replace(base, session_overhead_bytes=byte(d["session_overhead_bytes"]),
                   grad_op_bytes=byte(d["grad_op_bytes"]), graph_op_bytes=byte(d["graph_op_bytes"]),
                   channel_weight_factor=factor(d["channel_weight_factor"]),
                   activation_factor=factor(max(d["activation_factor"], 0.05)),
                   inference_activation_factor=factor(max(d["inference_activation_factor"], 0.05)),
                   gradient_factor=factor(1.0 + d["gradient_factor"]))


def _weights(cost) -> list[float]:
    """The fitted constants of ``cost`` as the linear model's weights (``_COLUMNS`` order)."""
    return [cost.activation_factor, cost.inference_activation_factor, cost.grad_op_bytes,
            cost.session_overhead_bytes, cost.gradient_factor - 1.0, cost.graph_op_bytes, cost.channel_weight_factor]


def _design(rows, key, cost):
    """(columns, held, measured) of the linear model at the phases that peak under ``cost``."""
    split = [_split(r["graph"], r["plan"], cost) for r in rows]
    a = np.insert(np.array([s[1:] for s in split], dtype=np.float64), 3, 1.0, axis=1)  # the overhead's column
    return (a, np.array([s[0] for s in split], dtype=np.float64),
            np.array([r[key] for r in rows], dtype=np.float64))


def fit_expected(rows, key: str, base):
    """The point estimate: non-negative least squares of the *relative* error (each plan weighs the
    same whatever its size), the constants not fitted taken from ``base``. Iterated: which phase
    peaks depends on the constants."""
    cost = base
    for _ in range(6):
        a, held, measured = _design(rows, key, cost)
        w, _ = nnls(a / measured[:, None], 1.0 - held / measured)
        cost = _cost_from(w, base)
    return cost


def fit_bound(rows, key: str, expected, margin: float = 0.05):
    """The bound plans are made with: a linear programme (``scipy.optimize.linprog``) that minimises
    the summed relative over-prediction subject to every plan predicted at least ``1 + margin``
    times its measured figure, each constant at least the point estimate's (so a bound is never
    below the expected figure, and only the constants the under-predicted plans need are
    raised, not one intercept for every plan). Iterated like :func:`fit_expected`."""
    from scipy.optimize import linprog

    cost, floor = expected, _weights(expected)
    for _ in range(6):
        a, held, measured = _design(rows, key, cost)
        res = linprog((a / measured[:, None]).sum(axis=0), A_ub=-a, b_ub=held - (1.0 + margin) * measured,
                      bounds=[(f, None) for f in floor], method="highs")
        if not res.success:
            raise RuntimeError(f"no bound covers the measured plans: {res.message}")
        cost = _cost_from(res.x, expected, up=True)
    short = [e for e in _errors(rows, key, cost, digits=6) if e < margin - 1e-6]
    if short:  # which phase peaks moved after the last programme: say so rather than ship it quietly
        log.warning("the bound covers %d calibration plan(s) by less than the margin (least %+.1f %%)",
                    len(short), 100 * min(short))
    return cost


def _errors(rows, key, cost, digits: int = 3) -> list[float]:
    """Per row, the prediction under ``cost`` over the measured ``key`` figure, minus 1."""
    from edgeadapt.sched import predict

    return [round(predict(r["graph"], r["plan"], cost).peak_bytes / r[key] - 1.0, digits) for r in rows]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="cnn")
    p.add_argument("--models", nargs="*", default=[], metavar="MODEL",
                   help="other reference models, or calibration-only small nets (SMALL_MODELS), measured with "
                        "GENERIC_PLANS and fitted together with --model's")
    p.add_argument("--channels", type=int, default=8)
    p.add_argument("--time-steps", type=int, default=256)
    p.add_argument("--classes", type=int, default=5)
    p.add_argument("--batch", type=int, default=30)
    p.add_argument("--n-windows", type=int, default=30)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--backend", choices=("ort-training", "portable"), default="ort-training",
                   help="the training engine measured (default ort-training: the shipped constants are its)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-tiny", dest="tiny", action="store_false",
                   help="fit on --model's plans only (default: also the tiny model's TINY_PLANS)")
    p.add_argument("--repeats", type=int, default=1, help="fresh processes per plan (median)")
    p.add_argument("--fit", choices=("anon", "total"), default="anon")
    p.add_argument("--check", action="store_true",
                   help="only compare the packaged constants' predictions with the measurements")
    p.add_argument("--margin", type=float, default=0.05,
                   help="the bound's least over-prediction of every calibration plan, as a fraction of its "
                        "measured peak (default 0.05)")
    p.add_argument("--rows", type=Path, help="also write the measured rows (with graph and plan) to this JSON")
    p.add_argument("--refit", type=Path, help="fit the rows of an earlier --rows file instead of measuring")
    p.add_argument("--out", type=Path,
                   help="the constants file to write (default: the packaged file of --backend's engine)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    from edgeadapt.atomic import atomic_write_json
    from edgeadapt.sched import CostModel, Graph, Plan, predict
    from edgeadapt.sched.cost import CONSTANTS_FILES
    from edgeadapt.versions import package_versions

    rows = []
    if args.refit:
        rows = [{**r, "graph": Graph.from_dict(r["graph"]), "plan": Plan.from_dict(r["plan"])}
                for r in json.loads(args.refit.read_text())]
    with tempfile.TemporaryDirectory(prefix="edgeadapt-calibrate-") as tmp:
        todo = [(*plan, args.model) for plan in PLANS + (CHECK_PLANS if args.check else ())]
        todo += [(*plan, name) for name in args.models for plan in GENERIC_PLANS]
        todo += list(TINY_PLANS) if args.tiny else []
        for policy, micro, cache, model_name in () if args.refit else todo:
            micro = min(micro, args.batch)
            bundle, manifest = _export(args, policy, micro, cache, Path(tmp), model_name)
            graph = Graph.from_dict(manifest.graph)
            plan_dict = {k: v for k, v in manifest.plan.items()
                         if k not in ("predicted_peak_bytes", "expected_peak_bytes")}
            plan = Plan.from_dict({**plan_dict, "micro_batch_windows": micro, "predicted": None})
            runs = [_measure(bundle, args, micro) for _ in range(args.repeats)]
            total = int(np.median([r["call_peak_bytes"] for r in runs]))
            anon = int(np.median([r["call_peak_anon_bytes"] for r in runs]))
            rows.append({"model": model_name, "policy": policy, "micro_batch_windows": micro,
                         "cache_features": plan.cache_features,
                         "graph": graph, "plan": plan, "call_peak_bytes": total, "call_peak_anon_bytes": anon})
            log.info("%-5s %-10s micro %2d cache %d: measured total %9d anon %9d", model_name, policy, micro,
                     plan.cache_features, total, anon)

    if args.rows:
        atomic_write_json(args.rows, [{**r, "graph": r["graph"].to_dict(), "plan": r["plan"].to_dict()} for r in rows])
    if args.check:  # how well the packaged constants predict this model: no fit, nothing written
        shipped = CostModel.default(args.backend)
        for r in rows:
            pred = predict(r["graph"], r["plan"], shipped).peak_bytes
            log.info("%-10s micro %2d cache %d: predicted %9d, measured anon %9d (%+.0f%%), total %9d (%+.0f%%)",
                     r["policy"], r["micro_batch_windows"], r["cache_features"], pred, r["call_peak_anon_bytes"],
                     100 * (pred / r["call_peak_anon_bytes"] - 1), r["call_peak_bytes"],
                     100 * (pred / r["call_peak_bytes"] - 1))
        return 0

    # Constants this script does not fit (the batch-statistics ones of
    # benchmarks/calibrate_batch_statistics.py, the recurrent layer's of benchmarks/calibrate_recurrent.py,
    # and their measurements) are kept from the file replaced.
    out = args.out or ROOT / "edgeadapt" / "sched" / CONSTANTS_FILES[args.backend]
    kept, kept_calibration = {"rollback_factor": 1.0, "rollback_state_factor": 0.0}, {}
    kept_expected = {}
    if out.exists():
        old = json.loads(out.read_text())
        kept.update({k: v for k, v in old.items()
                     if k not in (*_COLUMNS, "calibration", "expected", "rollback_factor", "rollback_state_factor")})
        kept_calibration = {k: v for k, v in old.get("calibration", {}).items()
                            if k in ("batch_statistics", "recurrent")}
        kept_expected = {k: v for k, v in old.get("expected", {}).items() if k == "recurrent_layer_bytes"}
    base = CostModel.from_dict(kept)

    fits = {}
    for figure, key in (("total", "call_peak_bytes"), ("anon", "call_peak_anon_bytes")):
        expected = fit_expected(rows, key, base)
        for kind, cost in (("expected", expected), ("bound", fit_bound(rows, key, expected, args.margin))):
            fits[f"{figure} {kind}"] = {**{k: getattr(cost, k) for k in _COLUMNS},
                                       "relative_errors": _errors(rows, key, cost)}
            log.info("fit %-5s %-8s: %s", figure, kind, fits[f"{figure} {kind}"])

    def constants(kind: str) -> dict:
        return {**kept, **(kept_expected if kind == "expected" else {}),
                **{k: v for k, v in fits[f"{args.fit} {kind}"].items() if k != "relative_errors"}}

    models = " + ".join(dict.fromkeys(r["model"] for r in rows))
    cost = CostModel(**constants("bound"), calibration={**kept_calibration,
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": " ".join(["benchmarks/calibrate_cost.py", *(argv or sys.argv[1:])]),
        "figure": args.fit, "margin": args.margin, "model": f"{models} {args.channels}x{args.time_steps}",
        "batch_windows": args.batch, "n_windows": args.n_windows, "threads": args.threads,
        "versions": package_versions(("edgeadapt", "numpy", "scipy", "torch", "onnx",
                                      "onnxruntime-training-cpu", "onnxruntime-training")),
        "fits": fits,
        "plans": [{k: v for k, v in r.items() if k not in ("graph", "plan")} for r in rows],
    })
    # The file holds the bound (what plans are made with) and, under "expected", the point
    # estimate reported beside it (CostModel.default / CostModel.expected).
    atomic_write_json(out, {**cost.to_dict(), "expected": constants("expected")})
    log.info("wrote %s", out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
