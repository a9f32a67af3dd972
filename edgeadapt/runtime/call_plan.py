"""An adapt call held to the bundle's memory budget before any work.

The exported plan (manifest ``plan``) covers ``n_windows`` adaptation windows and forward /
backward passes of ``micro_batch_windows`` windows; its budget bounds the whole call. A call
within that (no more windows, no larger micro-batch; a larger *batch* only adds micro-batches,
whose gradients accumulate) runs as planned. Otherwise the call is planned again with the
scheduler before the first step:

* more windows than planned, with cached features (the cache grows with the windows): the
  micro-batch is chosen again within the budget (:func:`edgeadapt.sched.replan`);
* an explicit ``micro_batch`` above the plan's: its predicted peak must fit the budget;

and refused with :class:`~edgeadapt.sched.BudgetExceeded` (the predicted need and the budget)
when nothing fits. Bundles without a budget (a hand-written policy) are not checked.

Calls are predicted with the cost constants of the engine that runs them
(:meth:`edgeadapt.sched.CostModel.default`). The scheduler and the plan are loaded with the
runner (:class:`CallPlan` is built at load), so nothing is imported during ``adapt``; without a
budget they are loaded only when a report asks for a prediction (:meth:`CallPlan.predict_label_free`).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, NamedTuple

from ..bundle import BundleError, Manifest

__all__ = ["CallPlan", "LabelFreePasses"]


class LabelFreePasses(NamedTuple):
    """How a label-free call runs under a budget (:meth:`CallPlan.label_free_passes`).

    Attributes:
        pass_windows: windows per inference pass.
        stats_windows: windows per statistics pass (``None``: no statistics passes).
        entropy_step_windows: the most windows per entropy step (``None``: no limit).
        predicted: the predicted peak with these passes (a ``sched.Peak``; ``None`` without a budget).
    """

    pass_windows: int
    stats_windows: int | None
    entropy_step_windows: int | None
    predicted: Any

log = logging.getLogger(__name__)


class CallPlan:
    """The bundle's plan and budget, ready to check calls (see the module docstring)."""

    def __init__(self, manifest: Manifest, engine: str):
        self._manifest, self._engine = manifest, engine
        self.budget_bytes = (manifest.plan or {}).get("budget_bytes")
        self._plan = self._graph = None
        if self.budget_bytes is not None:
            self._load_plan()

    def _load_plan(self) -> bool:
        """Parse the manifest's plan and graph and load the scheduler (once); ``False`` when the
        bundle carries none. Done at load for a budget; without one only for reports
        (:meth:`predict_label_free`), so an unbudgeted call imports nothing."""
        if self._plan is not None:
            return True
        manifest = self._manifest
        if not manifest.plan or manifest.graph is None:
            return False
        from .. import sched

        self._sched = sched
        self._cost = sched.CostModel.default(self._engine)
        try:
            self._plan = sched.Plan.from_dict(manifest.plan)
            self._graph = sched.Graph.from_dict(manifest.graph)
        except (KeyError, TypeError, ValueError) as e:
            raise BundleError(f"the manifest's plan or graph is malformed ({e}); re-export the bundle") from None
        return True

    def _budget_plan(self):
        """The plan calls are checked against: ``None`` without a budget (a report may still have
        parsed the plan, :meth:`predict_label_free`) or without a plan."""
        return self._plan if self.budget_bytes is not None else None

    def predict_label_free(self, **kwargs):
        """The predicted peak (``sched.Peak``) of a label-free call with the given passes
        (:func:`edgeadapt.sched.predict_label_free`'s keyword arguments), budget or not; ``None``
        when the bundle carries no plan. Without a budget this loads the scheduler: for reports,
        not during a call."""
        if not self._load_plan():
            return None
        return self._sched.predict_label_free(self._graph, self._plan, self._cost, **kwargs)

    def micro_batch(self, n_windows: int, batch_windows: int, micro: int, explicit: bool, fixed: bool) -> int:
        """The micro-batch a call of ``n_windows`` windows in steps of ``batch_windows`` runs with.

        Args:
            n_windows, batch_windows: the call's windows and windows per step.
            micro: the micro-batch the runner would use (explicit, or the plan's).
            explicit: the caller passed ``micro``; it is kept (checked, never changed).
            fixed: the micro-batch cannot change (batch-statistics BatchNorm).

        Raises:
            BudgetExceeded: the call cannot be planned within the budget (no work done yet).
        """
        plan = self._budget_plan()
        if plan is None:
            return micro
        grows = plan.cache_features and n_windows > plan.n_windows
        if not grows and micro <= plan.micro_batch_windows:
            return micro
        trial = replace(plan, n_windows=max(n_windows, plan.n_windows), batch_windows=batch_windows,
                        micro_batch_windows=micro, predicted=None)
        if explicit or fixed:
            peak = self._sched.predict(self._graph, trial, self._cost)
            if peak.peak_bytes > self.budget_bytes:
                fix = (f"this bundle normalises with batch statistics, so a step is one pass over its batch: "
                       f"pass batch_size <= {plan.micro_batch_windows}" if fixed and not explicit
                       else "pass fewer windows or a smaller micro_batch")
                raise self._sched.BudgetExceeded(
                    peak.peak_bytes, self.budget_bytes, peak.where,
                    detail=f"adapt over {n_windows} windows with micro-batches of {micro} (planned: "
                           f"{plan.n_windows} windows, micro-batches of {plan.micro_batch_windows}) is over the "
                           f"bundle's memory budget; {fix}")
            return micro
        try:
            again = self._sched.replan(self._graph, replace(trial, micro_batch_windows=min(micro, batch_windows)),
                                       n_windows, cost=self._cost)
        except self._sched.NoFeasiblePlan as e:
            raise self._sched.BudgetExceeded(
                e.need_bytes, e.have_bytes, e.where,
                detail=f"adapt over {n_windows} windows (planned: {plan.n_windows}) needs at least that with the "
                       "smallest micro-batch; adapt on fewer windows or re-export with a larger budget") from None
        log.info("adapt over %d windows (planned %d): micro-batches of %d within the %d-byte budget",
                 n_windows, plan.n_windows, again.micro_batch_windows, self.budget_bytes)
        return again.micro_batch_windows

    def label_free_passes(self, *, held_bytes: int, max_pass_windows: int, max_stats_windows: int | None,
                          min_stats_windows: int, view_bytes_per_window: int,
                          entropy_steps: bool) -> LabelFreePasses:
        """Windows per inference pass, per statistics pass and per entropy step of a label-free
        call (:mod:`~edgeadapt.sched.label_free_cost`): the most (up to the maxima) whose predicted
        peak fits the budget, with that peak; without a budget the maxima (and no entropy-step
        limit, no prediction).

        Args:
            held_bytes: what the adapter holds for the whole call.
            max_pass_windows: the most windows per inference pass.
            max_stats_windows: the most per statistics pass (``None``: no statistics passes).
            min_stats_windows: the fewest per statistics pass the method can use.
            view_bytes_per_window: temporaries per window while the gate's views are built.
            entropy_steps: the call takes optimizer steps (at most the plan's micro-batch each).

        Raises:
            BudgetExceeded: even the smallest passes do not fit (nothing was done yet).
        """
        plan = self._budget_plan()
        if plan is None:
            return LabelFreePasses(max_pass_windows, max_stats_windows, None, None)

        def peak(pass_windows: int, stats_windows: int | None):
            return self.predict_label_free(held_bytes=held_bytes, pass_windows=pass_windows,
                                           stats_windows=stats_windows, view_bytes_per_window=view_bytes_per_window,
                                           entropy_steps=entropy_steps)

        stats = None
        if max_stats_windows is not None:
            sizes = [w for w in _halvings(max_stats_windows) if w >= min_stats_windows] or [min_stats_windows]
            stats = next((w for w in sizes if peak(1, w).peak_bytes <= self.budget_bytes), None)
            if stats is None:
                self._refuse(peak(1, sizes[-1]), f"statistics passes of {sizes[-1]} windows")
        fits = ((w, peak(w, stats)) for w in _halvings(max_pass_windows))
        passes, predicted = next(((w, p) for w, p in fits if p.peak_bytes <= self.budget_bytes), (None, None))
        if passes is None:
            self._refuse(peak(1, stats), "passes of 1 window")
        log.info("label-free passes within the %d-byte budget: %d windows (statistics: %s)",
                 self.budget_bytes, passes, stats)
        return LabelFreePasses(passes, stats, plan.micro_batch_windows if entropy_steps else None, predicted)

    def _refuse(self, peak, what: str):
        raise self._sched.BudgetExceeded(
            peak.peak_bytes, self.budget_bytes, peak.where,
            detail=f"label-free adaptation with {what} is over the bundle's memory budget; re-export with a "
                   "larger memory_budget, keep the source statistics (stats_prior_windows=inf: no statistics "
                   "session), or hold fewer windows back for the gate (gate_windows; gate=False: none)")


def _halvings(n: int) -> list[int]:
    """``n``, ``n // 2``, ... down to 1."""
    out = []
    while n >= 1:
        out.append(n)
        n //= 2
    return out
