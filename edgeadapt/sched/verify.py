"""``verify``: re-derive a plan's peak by simulating the ``adapt`` call, and refuse it over budget.

The simulation is independent of :func:`edgeadapt.sched.cost.predict`'s closed form: it walks
an explicit event timeline -- buffers allocated and freed op by op, forward then backward --
and records the live total after every event. The two follow the same cost model, so they must
agree to the byte; a test checks that on many random plans.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .cost import CostModel, clean_cut
from .errors import BudgetExceeded
from .ir import Graph
from .plan import Mode, Peak, Plan

__all__ = ["verify", "timeline", "TimelineEvent", "check_plan"]


@dataclass(frozen=True)
class TimelineEvent:
    """The live total after one step of the simulated call.

    Attributes:
        phase: one of :data:`edgeadapt.sched.cost.PHASES`.
        where: ``"<phase>:<op>"`` or ``"<phase>"``.
        total_bytes: everything alive at that point.
    """

    phase: str
    where: str
    total_bytes: int


def check_plan(graph: Graph, plan: Plan) -> None:
    """Structural checks of ``plan`` against ``graph``.

    Raises:
        ValueError: names, channels, cut or feature caching inconsistent with the graph.
    """
    if plan.graph != graph.name:
        raise ValueError(f"the plan was made for graph {plan.graph!r}, not {graph.name!r}")
    planned = [p.name for p in plan.params]
    if planned != [p.name for p in graph.params]:
        missing = sorted({p.name for p in graph.params} - set(planned))
        extra = sorted(set(planned) - {p.name for p in graph.params})
        raise ValueError(f"the plan's parameters do not match graph {graph.name!r} (missing {missing[:5]}, "
                         f"unknown {extra[:5]}, or a different order); re-plan for this graph")
    if not any(p.trains for p in plan.params):
        raise ValueError("the plan trains nothing")
    for pp in plan.params:
        param = graph.param(pp.name)
        if pp.mode is Mode.CHANNELS and pp.channels[-1] >= param.out_channels:
            raise ValueError(f"parameter {pp.name}: channel {pp.channels[-1]} out of range ({param.out_channels})")
        if pp.trains and graph.owner_index(pp.name) <= plan.cut:
            raise ValueError(f"parameter {pp.name} trains but its op is inside the frozen prefix (cut {plan.cut})")
    if plan.cut >= len(graph.ops):
        raise ValueError(f"cut {plan.cut} is past the last op ({len(graph.ops) - 1})")
    if plan.cache_features and plan.cut >= 0 and not clean_cut(graph, plan.cut):
        raise ValueError(f"features cannot be cached at op {plan.cut} ({graph.ops[plan.cut].name}): a later op "
                         "reads a tensor from before it; cut at a block boundary or do not cache")
    names = {op.name for op in graph.ops}
    unknown = [n for n, _ in plan.activations if n not in names]
    if unknown:
        raise ValueError(f"the plan's activation actions name unknown ops {unknown[:5]}")


def _trained_bytes(graph: Graph, plan: Plan) -> int:
    total = 0
    for pp in plan.params:
        p = graph.param(pp.name)
        if pp.mode is Mode.CHANNELS:
            total += p.numel // p.out_channels * len(pp.channels) * p.dtype_bytes
        elif pp.trains:
            total += p.param_bytes
    return total


class _Sim:
    """Named buffers: persistent ones in bytes, activations in bytes per window."""

    def __init__(self, cost: CostModel, micro: int):
        self.cost, self.micro = cost, micro
        self.fixed: dict[str, int] = {}
        self.act: dict[str, int] = {}
        self.events: list[TimelineEvent] = []

    def record(self, phase: str, where: str) -> None:
        acts = sum(self.act.values())
        total = sum(self.fixed.values()) + (self.cost.activation_bytes(self.micro, acts, inference=phase == "features")
                                            if self.act else 0)
        self.events.append(TimelineEvent(phase, where, total))


def timeline(graph: Graph, plan: Plan, cost: CostModel | None = None) -> list[TimelineEvent]:
    """The simulated memory timeline of one ``adapt`` call (one epoch's first step).

    Raises:
        ValueError: the plan does not fit the graph (see :func:`check_plan`).
    """
    cost = cost or CostModel.default()
    check_plan(graph, plan)
    ops, n = graph.ops, len(graph.ops)
    index = {op.name: i for i, op in enumerate(ops)}
    trained_names = {p.name for p in plan.params if p.trains}
    caching = plan.cache_features and plan.cut >= 0
    start = plan.cut + 1 if caching else 0
    trained = _trained_bytes(graph, plan)
    sim = _Sim(cost, plan.micro_batch_windows)
    grad = [False] * n
    for i, op in enumerate(ops):
        if i >= start:
            grad[i] = bool(set(op.params) & trained_names) or any(grad[index[s]] for s in op.inputs)

    # Last reader of every tensor ("input" is the model input); unread outputs live to the loss.
    last_read: dict[str, int] = {op.name: n - 1 for op in ops}
    readers: dict[str, list[int]] = {}
    for i, op in enumerate(ops):
        for t in (op.inputs or ("<input>",)):
            readers.setdefault(t, []).append(i)
    for t, rs in readers.items():
        last_read[t] = max(rs)

    def run_forward(first: int, last: int, phase: str, on_done=None) -> None:
        if first == 0 and "<input>" in readers:
            sim.act["t:<input>"] = graph.input_bytes
        for j in range(first, last + 1):
            op = ops[j]
            sim.act[f"t:{op.name}"] = op.output_bytes
            sim.act["workspace"] = op.workspace_bytes + op.kernel_bytes
            sim.record(phase, f"{phase}:{op.name}")
            del sim.act["workspace"]
            for t in (op.inputs or ("<input>",)):
                if last_read[t] == j:
                    sim.act.pop(f"t:{t}", None)
            if on_done is not None:
                on_done(j)


    sim.fixed["session"] = cost.session_bytes(trained, plan.optimizer)
    sim.fixed["grad_op_buffers"] = cost.grad_op_bytes * grad.count(True)
    sim.fixed["graph_op_buffers"] = cost.graph_op_bytes * (n - start)  # every op of the training graph
    sim.fixed["batch_norm_buffers"] = cost.batch_norm_bytes(graph, start, plan.micro_batch_windows, grad)
    sim.fixed["recurrent_layers"] = cost.recurrent_bytes(graph)
    # Channel-split weights: the graph rebuilds each whole weight and its whole gradient.
    whole = sum(graph.param(pp.name).param_bytes for pp in plan.params if pp.mode is Mode.CHANNELS)
    sim.fixed["channel_weight_copies"] = math.ceil(cost.channel_weight_factor * whole)
    sim.record("session", "session")
    if caching:
        sim.fixed["prefix_session"] = cost.prefix_session_overhead_bytes
        sim.fixed["feature_cache"] = plan.n_windows * ops[plan.cut].output_bytes
        run_forward(0, plan.cut, "features")
        sim.act.clear()
        del sim.fixed["prefix_session"]
    sim.fixed["rollback"] = cost.rollback_bytes(trained, plan.optimizer)
    sim.record("rollback", "rollback")

    cands = [i for i in range(n) if grad[i] and ops[i].saved_bytes > 0]
    recompute = set(plan.recomputed)
    owner = {}  # op index -> candidate whose chunk holds it (None: tail)
    k = 0
    for i in range(n):
        while k < len(cands) and cands[k] < i:
            k += 1
        owner[i] = cands[k] if k < len(cands) else None
    if caching:  # the cached features of one micro-batch feed the suffix
        sim.act[f"t:{ops[plan.cut].name}"] = ops[plan.cut].output_bytes

    def keep_saved(j: int) -> None:
        if j in cands and ops[j].name not in recompute:
            sim.act[f"saved:{ops[j].name}"] = ops[j].saved_bytes

    # Parameter copies (fixed bytes): a trained op's live through the step; the largest of a
    # frozen op's in the forward and of a trained op's gradient buffers in the backward are
    # counted at every op (the closed form's conservative reading).
    own = [i >= start and bool(set(op.params) & trained_names) for i, op in enumerate(ops)]
    kept_copies = sum(op.param_copy_bytes for i, op in enumerate(ops) if own[i])
    sim.fixed["param_copies"] = kept_copies + max(
        [op.param_copy_bytes for i, op in enumerate(ops) if i >= start and not own[i]], default=0)
    run_forward(start, n - 1, "forward", keep_saved)
    sim.fixed["param_copies"] = kept_copies + max(
        [op.param_grad_bytes for i, op in enumerate(ops) if own[i]], default=0)
    for key in [k for k in sim.act if k.startswith("t:")]:
        del sim.act[key]

    chunk_start = {c: (cands[p - 1] + 1 if p else start) for p, c in enumerate(cands)}
    for j in range(n - 1, start - 1, -1):
        c = owner[j]
        if c == j and ops[j].name in recompute and f"saved:{ops[j].name}" not in sim.act:
            # Entering the last chunk of a recomputed run: the whole run is rebuilt at once.
            p = cands.index(j)
            while p >= 0 and ops[cands[p]].name in recompute:
                sim.act[f"saved:{ops[cands[p]].name}"] = ops[cands[p]].saved_bytes
                p -= 1
        if grad[j]:
            op = ops[j]
            in_grads = sum(ops[index[s]].output_bytes for s in op.inputs if grad[index[s]])
            sim.act["grad"] = op.output_bytes + in_grads + op.workspace_bytes
            sim.record("backward", f"backward:{op.name}")
            del sim.act["grad"]
        if c is not None and chunk_start[c] == j:
            sim.act.pop(f"saved:{ops[c].name}", None)
    sim.act.clear()
    del sim.fixed["param_copies"]
    sim.fixed["optimizer"] = cost.optimizer_bytes(trained)
    sim.record("optimizer", "optimizer")
    return sim.events


def verify(graph: Graph, plan: Plan, budget_bytes: int | None = None, *, cost: CostModel | None = None) -> Peak:
    """Re-derive the peak of ``plan`` by simulation; refuse it if it exceeds ``budget_bytes``.

    Args:
        graph: the model's IR.
        plan: the plan to check.
        budget_bytes: the budget (default: the plan's own ``budget_bytes``; ``None`` checks nothing).
        cost: the cost-model constants (default: :meth:`CostModel.default`).

    Returns:
        The simulated peak with the per-phase maxima.

    Raises:
        BudgetExceeded: the peak exceeds the budget (need, have and where in the message).
        ValueError: the plan does not fit the graph.
    """
    events = timeline(graph, plan, cost)
    peak = max(events, key=lambda e: e.total_bytes)  # the first maximum in timeline order
    phases: dict[str, int] = {}
    for e in events:
        phases[e.phase] = max(phases.get(e.phase, 0), e.total_bytes)
    result = Peak(peak.total_bytes, peak.where, phases)
    budget = plan.budget_bytes if budget_bytes is None else budget_bytes
    if budget is not None and result.peak_bytes > budget:
        raise BudgetExceeded(result.peak_bytes, budget, result.where)
    return result
