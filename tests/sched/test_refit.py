"""refit: a made plan's updates planned again under a constraint the exporter meets (an op whose
activations must be kept, a prefix that cannot be cached, no recompute at all); the result is
verified against the same budget, or the planner says no plan fits."""

from __future__ import annotations

import random

import pytest
from sched_testgraphs import random_graph

from edgeadapt.sched import CostModel, NoFeasiblePlan, UpdatePolicy, plan_for_budget, plan_from_policy, refit, verify

COST = CostModel(session_overhead_bytes=64, per_window_bytes=4, grad_op_bytes=16)


def _recomputing_plans(n: int):
    """Plans of random graphs (every parameter trained) whose budget makes the planner recompute."""
    rng = random.Random(7)
    found = []
    while len(found) < n:
        g = random_graph(rng, rng.randint(5, 12), skip_p=0.0)
        kw = dict(policy=UpdatePolicy.full(), batch_windows=8, n_windows=16, cost=COST)
        budget = plan_for_budget(g, 10**12, **kw).predicted.peak_bytes
        for _ in range(60):
            budget = int(budget * 0.97)
            try:
                plan = plan_for_budget(g, budget, **kw)
            except NoFeasiblePlan:
                break
            if plan.recomputed:
                found.append((g, plan))
                break
    return found


def _refit_checked(g, plan, **constraints):
    """``refit``'s plan, checked against the budget it was refitted to (same updates, verified),
    or ``None`` when the planner refuses (then it must name a budget above the plan's)."""
    try:
        fitted = refit(g, plan, cost=COST, **constraints)
    except NoFeasiblePlan as e:
        assert e.need_bytes > plan.budget_bytes
        return None
    assert fitted.params == plan.params and fitted.budget_bytes == plan.budget_bytes
    assert fitted.predicted.peak_bytes <= plan.budget_bytes
    verify(g, fitted, plan.budget_bytes, cost=COST)  # raises BudgetExceeded otherwise
    return fitted


@pytest.mark.parametrize("case", range(12))
def test_kept_activations_are_never_recomputed_and_the_budget_holds(case):
    g, plan = _recomputing_plans(12)[case]
    kept = {plan.recomputed[0]}
    fitted = _refit_checked(g, plan, keep_activations=kept)
    assert fitted is None or not kept & set(fitted.recomputed)


@pytest.mark.parametrize("case", range(12))
def test_without_recompute_the_plan_recomputes_nothing(case):
    g, plan = _recomputing_plans(12)[case]
    fitted = _refit_checked(g, plan, allow_remat=False)
    if fitted is not None:
        assert fitted.recomputed == ()
        # it fits without recompute only at a smaller micro-batch (the planner tries recompute last)
        assert fitted.micro_batch_windows < plan.micro_batch_windows


def test_most_refits_find_a_plan():
    """The cases above are not all refusals: most random plans refit within their budget."""
    plans = _recomputing_plans(12)
    assert sum(_refit_checked(g, p, keep_activations={p.recomputed[0]}) is not None for g, p in plans) >= 6


def test_refit_with_nothing_to_change_keeps_a_fitting_plan():
    g, plan = _recomputing_plans(1)[0]
    fitted = _refit_checked(g, plan)
    assert fitted.micro_batch_windows == plan.micro_batch_windows and fitted.recomputed == plan.recomputed


def test_without_the_feature_cache_the_prefix_runs_every_step():
    rng = random.Random(3)
    checked = 0
    for _ in range(40):
        g = random_graph(rng, rng.randint(5, 10), skip_p=0.0)
        policy = UpdatePolicy.last_layer(g.params[-1].module)
        plan = plan_for_budget(g, 10**12, policy=policy, batch_windows=8, n_windows=16, cost=COST)
        if not plan.cache_features:
            continue
        for budget in (10**12, plan.predicted.peak_bytes):
            tight = plan_for_budget(g, budget, policy=policy, batch_windows=8, n_windows=16, cost=COST)
            fitted = _refit_checked(g, tight, cache_features=False, allow_remat=True)
            if fitted is not None:
                assert not fitted.cache_features
                checked += 1
    assert checked > 0, "no random graph made a plan that caches features"


def test_without_a_budget_the_constraints_are_applied_and_predicted():
    g = random_graph(random.Random(5), 8, skip_p=0.0)
    plan = plan_from_policy(g, UpdatePolicy.last_layer(g.params[-1].module), batch_windows=8, n_windows=16)
    fitted = refit(g, plan, cache_features=False, cost=COST)
    assert not fitted.cache_features and fitted.budget_bytes is None and fitted.predicted is not None
    assert fitted.params == plan.params and fitted.recomputed == ()
