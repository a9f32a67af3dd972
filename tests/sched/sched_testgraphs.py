"""Small random graphs and plans for the planner's tests."""

from __future__ import annotations

import random

from edgeadapt.sched.cost import clean_cut
from edgeadapt.sched.ir import Graph, Op, Param
from edgeadapt.sched.plan import ParamPlan, Plan
from edgeadapt.sched.resolve import cut_of


def random_graph(rng: random.Random, n_ops: int, skip_p: float = 0.2, name: str = "g") -> Graph:
    """A chain of ``n_ops`` ops with occasional skip connections; ~60% own a weight and a bias."""
    ops, params = [], []
    for i in range(n_ops):
        inputs = () if i == 0 else (f"op{i - 1}",)
        if i > 2 and rng.random() < skip_p:
            inputs = inputs + (f"op{rng.randrange(0, i - 1)}",)
        owned = ()
        if rng.random() < 0.6 or i == n_ops - 1:
            owned = (f"m{i}.weight", f"m{i}.bias")
            c = rng.randint(1, 8)
            params += [Param(owned[0], (c, rng.randint(1, 5)), module=f"m{i}", module_type="Linear"),
                       Param(owned[1], (c,), module=f"m{i}", module_type="Linear")]
        ops.append(Op(f"op{i}", "X", owned, inputs, rng.randint(1, 100), rng.choice([0, rng.randint(1, 100)]),
                      rng.choice([0, rng.randint(0, 30)]), rng.randint(1, 1000), f"m{i}"))
    return Graph(tuple(ops), tuple(params), rng.randint(1, 100), name)


def random_plan(rng: random.Random, g: Graph) -> Plan:
    """A random valid plan for ``g``: modes, micro-batch, caching and recompute actions."""
    pps = []
    for p in g.params:
        r = rng.random()
        if r < 0.3:
            pps.append(ParamPlan(p.name, "full"))
        elif r < 0.4 and p.shape[0] > 1:
            pps.append(ParamPlan(p.name, "channels", (0,)))
        else:
            pps.append(ParamPlan(p.name, "frozen"))
    if not any(pp.trains for pp in pps):
        pps[-1] = ParamPlan(pps[-1].name, "full")
    cut = cut_of(g, tuple(pps))
    cache = rng.random() < 0.5 and clean_cut(g, cut)
    acts = tuple((o.name, rng.choice(["keep", "recompute"])) for o in g.ops)
    b = rng.randint(1, 8)
    return Plan(g.name, tuple(pps), cut, b, rng.randint(1, b), rng.randint(1, 50), cache, acts,
                optimizer=rng.choice(["adamw", "sgd"]))


def conv_graph(rng: random.Random, n_blocks: int, name: str = "convnet") -> Graph:
    """A 1-D CNN like the reference one: ``n_blocks`` x (Conv of 32/64/128 channels, a norm with
    weight and bias, ReLU), a mean over time and a 7-class head; windows of 8 x 256 float32."""
    ops, params = [], []
    c_in, prev, length = 8, None, 256
    for b in range(n_blocks):
        c, k = rng.choice([32, 64, 128]), rng.choice([1, 3, 5, 7])
        w = f"b{b}.conv.weight"
        params.append(Param(w, (c, c_in, k), module=f"b{b}.conv", module_type="Conv1d"))
        ops.append(Op(f"b{b}.conv", "Conv", (w,), () if prev is None else (prev,), c * length * 4, c_in * length * 4,
                      0, 2 * c * c_in * k * length, f"b{b}.conv"))
        params += [Param(f"b{b}.bn.weight", (c,), module=f"b{b}.bn", module_type="BatchNorm1d"),
                   Param(f"b{b}.bn.bias", (c,), module=f"b{b}.bn", module_type="BatchNorm1d")]
        ops.append(Op(f"b{b}.bn", "Mul", (f"b{b}.bn.weight", f"b{b}.bn.bias"), (f"b{b}.conv",), c * length * 4,
                      c * length * 4, 0, 2 * c * length, f"b{b}.bn"))
        ops.append(Op(f"b{b}.act", "Relu", (), (f"b{b}.bn",), c * length * 4, rng.choice([0, c * length * 4]), 0,
                      c * length, f"b{b}.act"))
        prev, c_in = f"b{b}.act", c
        if rng.random() < 0.5:
            length //= 2
    ops.append(Op("pool", "ReduceMean", (), (prev,), c_in * 4, 0, 0, c_in * length, "pool"))
    params += [Param("head.weight", (7, c_in), module="head", module_type="Linear"),
               Param("head.bias", (7,), module="head", module_type="Linear")]
    ops.append(Op("head", "Gemm", ("head.weight", "head.bias"), ("pool",), 28, c_in * 4, 0, 14 * c_in, "head"))
    return Graph(tuple(ops), tuple(params), 8 * 256 * 4, name)
