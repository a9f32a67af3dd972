"""Server offload planning: which tier holds each block, what is prefetched, what is recomputed.

The streaming trainer (``edgeadapt.server``) keeps the master copy of every parameter, its
AdamW state and, between steps, nothing else outside the compute device's *budget*: a block's
weights come into the compute tier just before it runs, its gradient leaves as soon as it is
produced, and the optimizer updates the block on the CPU. :func:`plan_offload` decides, for a
block graph (one :class:`~edgeadapt.sched.ir.Op` per block) and a budget:

* the tier of every parameter (``host`` or ``disk``; all of a model's state lives there);
* the execution and prefetch order (``Plan.order``) and how many blocks are brought in ahead
  of use (``Plan.prefetch_depth``);
* per block, whether its saved activations are kept from forward to backward or recomputed
  from the block's input (``Plan.activations``);
* the predicted peak of the compute tier and where it occurs.

The cost model (what the executor reserves, per step of ``b`` windows):

* always: ``resident_bytes`` (buffers, e.g. BatchNorm statistics) and the input batch;
* forward of block ``k``: activations kept by blocks before ``k``, block ``k``'s weights, the
  weights of the next ``prefetch_depth`` blocks, and block ``k``'s saved tensors and output;
* backward of block ``k``: activations of blocks up to ``k``, the recomputed saved tensors of
  ``k`` (when recomputed), the gradient flowing in and out, block ``k``'s weights and
  gradients, the prefetched weights, and the gradients of the block before (in backward
  order), whose optimizer update runs while ``k`` computes, with that update's staged master
  weights and optimizer state when it stages them in the compute tier's own memory (a CPU run
  from the disk tier).

A kept block holds ``saved + output`` bytes per window until its backward; a recomputed
block keeps only its output (the next block's input) and rebuilds the rest in backward.

A *resident* op (kind :data:`RESIDENT_KIND`: the parameters outside every streamed block,
e.g. a positional embedding on the model's root module) is not streamed: its weights come in
before the forward and its gradients exist until the end of the backward, so both are held
for the whole step on top of everything above; its update runs after the backward (the phase
``update``), holding its weights, gradients and staged state. It is neither prefetched nor
recomputed and appears in neither ``Plan.order`` nor ``Plan.activations``.

Pure Python (no torch): the planner never touches tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import BudgetExceeded
from .ir import Graph
from .plan import Action, Mode, ParamPlan, Peak, Plan, Tier, format_bytes

__all__ = ["BudgetExceeded", "BlockTooLarge", "BlockCost", "block_costs", "plan_offload", "offload_peak",
           "OPTIMIZER_STATE_COPIES", "RESIDENT_KIND"]

RESIDENT_KIND = "resident"
"""Op kind of a block that is held in the compute tier for the whole step (not streamed)."""

OPTIMIZER_STATE_COPIES = {"adamw": 2, "sgd": 0}
"""Optimizer-state tensors per parameter tensor (AdamW: first and second moment)."""


class BlockTooLarge(BudgetExceeded):
    """One block's weights, gradients and staged optimizer state alone exceed the budget.

    Attributes:
        block: the block's name (and ``need_bytes``/``have_bytes``/``where`` as
            :class:`~edgeadapt.sched.errors.BudgetExceeded`).
    """

    def __init__(self, need_bytes: int, have_bytes: int, block: str, detail: str = ""):
        self.block = block
        self.detail = detail
        super().__init__(need_bytes, have_bytes, f"block {block!r}", "compute", detail)

    def __reduce__(self):
        return (type(self), (self.need_bytes, self.have_bytes, self.block, self.detail))


@dataclass(frozen=True)
class BlockCost:
    """Bytes one block needs in the compute tier for a step of ``b`` windows.

    Attributes:
        name: the block (op) name.
        weight_bytes: its parameters.
        grad_bytes: its gradients (same as ``weight_bytes``).
        staging_bytes: master weights + optimizer state staged for the update in the compute
            tier's memory, plus one temporary of the same size (0 when the update runs elsewhere).
        saved_bytes: what its backward keeps (``b`` windows).
        output_bytes: its output (``b`` windows).
        input_bytes: its input (``b`` windows): the previous block's output or the batch.
        resident: held for the whole step (an op of kind :data:`RESIDENT_KIND`; no activation
            bytes, and the chain of inputs and outputs skips it).
    """

    name: str
    weight_bytes: int
    grad_bytes: int
    staging_bytes: int
    saved_bytes: int
    output_bytes: int
    input_bytes: int
    resident: bool = False

    @property
    def update_bytes(self) -> int:
        """What the block alone holds while its gradient exists: weights, gradients, staging."""
        return self.weight_bytes + self.grad_bytes + self.staging_bytes


def block_costs(graph: Graph, batch_windows: int, *, optimizer: str = "adamw",
                staging: bool = False, staging_chunk_bytes: int | None = None) -> list[BlockCost]:
    """Per-block byte counts in execution order.

    Args:
        graph: one op per block (``edgeadapt.server.trace.trace_graph``).
        batch_windows: windows per step.
        optimizer: ``"adamw"`` or ``"sgd"`` (optimizer-state copies per parameter).
        staging: the update stages master weights and optimizer state in the compute tier's
            memory (True for a CPU run whose state lives on disk).
        staging_chunk_bytes: the update stages at most this many bytes of each vector at a
            time (``None``: a whole block at once).
    """
    if optimizer not in OPTIMIZER_STATE_COPIES:
        raise ValueError(f"optimizer must be one of {sorted(OPTIMIZER_STATE_COPIES)}, got {optimizer!r}")
    out: list[BlockCost] = []
    prev_out = graph.input_bytes
    for op in graph.ops:
        w = sum(graph.param(p).param_bytes for p in op.params)
        per_vector = w if staging_chunk_bytes is None else min(w, staging_chunk_bytes)
        # master weights + optimizer state + one temporary of the vectorised update
        st = per_vector * (2 + OPTIMIZER_STATE_COPIES[optimizer]) if staging else 0
        if op.kind == RESIDENT_KIND:
            out.append(BlockCost(op.name, w, w, st, 0, 0, 0, resident=True))
            continue
        out.append(BlockCost(op.name, w, w, st, op.saved_bytes * batch_windows, op.output_bytes * batch_windows,
                             prev_out * batch_windows))
        prev_out = op.output_bytes
    return out


def offload_peak(costs: list[BlockCost], recompute: list[bool], prefetch_depth: int, *,
                 fixed_bytes: int) -> Peak:
    """The compute-tier peak of one step under the cost model in the module docstring.

    Args:
        costs: from :func:`block_costs`.
        recompute: per block (aligned with ``costs``), True when its activations are
            recomputed (ignored for resident blocks).
        prefetch_depth: blocks brought in ahead of use.
        fixed_bytes: held throughout (buffers and the input batch).
    """
    resident = [c for c in costs if c.resident]
    recompute = [r for c, r in zip(costs, recompute) if not c.resident]
    costs = [c for c in costs if not c.resident]
    # resident blocks: weights from before the forward, gradients until after the backward
    fixed_bytes += sum(c.weight_bytes + c.grad_bytes for c in resident)
    n = len(costs)
    act = [c.output_bytes + (0 if r else c.saved_bytes) for c, r in zip(costs, recompute)]
    best = (fixed_bytes, "start")
    phases = {"forward": 0, "backward": 0}
    held = 0
    for k, c in enumerate(costs):
        ahead = sum(x.weight_bytes for x in costs[k + 1:k + 1 + prefetch_depth])
        total = fixed_bytes + held + c.weight_bytes + ahead + c.saved_bytes + c.output_bytes
        phases["forward"] = max(phases["forward"], total)
        if total > best[0]:
            best = (total, f"forward:{c.name}")
        held += act[k]
    for k in range(n - 1, -1, -1):
        c = costs[k]
        ahead = sum(x.weight_bytes for x in costs[max(0, k - prefetch_depth):k])
        held_upto = sum(act[: k + 1])
        rebuilt = c.saved_bytes if recompute[k] else 0
        # the update of the block before (in backward order) may still hold its gradients and staging
        previous = costs[k + 1].grad_bytes + costs[k + 1].staging_bytes if k + 1 < n else 0
        total = (fixed_bytes + held_upto + rebuilt + c.output_bytes + c.input_bytes + c.weight_bytes
                 + c.grad_bytes + ahead + previous)
        phases["backward"] = max(phases["backward"], total)
        if total > best[0]:
            best = (total, f"backward:{c.name}")
    if resident:
        # after the backward: every streamed block is gone; the resident blocks' updates stage their state
        total = fixed_bytes + max(c.staging_bytes for c in resident)
        phases["update"] = total
        if total > best[0]:
            best = (total, f"update:{max(resident, key=lambda c: c.staging_bytes).name}")
    return Peak(best[0], best[1], phases)


def plan_offload(graph: Graph, budget_bytes: int, *, batch_windows: int = 1, tier: str = "host",
                 optimizer: str = "adamw", recompute: bool | str | None = None, prefetch_depth: int = 1,
                 resident_bytes: int = 0, staging: bool | None = None,
                 staging_chunk_bytes: int | None = None) -> Plan:
    """Plan a streaming training step of ``graph`` under ``budget_bytes`` of compute memory.

    Args:
        graph: a block graph (one op per block).
        budget_bytes: the compute tier's budget for everything the executor holds there.
        batch_windows: windows per step.
        tier: where master weights and optimizer state live: ``"host"`` or ``"disk"``.
        optimizer: ``"adamw"`` or ``"sgd"``.
        recompute: ``False``/``None``: keep every block's activations; ``True``: recompute
            every block; ``"auto"``: keep what fits, recomputing the blocks with the most saved
            bytes first.
        prefetch_depth: blocks to bring in ahead of use; lowered (to 0 at the least) when the
            requested depth does not fit.
        resident_bytes: bytes held in the compute tier for the whole step (module buffers).
        staging: the update stages master weights and optimizer state in compute memory;
            default: True exactly for the disk tier (a CPU run; pass False for a GPU run,
            whose update stages in host memory).
        staging_chunk_bytes: the staged update's chunk per vector (``None``: whole blocks).

    Returns:
        A :class:`Plan` with every parameter ``full`` on ``tier``, ``order`` = block order,
        ``activations`` per block, and the predicted peak.

    Raises:
        BlockTooLarge: one block's weights, gradients and staged state alone exceed the
            budget (the error names the block, its bytes and the budget).
        BudgetExceeded: no recompute/prefetch choice fits (the error names the peak's place).
        ValueError: an unknown tier, optimizer or recompute value.
    """
    if tier not in ("host", "disk"):
        raise ValueError(f"tier must be 'host' or 'disk', got {tier!r}")
    if recompute not in (None, False, True, "auto"):
        raise ValueError(f"recompute must be False, True or 'auto', got {recompute!r}")
    if prefetch_depth < 0 or batch_windows < 1 or budget_bytes <= 0:
        raise ValueError("prefetch_depth must be >= 0, batch_windows >= 1 and budget_bytes > 0")
    staging = (tier == "disk") if staging is None else staging
    costs = block_costs(graph, batch_windows, optimizer=optimizer, staging=staging,
                        staging_chunk_bytes=staging_chunk_bytes)
    fixed = resident_bytes + graph.input_bytes * batch_windows
    # the resident blocks' weights and gradients are held for the whole step
    held_res = sum(c.weight_bytes + c.grad_bytes for c in costs if c.resident)

    def alone(c: BlockCost) -> int:
        return fixed + (held_res + c.staging_bytes if c.resident else held_res + c.update_bytes)

    worst = max(costs, key=alone)
    if alone(worst) > budget_bytes:
        parts = f"weights {format_bytes(worst.weight_bytes)} + gradients {format_bytes(worst.grad_bytes)}"
        if worst.staging_bytes:
            parts += f" + staged master weights and {optimizer} state {format_bytes(worst.staging_bytes)}"
        others = held_res - (worst.weight_bytes + worst.grad_bytes if worst.resident else 0)
        if others:
            parts += f" + weights and gradients of the resident blocks, held all step {format_bytes(others)}"
        if fixed:
            parts += f" + always-resident buffers and input {format_bytes(fixed)}"
        need = alone(worst)
        what = "the parameters outside every block (held for the whole step)" if worst.resident else "the block"
        raise BlockTooLarge(
            need, budget_bytes, worst.name,
            f"block {worst.name!r} alone holds {parts}; raise the budget to at least {format_bytes(need)} plus room "
            f"for activations, or split {what} into smaller modules")

    n = len(costs)
    rec = [bool(recompute is True) and not c.resident for c in costs]
    depth = prefetch_depth

    def peak() -> Peak:
        return offload_peak(costs, rec, depth, fixed_bytes=fixed)

    p = peak()
    if recompute == "auto":
        for k in sorted(range(n), key=lambda i: -costs[i].saved_bytes):
            if p.peak_bytes <= budget_bytes:
                break
            if costs[k].saved_bytes == 0 or costs[k].resident:
                continue
            rec[k] = True
            q = peak()
            if q.peak_bytes < p.peak_bytes:
                p = q
            else:
                rec[k] = False
    while p.peak_bytes > budget_bytes and depth > 0:
        depth -= 1
        p = peak()
    if p.peak_bytes > budget_bytes:
        hint = ("" if recompute == "auto" or all(rec) else
                "; recompute='auto' (or True) trades compute for activation memory")
        raise BudgetExceeded(
            p.peak_bytes, budget_bytes, p.where,
            detail=f"one step of {batch_windows} windows (prefetch {depth}, {sum(rec)} of "
                   f"{sum(not c.resident for c in costs)} blocks recomputed) "
                   f"does not fit; lower the batch size or raise the budget{hint}")

    ptier = Tier(tier)
    return Plan(
        graph=graph.name,
        params=tuple(ParamPlan(p_.name, Mode.FULL, None, ptier) for p_ in graph.params),
        cut=-1, batch_windows=batch_windows, micro_batch_windows=batch_windows, n_windows=batch_windows,
        activations=tuple((c.name, Action.RECOMPUTE if r else Action.KEEP) for c, r in zip(costs, rec)
                          if not c.resident),
        order=tuple(op.name for op in graph.ops if op.kind != RESIDENT_KIND), prefetch_depth=depth,
        optimizer=optimizer,
        budget_bytes=budget_bytes, predicted=p,
    )
