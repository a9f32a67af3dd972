"""plan_for_budget / replan: verified plans, the smallest feasible budget, JSON round trip."""

from __future__ import annotations

import random

import pytest
from sched_testgraphs import random_graph

from edgeadapt.sched import (CostModel, NoFeasiblePlan, Plan, UpdatePolicy, minimum_budget, plan_for_budget,
                             plan_from_policy, predict, replan, verify)
from edgeadapt.sched.batching import micro_batch_sizes
from edgeadapt.sched.resolve import cut_of

COST = CostModel(session_overhead_bytes=64, per_window_bytes=4, grad_op_bytes=16)


def test_micro_batch_sizes():
    assert micro_batch_sizes(8) == [8, 4, 2, 1]
    assert micro_batch_sizes(30) == [30, 15, 8, 4, 2, 1]
    assert micro_batch_sizes(1) == [1]


@pytest.mark.parametrize("seed", range(6))
def test_plan_fits_its_budget_and_round_trips(seed):
    rng = random.Random(seed)
    g = random_graph(rng, rng.randint(3, 9))
    low = minimum_budget(g, n_windows=16, batch_windows=8, cost=COST)
    for budget in (low, low * 2, low * 10):
        plan = plan_for_budget(g, budget, n_windows=16, batch_windows=8, cost=COST)
        assert plan.budget_bytes == budget and plan.predicted.peak_bytes <= budget
        assert verify(g, plan, cost=COST) == plan.predicted == predict(g, plan, COST)
        assert Plan.from_json(plan.to_json()) == plan
        assert plan.cut == (plan.cut if plan.cache_features else cut_of(g, plan.params))
    with pytest.raises(NoFeasiblePlan) as info:
        plan_for_budget(g, low - 1, n_windows=16, batch_windows=8, cost=COST)
    assert info.value.need_bytes == low and info.value.have_bytes == low - 1
    assert str(low) in str(info.value)


def test_more_budget_never_lowers_importance():
    rng = random.Random(9)
    g = random_graph(rng, 8)
    importance = {p.name: rng.random() for p in g.params}
    low = minimum_budget(g, n_windows=8, batch_windows=4, cost=COST, importance=importance)
    last = -1.0
    for factor in (1, 2, 4, 8, 64):
        plan = plan_for_budget(g, low * factor, n_windows=8, batch_windows=4, cost=COST, importance=importance,
                               importance_tolerance=0.0)
        value = sum(importance[p.name] * (len(p.channels) / g.param(p.name).out_channels if p.channels else 1)
                    for p in plan.trained)
        assert value >= last - 1e-9
        last = value


def test_given_policy_is_kept_and_fitted():
    rng = random.Random(4)
    g = random_graph(rng, 7)
    last_module = g.params[-1].module
    policy = UpdatePolicy.last_layer(last_module)
    loose = plan_for_budget(g, 10**9, policy=policy, batch_windows=8, n_windows=16, cost=COST)
    assert loose.micro_batch_windows == 8 and loose.policy == policy.to_dict()
    assert [p.mode for p in loose.params] == [p.mode for p in plan_from_policy(g, policy).params]
    with pytest.raises(NoFeasiblePlan) as info:
        plan_for_budget(g, 10, policy=policy, batch_windows=8, n_windows=16, cost=COST)
    need = info.value.need_bytes
    tight = plan_for_budget(g, need, policy=policy, batch_windows=8, n_windows=16, cost=COST)
    assert tight.predicted.peak_bytes <= need


def test_replan_for_more_windows_shrinks_or_refuses():
    rng = random.Random(12)
    for _ in range(20):
        g = random_graph(rng, 6, skip_p=0.0)
        plan = plan_for_budget(g, minimum_budget(g, n_windows=4, batch_windows=8, cost=COST) * 3,
                               n_windows=4, batch_windows=8, cost=COST)
        try:
            again = replan(g, plan, 4000, cost=COST)
        except NoFeasiblePlan as e:
            assert e.need_bytes > plan.budget_bytes
            continue
        assert again.n_windows == 4000 and again.params == plan.params
        assert again.predicted.peak_bytes <= plan.budget_bytes
        assert again.micro_batch_windows <= plan.micro_batch_windows or again.cache_features != plan.cache_features
