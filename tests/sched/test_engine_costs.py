"""Cost constants per training engine: each engine's shipped constants, and the bound a bundle
holding several engines is planned with (every prediction at least each engine's)."""

from __future__ import annotations

import random
from dataclasses import fields

import pytest
from sched_testgraphs import random_graph, random_plan

from edgeadapt.sched import ENGINES, CostModel, predict
from edgeadapt.sched.verify import verify


def test_every_engine_ships_measured_constants():
    for engine in ENGINES:
        cost = CostModel.default(engine)
        assert cost.session_overhead_bytes > 0 and cost.gradient_factor >= 1.0
        assert cost.calibration["figure"] == "anon" and cost.calibration["plans"]
    assert CostModel.default() == CostModel.default("ort-training")
    with pytest.raises(ValueError, match="no cost constants for engine 'tflite'"):
        CostModel.default("tflite")


def test_the_bound_takes_each_constant_from_the_engine_with_the_largest():
    bound = CostModel.bounding(ENGINES)
    for f in fields(CostModel):
        if f.name != "calibration":
            assert getattr(bound, f.name) == max(getattr(CostModel.default(e), f.name) for e in ENGINES)
    assert CostModel.bounding(["portable"]) == CostModel.default("portable")
    with pytest.raises(ValueError, match="no engine"):
        CostModel.bounding([])


@pytest.mark.parametrize("seed", range(30))
def test_a_plan_within_budget_under_the_bound_is_within_it_on_every_engine(seed):
    rng = random.Random(seed)
    g = random_graph(rng, rng.randint(3, 12))
    plan = random_plan(rng, g)
    bound = CostModel.bounding(ENGINES)
    peak = predict(g, plan, bound).peak_bytes
    for engine in ENGINES:
        cost = CostModel.default(engine)
        assert predict(g, plan, cost).peak_bytes <= peak
        verify(g, plan, peak, cost=cost)  # raises BudgetExceeded otherwise


@pytest.mark.parametrize("seed", range(30))
def test_the_expected_peak_never_exceeds_the_bound_plans_are_made_with(seed):
    """The calibration fits the bound with every constant at least the point estimate's, and every
    phase of predict grows with every constant: the expected figure of any plan is at most its
    bound, on each engine."""
    rng = random.Random(seed)
    g = random_graph(rng, rng.randint(3, 12))
    plan = random_plan(rng, g)
    for engine in ENGINES:
        expected, bound = CostModel.expected(engine), CostModel.default(engine)
        for f in fields(CostModel):
            if f.name != "calibration":
                assert getattr(expected, f.name) <= getattr(bound, f.name), (engine, f.name)
        assert predict(g, plan, expected).peak_bytes <= predict(g, plan, bound).peak_bytes
