"""Does a memory budget hold, and how close is its prediction? Models, budget ladders, one check.

For a model and a budget: export a bundle with ``export_bundle(memory_budget=B)`` (the planner
picks what trains), then measure one ``Runner.adapt`` call by the project's measuring protocol
(:mod:`edgeadapt.measure`: a fresh torch-free process as a user has it) and report the
prediction next to the measured anonymous and total peaks (:func:`check_budget`). ``benchmarks/budget_table.py``
prints the README's table from it; ``tests/test_budget_holds.py`` asserts the budget.
:func:`check_label_free_budget` does the same for one label-free call (``Runner.adapt_unlabeled``).

Models: the reference ones (``edgeadapt.models.build_model``: cnn, mobilenet, transformer) and
four small user-style nets none of which the cost model was fitted on (:data:`USER_MODELS`):

* ``gru``: GRU(4, 16) over the time steps + Linear(16, 3) on the last state   [4 x 32]
* ``groupnorm``: Conv1d(4, 16, 5) + GroupNorm(4, 16) + ReLU + mean + Linear(16, 3)   [4 x 32]
* ``conv2d``: Conv2d(1, 8, 3) + BatchNorm2d(8) + ReLU + mean + Linear(8, 3)   [1 x 16 x 16]
* ``mlp``: Flatten + Linear(128, 64) + ReLU + Linear(64, 32) + ReLU + Linear(32, 3)   [4 x 32]

Torch is needed to export (server side); the measuring process is torch-free.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["USER_MODELS", "REFERENCE_MODELS", "CheckSettings", "build", "budget_ladder", "model_budgets",
           "check_budget", "check_label_free_budget", "summarize"]

USER_MODELS = ("gru", "groupnorm", "conv2d", "mlp")
REFERENCE_MODELS = ("cnn", "mobilenet", "transformer")


@dataclass(frozen=True)
class CheckSettings:
    """Shapes and the adapt call of a check.

    Attributes:
        n_windows, batch_windows, epochs: the planned and measured adapt call.
        channels, time_steps, classes: input and output of the reference models.
        backend: the training engine exported and loaded (``ort-training`` or ``portable``).
        threads, seed: intra-op threads; seeds of the weights and the data.
        batchnorm: the export's BatchNorm mode (``frozen`` or ``batch``; label-free checks use
            ``batch``).
    """

    n_windows: int = 40
    batch_windows: int = 16
    epochs: int = 2
    channels: int = 8
    time_steps: int = 256
    classes: int = 7
    backend: str = "ort-training"
    threads: int = 1
    seed: int = 0
    batchnorm: str = "frozen"


def build(name: str, settings: CheckSettings = CheckSettings()):
    """(model in eval mode, example input batch) of a reference or user-style model, seeded."""
    import torch
    from torch import nn

    torch.manual_seed(settings.seed)
    if name in REFERENCE_MODELS:
        from ..models import build_model

        model = build_model(name, settings.channels, settings.classes, settings.time_steps).eval()
        return model, torch.randn(2, settings.channels, settings.time_steps)

    class Pool(nn.Module):
        def __init__(self, dims):
            super().__init__()
            self.dims = dims

        def forward(self, x):
            return x.mean(dim=self.dims)

    class GRUNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.gru = nn.GRU(4, 16, batch_first=True)
            self.head = nn.Linear(16, 3)

        def forward(self, x):  # x: (batch, channels, time)
            out, _ = self.gru(x.transpose(1, 2))
            return self.head(out[:, -1])

    if name == "gru":
        return GRUNet().eval(), torch.randn(8, 4, 32)
    if name == "groupnorm":
        return nn.Sequential(nn.Conv1d(4, 16, 5), nn.GroupNorm(4, 16), nn.ReLU(), Pool(-1), nn.Linear(16, 3)).eval(), \
            torch.randn(8, 4, 32)
    if name == "conv2d":
        return nn.Sequential(nn.Conv2d(1, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), Pool((2, 3)), nn.Linear(8, 3)).eval(), \
            torch.randn(8, 1, 16, 16)
    if name == "mlp":
        return nn.Sequential(nn.Flatten(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(),
                             nn.Linear(32, 3)).eval(), torch.randn(8, 4, 32)
    raise ValueError(f"unknown model {name!r}; use one of {REFERENCE_MODELS + USER_MODELS}")


def budget_ladder(low_bytes: int, high_bytes: int, count: int, extra: tuple[int, ...] = ()) -> list[int]:
    """``count`` budgets spaced geometrically from ``low_bytes`` to ``high_bytes`` (both included),
    plus the ``extra`` values that fall strictly inside (an extra value replaces interior ladder
    points within 10 % of it); sorted, distinct, ints.

    Raises:
        ValueError: ``count < 2`` or ``low_bytes`` not in ``(0, high_bytes]``.
    """
    if count < 2:
        raise ValueError(f"count must be >= 2, got {count}")
    if not 0 < low_bytes <= high_bytes:
        raise ValueError(f"need 0 < low_bytes <= high_bytes, got {low_bytes} and {high_bytes}")
    ratio = (high_bytes / low_bytes) ** (1.0 / (count - 1))
    inside = [int(e) for e in extra if low_bytes < e < high_bytes]
    interior = [int(round(low_bytes * ratio**i)) for i in range(1, count - 1)]
    interior = [b for b in interior if all(abs(b - e) > 0.1 * e for e in inside)]
    return sorted({low_bytes, high_bytes, *interior, *inside})


def model_budgets(model, example, settings: CheckSettings, count: int) -> list[int]:
    """``count`` budgets from the smallest feasible one (``sched.minimum_budget``) to full
    fine-tuning's predicted peak, geometric."""
    from .. import sched
    from ..export import plan_cost
    from ..export.planning import model_graph

    graph, weights = model_graph(model, example, settings.batchnorm)
    cost = plan_cost(settings.backend)
    low = sched.minimum_budget(graph, n_windows=settings.n_windows, batch_windows=settings.batch_windows, cost=cost)
    full = sched.plan_from_policy(graph, sched.UpdatePolicy.full(), weights=weights,
                                  batch_windows=settings.batch_windows, n_windows=settings.n_windows)
    return budget_ladder(low, max(low, sched.predict(graph, full, cost).peak_bytes), count)


def check_budget(name: str, budget_bytes: int, workdir: Path,
                 settings: CheckSettings = CheckSettings()) -> dict[str, Any]:
    """Export ``name`` under ``budget_bytes`` and measure one adapt call (module docstring) in two
    fresh processes: the bound (loaded, then adapt, freed heap returned to the OS before the
    baseline: everything the call touches counts) and a user's (loaded, ``predict`` on the data,
    then adapt, heap as it is). Both with the progress bar on.

    Returns:
        A row: the plan (what trains, micro-batch, cut, cache, predicted peak), the bound's
        ``call_peak_anon_bytes`` / ``call_peak_bytes`` (with ``predicted_over_anon``), the
        user process's ``user_anon_bytes`` / ``user_total_bytes``, and the sched ``graph`` and
        ``plan`` (JSON) the prediction came from.
    """
    from ..export import export_bundle
    from ..measure import MeasureSpec, measure_in_fresh_process

    model, example = build(name, settings)
    out = Path(workdir) / f"{name}-{budget_bytes}"
    manifest = export_bundle(model, example, out, memory_budget=budget_bytes, n_windows=settings.n_windows,
                             batch_windows=settings.batch_windows, backend=settings.backend,
                             batchnorm=settings.batchnorm)
    plan = manifest.plan
    common = dict(bundle=str(out), epochs=settings.epochs, threads=settings.threads, seed=settings.seed,
                  backend=settings.backend, progress=True)
    env = {"OMP_NUM_THREADS": str(settings.threads)}
    bound = measure_in_fresh_process(MeasureSpec(**common, trim_heap=True), env=env)
    user = measure_in_fresh_process(MeasureSpec(**common, predict_first=True), env=env)
    predicted = int(plan["predicted_peak_bytes"])
    expected = (plan.get("expected_peak_bytes") or {}).get(bound["backend"])  # for the engine that ran the call
    return {
        "model": name, "budget_bytes": budget_bytes, "backend": bound["backend"],
        "trainable_numel": manifest.trainable_numel, "total_numel": manifest.total_numel,
        "micro_batch_windows": plan["micro_batch_windows"], "cut": plan["cut"],
        "cache_features": plan["cache_features"],
        "predicted_bytes": predicted, "predicted_where": (plan.get("predicted") or {}).get("where"),
        "call_peak_anon_bytes": bound["call_peak_anon_bytes"], "call_peak_bytes": bound["call_peak_bytes"],
        "user_anon_bytes": user["call_peak_anon_bytes"], "user_total_bytes": user["call_peak_bytes"],
        "step_peak_anon_bytes": bound["step_peak_anon_bytes"], "steps": bound["steps"],
        "predicted_over_anon": predicted / max(1, bound["call_peak_anon_bytes"]),
        "expected_bytes": expected,
        "expected_over_anon": math.nan if expected is None else expected / max(1, bound["call_peak_anon_bytes"]),
        # the form benchmarks/calibrate_cost.py --refit reads: the rows can calibrate the cost model
        "policy": f"budget {budget_bytes}", "graph": manifest.graph, "plan": manifest.plan,
    }


def check_label_free_budget(name: str, budget_bytes: int, workdir: Path,
                            settings: CheckSettings = CheckSettings()) -> dict[str, Any]:
    """Export ``name`` for label-free adaptation (``loss="entropy"``; ``settings.batchnorm`` should
    be ``"batch"``, or there are no statistics to adapt) under ``budget_bytes`` and measure one
    ``adapt_unlabeled`` call with the recommended settings over ``n_windows`` windows, as
    :func:`check_budget` measures ``adapt`` (the bound, heap trimmed; a user's process after a
    ``predict``).

    Returns:
        A row: ``refused`` (the call refused before any work: the budget is below what label-free
        passes of one window need; then no figures), the bound's ``call_peak_anon_bytes`` /
        ``call_peak_bytes`` and the user process's ``user_anon_bytes``.
    """
    from ..export import export_bundle
    from ..measure import MeasureSpec, measure_in_fresh_process

    model, example = build(name, settings)
    out = Path(workdir) / f"{name}-label-free-{budget_bytes}"
    export_bundle(model, example, out, memory_budget=budget_bytes, n_windows=settings.n_windows,
                  batch_windows=settings.batch_windows, backend=settings.backend, loss="entropy",
                  batchnorm=settings.batchnorm)
    common = dict(bundle=str(out), n_windows=settings.n_windows, threads=settings.threads, seed=settings.seed,
                  backend=settings.backend, method="unlabeled")
    env = {"OMP_NUM_THREADS": str(settings.threads)}
    row = {"model": name, "budget_bytes": budget_bytes, "backend": settings.backend, "method": "label-free"}
    try:
        bound = measure_in_fresh_process(MeasureSpec(**common, trim_heap=True), env=env)
    except RuntimeError as e:
        if "BudgetExceeded" not in str(e):
            raise
        return {**row, "refused": str(e).strip().splitlines()[-1]}
    user = measure_in_fresh_process(MeasureSpec(**common, predict_first=True), env=env)
    return {**row, "refused": None, "kept": bound["kept"], "call_peak_anon_bytes": bound["call_peak_anon_bytes"],
            "call_peak_bytes": bound["call_peak_bytes"], "user_anon_bytes": user["call_peak_anon_bytes"]}


def summarize(rows: list[dict[str, Any]], tolerance: float = 0.15) -> dict[str, int]:
    """Counts over rows: measured anonymous within the budget (bound and user process); the
    expected peak (point estimate) and the predicted bound within ``tolerance`` of the measured
    anonymous peak (heap trimmed)."""
    ok = [r for r in rows if "error" not in r]

    def close(key: str) -> int:
        return sum(math.isfinite(r.get(key, math.nan)) and abs(r[key] - 1.0) <= tolerance for r in ok)

    return {"rows": len(ok), "within_budget": sum(r["call_peak_anon_bytes"] <= r["budget_bytes"] for r in ok),
            "user_within_budget": sum(r["user_anon_bytes"] <= r["budget_bytes"] for r in ok),
            "within_tolerance": close("expected_over_anon"), "bound_within_tolerance": close("predicted_over_anon")}
