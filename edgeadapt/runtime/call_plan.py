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
runner (:class:`CallPlan` is built at load), so nothing is imported during ``adapt``.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from ..bundle import BundleError, Manifest

__all__ = ["CallPlan"]

log = logging.getLogger(__name__)


class CallPlan:
    """The bundle's plan and budget, ready to check calls (see the module docstring)."""

    def __init__(self, manifest: Manifest, engine: str):
        plan = manifest.plan or {}
        self.budget_bytes = plan.get("budget_bytes")
        self._plan = self._graph = None
        if self.budget_bytes is None or manifest.graph is None:
            return
        from .. import sched

        self._sched = sched
        self._cost = sched.CostModel.default(engine)
        try:
            self._plan = sched.Plan.from_dict(plan)
            self._graph = sched.Graph.from_dict(manifest.graph)
        except (KeyError, TypeError, ValueError) as e:
            raise BundleError(f"the manifest's plan or graph is malformed ({e}); re-export the bundle") from None

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
        plan = self._plan
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
                raise self._sched.BudgetExceeded(
                    peak.peak_bytes, self.budget_bytes, peak.where,
                    detail=f"adapt over {n_windows} windows with micro-batches of {micro} (planned: "
                           f"{plan.n_windows} windows, micro-batches of {plan.micro_batch_windows}) is over the "
                           "bundle's memory budget; pass fewer windows or a smaller micro_batch")
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
