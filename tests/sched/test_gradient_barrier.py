"""Ops without a gradient (``Op.differentiable=False``): what the planner may not train."""

from __future__ import annotations

import random

import pytest
from sched_testgraphs import random_graph

from edgeadapt.sched import CostModel, Graph, Op, Param, minimum_budget, plan_for_budget
from edgeadapt.sched.select import candidate_units

COST = CostModel(session_overhead_bytes=64, per_window_bytes=4, grad_op_bytes=16)


def _graph(barrier: bool) -> Graph:
    ops = (Op("conv", "Conv", ("conv.weight",), (), 40, 20),
           Op("cumsum", "CumSum", (), ("conv",), 40, 0, differentiable=not barrier),
           Op("side", "Linear", ("side.weight",), ("conv",), 40, 20),  # skips the barrier, but reads conv
           Op("head", "Gemm", ("head.weight", "head.bias"), ("cumsum", "side"), 8, 40))
    params = (Param("conv.weight", (4, 2), module="conv"), Param("side.weight", (4, 4), module="side"),
              Param("head.weight", (2, 4), module="head"), Param("head.bias", (2,), module="head"))
    return Graph(ops, params, 16, "barrier")


def test_blocked_parameters_and_serialisation():
    g = _graph(True)
    assert g.gradient_blocked() == {"conv.weight"}  # side.weight's gradient does not pass the CumSum
    assert {u.param for u in candidate_units(g)} == {"side.weight", "head.weight", "head.bias"}
    d = g.to_dict()
    assert [o.get("differentiable", True) for o in d["ops"]] == [True, False, True, True]
    assert Graph.from_dict(d) == g
    plain = _graph(False).to_dict()  # without barriers: exactly the old form (old manifests load)
    assert all("differentiable" not in o for o in plain["ops"])
    assert Graph.from_dict(plain).gradient_blocked() == frozenset()
    with pytest.raises(ValueError, match="differentiable"):
        Op("x", "X", differentiable=1)


@pytest.mark.parametrize("seed", range(5))
def test_plans_never_train_through_a_barrier(seed):
    rng = random.Random(seed)
    g = random_graph(rng, rng.randint(5, 9))
    k = rng.randrange(1, len(g.ops) - 1)
    ops = tuple(Op(o.name, o.kind, o.params, o.inputs, o.output_bytes, o.saved_bytes, o.workspace_bytes, o.flops,
                   o.module, differentiable=(i != k)) for i, o in enumerate(g.ops))
    g = Graph(ops, g.params, g.input_bytes, g.name)
    blocked = g.gradient_blocked()
    assert {p for p in g.ops[k].params} <= blocked
    if len(blocked) == len(g.params):
        with pytest.raises(ValueError, match="no parameter to train"):
            minimum_budget(g, n_windows=8, batch_windows=4, cost=COST)
        return
    low = minimum_budget(g, n_windows=8, batch_windows=4, cost=COST)
    for budget in (low, low * 4, low * 100):
        plan = plan_for_budget(g, budget, n_windows=8, batch_windows=4, cost=COST)
        assert plan.trained and not {p.name for p in plan.trained} & blocked
