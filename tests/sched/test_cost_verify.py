"""predict (closed form) vs verify (event simulation); verify's refusals; the cost constants."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest
from sched_testgraphs import random_graph, random_plan

from edgeadapt.sched import BudgetExceeded, CostModel, Graph, Op, Param, ParamPlan, Plan, predict, verify
from edgeadapt.sched.cost import PHASES
from edgeadapt.sched.plan import Mode

COST = CostModel(session_overhead_bytes=100, prefix_session_overhead_bytes=7, per_window_bytes=3, grad_op_bytes=11,
                 graph_op_bytes=5, channel_weight_factor=2.3, activation_factor=1.3, inference_activation_factor=0.7,
                 rollback_state_factor=1.0,
                 optimizer_workspace_factor=0.5)


@pytest.mark.parametrize("cost", [CostModel(), COST], ids=["plain", "overheads"])
def test_predict_and_verify_agree_on_random_plans(cost):
    rng = random.Random(0)
    for _ in range(400):
        g = random_graph(rng, rng.randint(1, 12))
        plan = random_plan(rng, g)
        assert verify(g, plan, cost=cost) == predict(g, plan, cost), plan


def test_predict_and_verify_agree_with_parameter_copies():
    """Ops reading copies of their parameters (fixed bytes, and gradient buffers when they train):
    the closed form and the simulation count them alike, and they only add to the peak."""
    rng, sizes = random.Random(1), random.Random(2)
    for _ in range(300):
        g = random_graph(rng, rng.randint(1, 12))
        plan = random_plan(rng, g)
        with_copies = replace(g, ops=tuple(
            replace(o, param_copy_bytes=sizes.choice([0, sizes.randint(1, 500)]),
                    param_grad_bytes=sizes.choice([0, sizes.randint(1, 1500)])) for o in g.ops))
        peak = predict(with_copies, plan, COST)
        assert verify(with_copies, plan, cost=COST) == peak, plan
        assert peak.peak_bytes >= predict(g, plan, COST).peak_bytes


def test_recurrent_layers_add_their_fixed_cost_to_every_phase():
    """``CostModel.recurrent_layer_bytes`` per recurrent layer of the graph (``Op.recurrent_layers``),
    held for the whole call: predict and verify agree, and every phase grows by exactly that."""
    rng, sizes = random.Random(3), random.Random(4)
    cost = replace(COST, recurrent_layer_bytes=70)
    for _ in range(200):
        g = random_graph(rng, rng.randint(1, 12))
        plan = random_plan(rng, g)
        recurrent = replace(g, ops=tuple(replace(o, recurrent_layers=sizes.choice([0, 0, 1, 2])) for o in g.ops))
        layers = sum(o.recurrent_layers for o in recurrent.ops)
        peak = predict(recurrent, plan, cost)
        assert verify(recurrent, plan, cost=cost) == peak, plan
        without = predict(g, plan, cost)
        assert peak.peak_bytes == without.peak_bytes + 70 * layers
        assert {k: v - 70 * layers for k, v in peak.phases_bytes.items()} == without.phases_bytes
        assert predict(recurrent, plan, COST) == predict(g, plan, COST)  # no constant, no cost


def test_a_trained_ops_parameter_copies_are_kept_through_the_backward():
    """b reads a 40-byte copy of its weight (gradient buffers 90 bytes): trained, the copy is held
    in the forward and the backward, which also holds the buffers; frozen, the forward holds the
    copy while b runs and the backward nothing of it."""
    g = _chain()
    g = replace(g, ops=(g.ops[0], replace(g.ops[1], param_copy_bytes=40, param_grad_bytes=90), g.ops[2]))
    base = _chain()
    for b_mode, fwd_extra, bwd_extra in (("full", 40, 130), ("frozen", 40, 0)):
        plan = Plan("chain", (ParamPlan("b.w", b_mode), ParamPlan("c.h", "full")), cut=0 if b_mode == "full" else 1,
                    batch_windows=4, micro_batch_windows=2, n_windows=8)
        with_copy, without = predict(g, plan, CostModel()), predict(base, plan, CostModel())
        assert with_copy.phases_bytes["forward"] - without.phases_bytes["forward"] == fwd_extra
        assert with_copy.phases_bytes["backward"] - without.phases_bytes["backward"] == bwd_extra
        assert with_copy.phases_bytes["optimizer"] == without.phases_bytes["optimizer"]


def _chain() -> Graph:
    """input(10) -> a(out 20, saves 10) -> b(out 30, saves 20, owns w[2x3]) -> c(out 5, saves 30, owns h[5])."""
    ops = (Op("a", "Conv", (), (), 20, 10), Op("b", "Conv", ("b.w",), ("a",), 30, 20),
           Op("c", "Gemm", ("c.h",), ("b",), 5, 30))
    return Graph(ops, (Param("b.w", (2, 3), module="b"), Param("c.h", (5,), module="c")), 10, "chain")


def test_hand_computed_peak():
    g = _chain()
    plan = Plan("chain", (ParamPlan("b.w", "full"), ParamPlan("c.h", "frozen")), cut=0, batch_windows=4,
                micro_batch_windows=2, n_windows=8, optimizer="adamw")
    peak = predict(g, plan, CostModel())
    trained = 24
    held = trained * 3 + trained  # gradient + 2 AdamW moments; rollback copy of the values
    # Forward at c: kept saved of b (20) + c's input (30) + c's output (5), x2 windows.
    # Backward at c: kept b (20) + c's saved (30) + c's output grad (5) + b's output grad (30) = 85.
    assert peak.phases_bytes["backward"] == held + 2 * 85
    assert peak.peak_bytes == held + 170 and peak.where == "backward:c"
    assert set(peak.phases_bytes) <= set(PHASES)


def test_feature_cache_and_recompute_change_the_peak():
    g = _chain()
    params = (ParamPlan("b.w", "frozen"), ParamPlan("c.h", "full"))
    plain = Plan("chain", params, cut=1, batch_windows=4, micro_batch_windows=4, n_windows=8)
    cached = Plan("chain", params, cut=1, batch_windows=4, micro_batch_windows=4, n_windows=8, cache_features=True)
    p, c = predict(g, plain, CostModel()), predict(g, cached, CostModel())
    assert "features" not in p.phases_bytes
    assert c.phases_bytes["features"] >= 8 * 30  # the cache of 8 windows x b's output
    assert verify(g, cached, cost=CostModel()) == c


def test_verify_refuses_over_budget_with_the_numbers():
    g = _chain()
    plan = Plan("chain", (ParamPlan("b.w", "full"), ParamPlan("c.h", "full")), cut=0, batch_windows=4,
                micro_batch_windows=4)
    need = verify(g, plan, cost=CostModel()).peak_bytes
    assert verify(g, plan, need, cost=CostModel()).peak_bytes == need
    with pytest.raises(BudgetExceeded) as info:
        verify(g, plan, need - 1, cost=CostModel())
    e = info.value
    assert (e.need_bytes, e.have_bytes) == (need, need - 1) and e.where.startswith("backward:")
    assert str(need) in str(e) and str(need - 1) in str(e)
    assert isinstance(e, ValueError)


@pytest.mark.parametrize("bad,match", [
    (dict(cut=1), "inside the frozen prefix"),
    (dict(graph="other"), "made for graph 'other'"),
    (dict(activations=(("nope", "recompute"),)), "unknown ops"),
])
def test_verify_rejects_inconsistent_plans(bad, match):
    g = _chain()
    kwargs = dict(graph="chain", params=(ParamPlan("b.w", "full"), ParamPlan("c.h", "full")), cut=-1)
    kwargs.update(bad)
    with pytest.raises(ValueError, match=match):
        verify(g, Plan(**kwargs), cost=CostModel())


def test_graph_op_and_channel_weight_terms():
    """Every op of the training graph costs graph_op_bytes; a channel-split weight costs
    channel_weight_factor x its whole bytes (not only the trained slice); both held from the session."""
    g = _chain()
    params = (ParamPlan("b.w", Mode.CHANNELS, channels=(0,)), ParamPlan("c.h", Mode.FROZEN))
    plan = Plan(graph="chain", params=params, batch_windows=2, micro_batch_windows=1, n_windows=2)
    base = predict(g, plan, CostModel())
    cost = CostModel(graph_op_bytes=7, channel_weight_factor=1.5)
    peak = predict(g, plan, cost)
    extra = 7 * 3 + math.ceil(1.5 * 2 * 3 * 4)  # 3 ops in the graph; whole b.w = 24 bytes
    assert peak.peak_bytes == base.peak_bytes + extra
    assert all(peak.phases_bytes[k] == base.phases_bytes[k] + extra for k in base.phases_bytes)
    assert verify(g, plan, cost=cost) == peak
    full = Plan(graph="chain", params=(ParamPlan("b.w", Mode.FULL), ParamPlan("c.h", Mode.FROZEN)),
                batch_windows=2, micro_batch_windows=1, n_windows=2)
    assert predict(g, full, cost).phases_bytes["session"] == predict(g, full, CostModel()).phases_bytes["session"] + 21
    # Old constants files (without the new keys) still load, the new terms off.
    d = CostModel.default().to_dict()
    d.pop("graph_op_bytes"), d.pop("channel_weight_factor")
    old = CostModel.from_dict(d)
    assert old.graph_op_bytes == 0 and old.channel_weight_factor == 0.0


def test_cost_model_constants_ship_with_the_package():
    cost = CostModel.default()
    assert cost.calibration, "the packaged constants must say where they come from"
    assert CostModel.from_dict(cost.to_dict()) == cost
    with pytest.raises(ValueError, match="unknown constants"):
        CostModel.from_dict({"nonsense": 1})


def test_clean_cut():
    from edgeadapt.sched.cost import clean_cut

    ops = (Op("a", "X", (), (), 4), Op("b", "X", (), ("a",), 4), Op("c", "X", (), ("b", "a"), 4),
           Op("d", "X", ("d.w",), ("c",), 4))
    g = Graph(ops, (Param("d.w", (1,), module="d"),), 4, "skip")
    assert [clean_cut(g, c) for c in (-1, 0, 1, 2)] == [True, True, False, True]


def _with_batch_norms(rng: random.Random, g: Graph) -> Graph:
    """``g`` with about a third of its ops BatchNorms normalising with batch statistics."""
    import dataclasses

    ops = tuple(dataclasses.replace(op, kind="BatchNormalization") if rng.random() < 0.3 else op for op in g.ops)
    return Graph(ops, g.params, g.input_bytes, g.name)


def test_batch_statistics_terms_agree_and_forbid_cuts():
    from edgeadapt.sched.cost import BATCH_NORM_KIND, activation_arrays, clean_cut

    cost = CostModel(**{**COST.to_dict(), "batch_norm_op_bytes": 17, "batch_norm_activation_factor": 0.6,
                        "calibration": {}})
    rng = random.Random(1)
    for _ in range(300):
        g = _with_batch_norms(rng, random_graph(rng, rng.randint(1, 12)))
        plan = random_plan(rng, g)
        assert verify(g, plan, cost=cost) == predict(g, plan, cost), plan
        start = plan.cut + 1 if plan.cache_features and plan.cut >= 0 else 0
        grad = activation_arrays(g, {p.name for p in plan.params if p.trains}, start).grad
        bn = [i for i in range(start, len(g.ops)) if g.ops[i].kind == BATCH_NORM_KIND]
        through = sum(g.ops[i].output_bytes for i in bn if grad[i])  # the backward keeps what it normalised
        extra = 17 * len(bn) + math.ceil(0.6 * plan.micro_batch_windows * through)
        assert (predict(g, plan, cost).phases_bytes["session"]
                == predict(g, plan, COST).phases_bytes["session"] + extra)
        first = next((i for i, op in enumerate(g.ops) if op.kind == BATCH_NORM_KIND), len(g.ops))
        assert not any(clean_cut(g, c) for c in range(first, len(g.ops)))  # an inference prefix has no batch statistics
