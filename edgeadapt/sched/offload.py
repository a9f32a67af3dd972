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
* the elements per chunk of the staged optimizer update (``Plan.update_chunk_numel``);
* the windows per forward/backward (``Plan.micro_batch_windows``): a step of ``b`` windows may
  run as ``ceil(b / m)`` micro-batches whose gradients are accumulated per block;
* the predicted peak of the compute tier and where it occurs.

A CPU run from the host tier computes on the master weights where they are
(``weights_in_place``): its weights take no compute-tier bytes and are neither copied nor
prefetched.

**The search.** Every knob lowers the peak monotonically except the micro-batch size: more
recompute, a shallower prefetch and a smaller update chunk never raise it (each only removes
terms below), so for each micro-batch size the smallest peak is the one with every block
recomputed, prefetch 0 and the smallest chunk. The smallest budget any plan fits is the
minimum of that over the micro-batch sizes; below it the planner refuses with
:class:`~edgeadapt.sched.errors.NoFeasiblePlan` naming it. At or above it the planner returns
the first plan that fits in this preference order (fastest first):

1. the fewest micro-batches (each one reads every block's weights again, runs smaller kernels,
   and accumulating a gradient costs a pass over it; on the host tier, where no weights move,
   four micro-batches of one window measured as slow as recomputing 18 of 24 GPT blocks);
2. with an update staged in the compute tier (a CPU run from the disk tier), the update chunk,
   the prefetch depth and the recompute together, by the time they add
   (:func:`added_step_flops`): every staged chunk costs a fixed :data:`CHUNK_OVERHEAD_FLOPS`
   (an optimizer call and its reads and writes), a recomputed block its forward FLOPs, and a
   step without prefetch its weight reads (:data:`READ_FLOPS_PER_BYTE`); ties go to fewer
   recomputed bytes, a deeper prefetch, a larger chunk;
3. otherwise, the deepest prefetch up to the requested depth (prefetch hides the tier's reads),
   then the fewest recomputed saved bytes (recompute repeats a block's forward). In both cases,
   for given micro-batch, chunk and prefetch, blocks are kept greedily, the most saved bytes
   first, from an all-recompute plan while the plan fits.

The cost model (what the executor reserves, per micro-batch of ``b`` windows; the whole
step's input batch is held throughout):

* always: ``resident_bytes`` (buffers, e.g. BatchNorm statistics) and the input batch;
* forward of block ``k``: activations kept by blocks before ``k``, block ``k``'s weights, the
  weights of the next ``prefetch_depth`` blocks, and block ``k``'s saved tensors and output;
* backward of block ``k``: activations of blocks up to ``k``, the recomputed saved tensors of
  ``k`` (when recomputed), the gradient flowing in and out, block ``k``'s weights and
  gradients, the prefetched weights, and the gradients of the block before (in backward
  order), whose optimizer update (or gradient accumulation) runs while ``k`` computes, with
  that update's staged master weights and optimizer state when it stages them in the compute
  tier's own memory (a CPU run from the disk tier).

Accumulated gradients (micro-batches > 1) live in the state's tier, beside the master weights
(host memory or files on disk), never in the compute tier: what the compute tier holds of them
is one staged chunk, counted in the staging bytes of a staged update (a CPU run from the disk
tier: the accumulator's chunk is read, added to and written back; the last micro-batch's
update reads it beside the master weights and optimizer state).

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

import math
from dataclasses import dataclass
from itertools import accumulate

from ..units import format_bytes
from .errors import BudgetExceeded, NoFeasiblePlan
from .ir import Graph
from .plan import Action, Mode, ParamPlan, Peak, Plan, Tier

__all__ = ["BudgetExceeded", "NoFeasiblePlan", "BlockTooLarge", "BlockCost", "block_costs", "plan_offload",
           "offload_peak", "micro_batch_sizes", "added_step_flops", "OPTIMIZER_STATE_COPIES", "RESIDENT_KIND",
           "CHUNK_CANDIDATES_NUMEL", "CHUNK_OVERHEAD_FLOPS", "READ_FLOPS_PER_BYTE", "DEFAULT_CHUNK_NUMEL"]

RESIDENT_KIND = "resident"
"""Op kind of a block that is held in the compute tier for the whole step (not streamed)."""

OPTIMIZER_STATE_COPIES = {"adamw": 2, "sgd": 0}
"""Optimizer-state tensors per parameter tensor (AdamW: first and second moment)."""

CHUNK_CANDIDATES_NUMEL = tuple(1 << k for k in range(10, 23))
"""Update chunk sizes the planner tries (1 Ki to 4 Mi elements; a block smaller than a chunk is
updated whole)."""

CHUNK_OVERHEAD_FLOPS = 10_000_000
"""The fixed cost of one chunk of a staged update (one optimizer call, the chunk's reads and
writes), in forward FLOPs of the same CPU. Measured (2-core x86-64, 1 torch thread, a 16-block
GPT of d_model 192 on the disk tier): the update thread's CPU time per step fell by 0.2 ms per
chunk from chunks of 16 Ki to 128 Ki elements, and the model's forward ran at ~46 GFLOP/s. Only
its ratio to the CPU's FLOP rate matters: both are work of the same cores."""

READ_FLOPS_PER_BYTE = 100
"""A weight read that no prefetch hides, in forward FLOPs per byte: the disk tier drops the
pages it wrote, so a block's weights come back from the device (measured ~0.45 GB/s, 2.1 ns per
byte, against ~46 GFLOP/s in the same run; without prefetch the main thread waited 0.15 s per
step of that 16-block GPT for its weights, with prefetch 0.01 s)."""

DEFAULT_CHUNK_NUMEL = 1 << 18
"""The update chunk when the update does not stage in the compute tier (it bounds host memory only)."""


class BlockTooLarge(NoFeasiblePlan):
    """One block's weights, gradients and staged optimizer state alone exceed the budget.

    Attributes:
        block: the block's name; ``need_bytes`` is the smallest budget at which a plan exists
            (and ``have_bytes``/``where`` as :class:`~edgeadapt.sched.errors.BudgetExceeded`).
    """

    def __init__(self, need_bytes: int, have_bytes: int, block: str, detail: str = ""):
        self.block = block
        self.detail = detail
        super().__init__(need_bytes, have_bytes, f"block {block!r}", "compute", detail)

    def __reduce__(self):
        return (type(self), (self.need_bytes, self.have_bytes, self.block, self.detail))


@dataclass(frozen=True)
class BlockCost:
    """Bytes one block needs in the compute tier for a micro-batch of ``b`` windows.

    Attributes:
        name: the block (op) name.
        weight_bytes: its parameters.
        grad_bytes: its gradients (same as ``weight_bytes``).
        staging_bytes: one chunk of master weights + optimizer state (+ the gradient
            accumulator's chunk with micro-batches) staged for the update in the compute tier's
            memory (the chunks are read, updated and written one at a time), plus one temporary
            of a chunk (0 when the update runs elsewhere).
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
                staging: bool = False, staging_chunk_bytes: int | None = None,
                accumulate: bool = False, weights_in_place: bool = False) -> list[BlockCost]:
    """Per-block byte counts in execution order.

    Args:
        graph: one op per block (``edgeadapt.server.trace.trace_graph``).
        batch_windows: windows per forward/backward (a micro-batch).
        optimizer: ``"adamw"`` or ``"sgd"`` (optimizer-state copies per parameter).
        staging: the update stages master weights and optimizer state in the compute tier's
            memory (True for a CPU run whose state lives on disk).
        staging_chunk_bytes: the update stages at most this many bytes of each vector at a
            time (``None``: a whole block at once).
        accumulate: gradients are accumulated over micro-batches in the state's tier (a staged
            update then also stages the accumulator's chunk).
        weights_in_place: the blocks compute on the master weights where they live (a CPU run
            from the host tier): no compute-tier bytes for weights (``weight_bytes`` 0).
    """
    if optimizer not in OPTIMIZER_STATE_COPIES:
        raise ValueError(f"optimizer must be one of {sorted(OPTIMIZER_STATE_COPIES)}, got {optimizer!r}")
    vectors = 1 + OPTIMIZER_STATE_COPIES[optimizer] + int(accumulate)
    out: list[BlockCost] = []
    prev_out = graph.input_bytes
    for op in graph.ops:
        w = sum(graph.param(p).param_bytes for p in op.params)
        per_vector = w if staging_chunk_bytes is None else min(w, staging_chunk_bytes)
        # one chunk of master weights + optimizer state (+ accumulator) + one temporary of the update
        st = per_vector * (vectors + 1) if staging else 0
        held = 0 if weights_in_place else w
        if op.kind == RESIDENT_KIND:
            out.append(BlockCost(op.name, held, w, st, 0, 0, 0, resident=True))
            continue
        out.append(BlockCost(op.name, held, w, st, op.saved_bytes * batch_windows, op.output_bytes * batch_windows,
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
    act_upto = [0, *accumulate(act)]          # act_upto[k]: activations of blocks before k
    w_upto = [0, *accumulate(c.weight_bytes for c in costs)]
    best = (fixed_bytes, "start")
    phases = {"forward": 0, "backward": 0}
    for k, c in enumerate(costs):
        ahead = w_upto[min(n, k + 1 + prefetch_depth)] - w_upto[k + 1]
        total = fixed_bytes + act_upto[k] + c.weight_bytes + ahead + c.saved_bytes + c.output_bytes
        phases["forward"] = max(phases["forward"], total)
        if total > best[0]:
            best = (total, f"forward:{c.name}")
    for k in range(n - 1, -1, -1):
        c = costs[k]
        ahead = w_upto[k] - w_upto[max(0, k - prefetch_depth)]
        rebuilt = c.saved_bytes if recompute[k] else 0
        # the update of the block before (in backward order) may still hold its gradients and staging
        previous = costs[k + 1].grad_bytes + costs[k + 1].staging_bytes if k + 1 < n else 0
        total = (fixed_bytes + act_upto[k + 1] + rebuilt + c.output_bytes + c.input_bytes + c.weight_bytes
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


def micro_batch_sizes(batch_windows: int, max_micro_batches: int) -> list[int]:
    """The distinct micro-batch sizes ``ceil(batch / m)`` for ``m = 1 .. max_micro_batches``,
    largest first."""
    sizes = {math.ceil(batch_windows / m) for m in range(1, min(batch_windows, max_micro_batches) + 1)}
    return sorted(sizes, reverse=True)


@dataclass(frozen=True)
class _Setting:
    micro_windows: int
    depth: int
    chunk_numel: int            # a chunk as large as the largest block: whole blocks
    recompute: tuple[bool, ...]
    peak: Peak


def plan_offload(graph: Graph, budget_bytes: int, *, batch_windows: int = 1, tier: str = "host",
                 optimizer: str = "adamw", recompute: bool | str | None = "auto", prefetch_depth: int = 1,
                 resident_bytes: int = 0, staging: bool | None = None,
                 staging_chunk_bytes: int | None = None, max_micro_batches: int = 1,
                 weights_in_place: bool = False) -> Plan:
    """Plan a streaming training step of ``graph`` under ``budget_bytes`` of compute memory.

    Searches recompute per block, the update chunk, the prefetch depth and the micro-batch size
    (see the module docstring for the order of preference) and returns the first plan that fits.

    Args:
        graph: a block graph (one op per block).
        budget_bytes: the compute tier's budget for everything the executor holds there.
        batch_windows: windows per optimizer step.
        tier: where master weights and optimizer state live: ``"host"`` or ``"disk"``.
        optimizer: ``"adamw"`` or ``"sgd"``.
        recompute: ``"auto"`` (default): searched per block; ``False``/``None``: keep every
            block's activations; ``True``: recompute every block.
        prefetch_depth: the deepest prefetch to consider (lowered, to 0 at the least, when
            deeper does not fit).
        resident_bytes: bytes held in the compute tier for the whole step (module buffers).
        staging: the update stages master weights and optimizer state in compute memory;
            default: True exactly for the disk tier (a CPU run; pass False for a GPU run,
            whose update stages in host memory).
        staging_chunk_bytes: the staged update's chunk per vector; ``None``: searched over
            :data:`CHUNK_CANDIDATES_NUMEL` (and whole blocks).
        max_micro_batches: the most micro-batches a step may be split into (1: none; the
            executor then accumulates gradients per block and updates after the last one).
        weights_in_place: the blocks compute on the master weights in the host tier (a CPU run
            from the host tier: the weights take no compute-tier bytes and prefetch none).

    Returns:
        A :class:`Plan` with every parameter ``full`` on ``tier``, ``order`` = block order,
        ``activations`` per block, ``prefetch_depth``, ``micro_batch_windows``,
        ``update_chunk_numel`` and the predicted peak.

    Raises:
        BlockTooLarge: one block's weights, gradients and smallest staged state alone exceed
            the budget (the error names the block; ``need_bytes`` is the smallest budget at
            which a plan exists).
        NoFeasiblePlan: no combination fits; ``need_bytes`` is the smallest budget that does.
        ValueError: an unknown tier, optimizer or recompute value.
    """
    if tier not in ("host", "disk"):
        raise ValueError(f"tier must be 'host' or 'disk', got {tier!r}")
    if weights_in_place and tier != "host":
        raise ValueError("weights_in_place needs the host tier (the disk tier's weights are read into memory)")
    if recompute not in (None, False, True, "auto"):
        raise ValueError(f"recompute must be False, True or 'auto', got {recompute!r}")
    if prefetch_depth < 0 or batch_windows < 1 or budget_bytes <= 0 or max_micro_batches < 1:
        raise ValueError("prefetch_depth must be >= 0, batch_windows >= 1, budget_bytes > 0 and "
                         "max_micro_batches >= 1")
    if staging_chunk_bytes is not None and staging_chunk_bytes < 4:
        raise ValueError(f"staging_chunk_bytes must be at least one float32 (4), got {staging_chunk_bytes}")
    staging = (tier == "disk") if staging is None else staging
    largest = max((sum(graph.param(p).param_bytes for p in op.params) // 4 for op in graph.ops), default=1)
    if staging_chunk_bytes is not None:
        chunks = [staging_chunk_bytes // 4]
    elif staging:  # a chunk at least as large as every block is the whole-block update
        chunks = sorted({min(c, largest) for c in CHUNK_CANDIDATES_NUMEL}, reverse=True)
    else:  # the chunk only bounds host memory: it changes no compute-tier byte
        chunks = [DEFAULT_CHUNK_NUMEL]
    fixed = resident_bytes + graph.input_bytes * batch_windows
    micro = micro_batch_sizes(batch_windows, max_micro_batches)
    cache: dict[tuple[int, int], list[BlockCost]] = {}

    def costs_of(mb: int, chunk: int) -> list[BlockCost]:
        key = (mb, chunk)
        if key not in cache:
            cache[key] = block_costs(graph, mb, optimizer=optimizer, staging=staging,
                                     staging_chunk_bytes=4 * chunk,
                                     accumulate=mb < batch_windows, weights_in_place=weights_in_place)
        return cache[key]

    def fit(mb: int, depth: int, chunk: int) -> _Setting | None:
        """The plan of these knobs with the least recompute that fits, or None."""
        costs = costs_of(mb, chunk)
        n = len(costs)
        can = [not c.resident and c.saved_bytes > 0 for c in costs]
        rec = [bool(recompute is True or recompute == "auto") and x for x in can]
        peak = offload_peak(costs, rec, depth, fixed_bytes=fixed)
        if peak.peak_bytes > budget_bytes:
            return None
        if recompute == "auto":
            for k in sorted((k for k in range(n) if rec[k]), key=lambda k: -costs[k].saved_bytes):
                rec[k] = False
                q = offload_peak(costs, rec, depth, fixed_bytes=fixed)
                if q.peak_bytes <= budget_bytes:
                    peak = q
                else:
                    rec[k] = True
        return _Setting(mb, depth, chunk, tuple(rec), peak)

    def smallest() -> _Setting:
        """The knobs of the smallest peak: per micro-batch size every knob at its least (all
        recompute that the policy allows, prefetch 0, the smallest chunk), then the least of those."""
        out = []
        for mb in micro:
            costs = costs_of(mb, chunks[-1])
            rec = [recompute in (True, "auto") and not c.resident and c.saved_bytes > 0 for c in costs]
            out.append(_Setting(mb, 0, chunks[-1], tuple(rec), offload_peak(costs, rec, 0, fixed_bytes=fixed)))
        return min(out, key=lambda s: (s.peak.peak_bytes, -s.micro_windows))

    least = smallest()
    if least.peak.peak_bytes > budget_bytes:
        _refuse(graph, least, costs_of(least.micro_windows, least.chunk_numel), fixed, budget_bytes,
                batch_windows, optimizer, recompute)

    depths = range(0 if weights_in_place else prefetch_depth, -1, -1)

    def best_for(mb: int) -> _Setting | None:
        """The preferred plan with micro-batches of ``mb`` windows (orders 2 and 3), or None."""
        if staging:
            found = [s for s in (fit(mb, d, c) for d in depths for c in chunks) if s is not None]
            return min(found, default=None, key=lambda s: (
                added_step_flops(graph, s.recompute, s.micro_windows, s.chunk_numel, s.depth, batch_windows),
                _recomputed_bytes(s, costs_of(mb, s.chunk_numel)), -s.depth, -s.chunk_numel))
        for depth in depths:
            found = [s for s in (fit(mb, depth, c) for c in chunks) if s is not None]
            if found:
                return min(found, key=lambda s: (_recomputed_bytes(s, costs_of(mb, s.chunk_numel)), -s.chunk_numel))
        return None

    chosen = next(s for s in map(best_for, micro) if s is not None)  # the smallest setting fits: one does
    costs = costs_of(chosen.micro_windows, chosen.chunk_numel)
    ptier = Tier(tier)
    return Plan(
        graph=graph.name,
        params=tuple(ParamPlan(p_.name, Mode.FULL, None, ptier) for p_ in graph.params),
        cut=-1, batch_windows=batch_windows, micro_batch_windows=chosen.micro_windows, n_windows=batch_windows,
        activations=tuple((c.name, Action.RECOMPUTE if r else Action.KEEP) for c, r in zip(costs, chosen.recompute)
                          if not c.resident),
        order=tuple(op.name for op in graph.ops if op.kind != RESIDENT_KIND), prefetch_depth=chosen.depth,
        optimizer=optimizer, budget_bytes=budget_bytes, predicted=chosen.peak,
        update_chunk_numel=chosen.chunk_numel,
    )


def added_step_flops(graph: Graph, recompute: tuple[bool, ...] | list[bool], micro_windows: int, chunk_numel: int,
                     prefetch_depth: int, batch_windows: int) -> int:
    """What a staged (CPU disk-tier) plan adds to a step, in forward FLOPs of the same CPU.

    Per micro-batch: the forward of every recomputed block (``Op.flops`` per window), a fixed
    :data:`CHUNK_OVERHEAD_FLOPS` per chunk of every block's update (or gradient accumulation),
    and, without prefetch, the reads of every block's weights for its forward and backward at
    :data:`READ_FLOPS_PER_BYTE`. Used to rank plans that fit, not to predict a time.

    Args:
        graph: the block graph (ops aligned with ``recompute``).
        recompute: per op, whether its activations are recomputed.
        micro_windows: windows per micro-batch.
        chunk_numel: elements per chunk of the staged update.
        prefetch_depth: blocks read ahead of use.
        batch_windows: windows per step.
    """
    micro = math.ceil(batch_windows / micro_windows)
    recomputed = sum(op.flops * micro_windows for op, r in zip(graph.ops, recompute) if r)
    numels = [sum(graph.param(p).param_bytes for p in op.params) // 4 for op in graph.ops]
    chunks = sum(math.ceil(n / chunk_numel) for n in numels if n)
    reads = 0 if prefetch_depth else 2 * 4 * sum(numels) * READ_FLOPS_PER_BYTE
    return micro * (recomputed + chunks * CHUNK_OVERHEAD_FLOPS + reads)


def _recomputed_bytes(s: _Setting, costs: list[BlockCost]) -> int:
    return sum(c.saved_bytes for c, r in zip(costs, s.recompute) if r)


def _refuse(graph: Graph, least: _Setting, costs: list[BlockCost], fixed: int, budget_bytes: int,
            batch_windows: int, optimizer: str, recompute) -> None:
    """Raise the refusal for a budget below the smallest plan ``least``."""
    need = least.peak.peak_bytes
    knobs = (f"{'every block recomputed' if any(least.recompute) else 'no recompute'}, prefetch 0, update chunk "
             f"{least.chunk_numel} elements, micro-batches of {least.micro_windows} of {batch_windows} windows")
    hint = "" if recompute == "auto" else "; recompute='auto' trades compute for activation memory"
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
        what = "the parameters outside every block (held for the whole step)" if worst.resident else "the block"
        raise BlockTooLarge(
            need, budget_bytes, worst.name,
            f"block {worst.name!r} alone holds {parts} ({format_bytes(alone(worst))}); with what runs beside it "
            "(the gradients of the block before, whose update overlaps it, and the activations), the smallest "
            f"budget at which a plan exists is {need} bytes ({format_bytes(need)}): raise the budget to it, or "
            f"split {what} into smaller modules")
    raise NoFeasiblePlan(
        need, budget_bytes, least.peak.where,
        detail=f"no combination of recompute, prefetch, update chunk and micro-batches fits; the smallest budget "
               f"that fits is {need} bytes ({format_bytes(need)}) ({knobs}): raise the budget to at least that "
               f"or lower the batch size{hint}")
