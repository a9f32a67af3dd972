"""Update policies: parsing, validation, JSON round trip, and the rule form of any plan."""

from __future__ import annotations

import random

import numpy as np
import pytest
from sched_testgraphs import random_graph

from edgeadapt.sched import CostModel, Graph, Op, Param, minimum_budget, plan_for_budget
from edgeadapt.sched.plan import ParamPlan, Plan
from edgeadapt.sched.policy import Mode, Rule, UpdatePolicy
from edgeadapt.sched.resolve import cut_of, policy_of_plan, resolve_channels, resolve_params


def test_parse_and_round_trip():
    p = UpdatePolicy.parse("head=full, blocks.3.conv=channels:0.25, blocks.2.conv=channels:1+4, *=bias")
    assert p.default is Mode.BIAS
    assert p.rules == (Rule("head", "full"), Rule("blocks.3.conv", "channels", ratio=0.25),
                       Rule("blocks.2.conv", "channels", indices=(1, 4)))
    assert UpdatePolicy.from_dict(p.to_dict()) == p
    assert UpdatePolicy.parse("last-layer") == UpdatePolicy.last_layer()


def test_first_matching_rule_wins_and_types_filter():
    p = UpdatePolicy(rules=(Rule("blocks.0.*", "frozen"), Rule("*", "full", types=("BatchNorm1d",))), default="bias")
    assert p.rule_for("blocks.0.bn", "BatchNorm1d").mode is Mode.FROZEN
    assert p.rule_for("blocks.1.bn", "BatchNorm1d").mode is Mode.FULL
    assert p.rule_for("blocks.1.conv", "Conv1d") is None


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(pattern="a", mode="channels"), "exactly one of indices= or ratio="),
        (dict(pattern="a", mode="channels", ratio=0.0), r"ratio must be in \(0, 1\]"),
        (dict(pattern="a", mode="full", ratio=0.5), "only apply to mode 'channels'"),
        (dict(pattern="a", mode="sometimes"), "not a valid Mode"),
    ],
)
def test_invalid_rules(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Rule(**kwargs)


def test_parse_errors():
    with pytest.raises(ValueError, match="not pattern=mode"):
        UpdatePolicy.parse("head")
    with pytest.raises(ValueError, match="default mode cannot be 'channels'"):
        UpdatePolicy(default="channels")


def test_resolve_channels_by_index_and_ratio():
    w = np.zeros((6, 2))
    w[4] = 3.0
    w[1] = 2.0
    assert resolve_channels(Rule("m", "channels", ratio=0.3), "m", w) == (1, 4)
    assert resolve_channels(Rule("m", "channels", indices=(5, 0, 5)), "m", w) == (0, 5)
    with pytest.raises(ValueError, match=r"channels \[7\] out of range for m which has 6"):
        resolve_channels(Rule("m", "channels", indices=(7,)), "m", w)


def test_rule_naming_parameters_decides_only_those():
    p = UpdatePolicy.parse("blocks.0.bn:weight=full, blocks.1.conv:weight+bias=channels:0+2, *=bias")
    assert p.rules == (Rule("blocks.0.bn", "full", params=("weight",)),
                       Rule("blocks.1.conv", "channels", indices=(0, 2), params=("weight", "bias")))
    assert UpdatePolicy.from_dict(p.to_dict()) == p
    assert p.rule_for("blocks.0.bn", "BatchNorm1d", "weight").mode is Mode.FULL
    assert p.rule_for("blocks.0.bn", "BatchNorm1d", "bias") is None  # falls through to the default
    g = _norm_graph()
    decided = {pp.name: pp for pp in resolve_params(g, UpdatePolicy.parse("bn:weight=full"))}
    assert decided["bn.weight"].mode is Mode.FULL and decided["bn.bias"].mode is Mode.FROZEN
    with pytest.raises(ValueError, match="local parameter names"):
        Rule("bn", "full", params=("bn.weight",))
    with pytest.raises(ValueError, match="local parameter names"):
        Rule("bn", "full", params=())


def _norm_graph() -> Graph:
    """conv -> BatchNorm -> odd (two weights of different output-channel counts) -> head."""
    params = (Param("conv.weight", (40, 4, 3), module="conv", module_type="Conv1d"),
              Param("conv.bias", (40,), module="conv", module_type="Conv1d"),
              Param("bn.weight", (40,), module="bn", module_type="BatchNorm1d"),
              Param("bn.bias", (40,), module="bn", module_type="BatchNorm1d"),
              Param("odd.weight", (40, 40), module="odd", module_type="Odd"),
              Param("odd.gate", (8, 40), module="odd", module_type="Odd"),
              Param("head.weight", (3, 40), module="head", module_type="Linear"),
              Param("head.bias", (3,), module="head", module_type="Linear"))
    ops = (Op("conv", "Conv", ("conv.weight", "conv.bias"), (), 2560, 1024, 0, 10_000, "conv"),
           Op("bn", "Mul", ("bn.weight", "bn.bias"), ("conv",), 2560, 2560, 0, 100, "bn"),
           Op("odd", "X", ("odd.weight", "odd.gate"), ("bn",), 2560, 2560, 0, 10_000, "odd"),
           Op("pool", "ReduceMean", (), ("odd",), 160, 0, 0, 100, "pool"),
           Op("head", "Gemm", ("head.weight", "head.bias"), ("pool",), 12, 160, 0, 100, "head"))
    return Graph(ops, params, 1024, "norm")


def test_policy_of_plan_resolves_to_any_per_parameter_choice():
    rng = random.Random(0)
    graphs = [_norm_graph(), *(random_graph(rng, rng.randint(2, 9)) for _ in range(30))]
    for g in graphs:
        for _ in range(20):
            params = []
            for p in g.params:
                r = rng.random()
                if r < 0.3:
                    params.append(ParamPlan(p.name, Mode.FULL))
                elif r < 0.6 and p.out_channels > 1:
                    k = rng.randint(1, p.out_channels - 1)
                    params.append(ParamPlan(p.name, Mode.CHANNELS, tuple(sorted(rng.sample(range(p.out_channels), k)))))
                else:
                    params.append(ParamPlan(p.name, Mode.FROZEN))
            plan = Plan(g.name, tuple(params), cut_of(g, tuple(params)), 8, 8, 16)
            policy = UpdatePolicy.from_dict(policy_of_plan(g, plan).to_dict())
            assert resolve_params(g, policy) == plan.params


def test_selection_training_a_norm_weight_without_its_bias_has_a_rule_form():
    """The selection treats a norm's weight and bias as separate units: under a budget too small
    for both it trains the more important one alone, and the plan still has a policy."""
    g = _norm_graph()
    importance = {"bn.weight": 1.0, "bn.bias": 0.5}
    cost = CostModel(session_overhead_bytes=64, grad_op_bytes=16)
    sizes = dict(n_windows=16, batch_windows=8, cost=cost, importance=importance)
    low = minimum_budget(g, **sizes) - 1
    budget = 2 * low
    while not plan_for_budget(g, budget, **sizes).param("bn.weight").trains:
        low, budget = budget, 2 * budget
    while budget - low > 1:  # the smallest budget that trains the weight: no room for the bias too
        mid = (low + budget) // 2
        low, budget = (low, mid) if plan_for_budget(g, mid, **sizes).param("bn.weight").trains else (mid, budget)
    plan = plan_for_budget(g, budget, **sizes)
    assert plan.param("bn.weight").trains and not plan.param("bn.bias").trains
    policy = policy_of_plan(g, plan)
    assert Rule("bn", "full", params=("weight",)) in policy.rules
    assert resolve_params(g, policy) == plan.params
