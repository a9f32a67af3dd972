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
* how far each block's optimizer update runs beside the next block's backward
  (``Plan.update_overlap``, :class:`~edgeadapt.sched.plan.UpdateOverlap`): through all of it
  (the default), only while the next block's weights come in and its activations are
  recomputed (its gradients wait for the update), or not at all, so that two blocks'
  gradients are never held at once;
* the predicted peak of the compute tier and where it occurs.

A CPU run from the host tier computes on the master weights where they are
(``weights_in_place``): its weights take no compute-tier bytes and are neither copied nor
prefetched.

**The search.** Every knob lowers the peak monotonically except the micro-batch size and the
update's overlap: more recompute, a shallower prefetch and a smaller update chunk never raise
it (each only removes terms below), so for each micro-batch size and overlap the smallest peak
is the one with every block recomputed, prefetch 0 and the smallest chunk. The smallest budget
any plan fits is the minimum of that over the micro-batch sizes and the three overlaps; below it
the planner refuses with :class:`~edgeadapt.sched.errors.NoFeasiblePlan` naming it. At or
above it the planner returns the first plan that fits in this preference order (fastest
first):

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
   first, from an all-recompute plan while the plan fits;
4. at each micro-batch size, updates overlapping the whole next backward, then only the next
   block's recompute, then none: waiting for an update puts what is left of the update
   thread's work on the step's critical path, so each is taken only where the one before does
   not fit at that micro-batch size.

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
  tier's own memory (a CPU run from the disk tier);
* with updates overlapping less than the whole backward, the backward of ``k`` holds no other
  block's gradients; instead the update of ``k`` (phase ``update``) starts after its backward,
  holding the activations of blocks before ``k``, the gradients flowing into and out of ``k``,
  its gradients and staged state, and the prefetched weights (``k``'s own weights and
  activations are released first); overlapping the next block's recompute, it also runs while
  block ``k - 1``'s weights come in and its saved activations are rebuilt (phase ``recompute``:
  the activations up to ``k - 1``, the rebuilt ones, the gradient flowing into ``k - 1``, its
  weights and the prefetched ones, beside the update's gradients and staged state);
* the loss (phase ``loss``, when the graph measured it: ``Graph.loss_peak_bytes``): between the
  forward and the last block's backward, every block's kept activations and the weights the
  last forward prefetched, beside the most the loss holds while it runs forward and backward
  (its saved tensors, its backward's transients, the gradient it hands to the output: for a
  cross-entropy, three tensors of the logits' size); its saved tensors
  (``Graph.loss_saved_bytes``) stay charged through every block's backward;
* what the model's own code between blocks saves, and a final output it makes after the last
  block (``Graph.outside_saved_bytes``): held from the forward's start to the backward's end.

A block's saved bytes for ``b`` windows are ``b x Op.saved_bytes``, an upper bound for any ``b``
whose bytes grow no faster than its windows (per window, the larger of the traced batch's share
and its first window's alone), or, for
exactly the traced batch's ``Graph.traced_windows``, the trace's own ``Op.saved_traced_bytes``
(and ``Graph.outside_traced_bytes``): what does not grow with the windows then counts once.

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
from .plan import Action, Mode, ParamPlan, Peak, Plan, Tier, UpdateOverlap

__all__ = ["BudgetExceeded", "NoFeasiblePlan", "BlockTooLarge", "BlockCost", "block_costs", "plan_offload",
           "offload_peak", "micro_batch_sizes", "added_step_flops", "OPTIMIZER_STATE_COPIES", "RESIDENT_KIND",
           "CHUNK_CANDIDATES_NUMEL", "CHUNK_OVERHEAD_FLOPS", "READ_FLOPS_PER_BYTE", "DEFAULT_CHUNK_NUMEL", "OVERLAPS",
           "OVERLAP_TEXT"]

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

OVERLAPS = (UpdateOverlap.BACKWARD, UpdateOverlap.RECOMPUTE, UpdateOverlap.NONE)
"""Update overlaps in the planner's order of preference (the most overlap first)."""

OVERLAP_TEXT = {UpdateOverlap.BACKWARD: "each update overlapping the next block's backward",
                UpdateOverlap.RECOMPUTE: "each update overlapping the next block's recompute only",
                UpdateOverlap.NONE: "each update before the next block's backward"}

DEFAULT_CHUNK_NUMEL = 1 << 18
"""The update chunk when the update does not stage in the compute tier (it bounds host memory only)."""


class BlockTooLarge(NoFeasiblePlan):
    """One block alone exceeds the budget: its gradients with its weights (its backward) or with
    its smallest staged optimizer state (its update), whichever is larger (a resident block: all
    three, held for the whole step).

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
        """The most the block alone holds at once while its gradient exists: its gradients with its
        weights (its backward) or with its staged update state (its update, which starts after
        the weights are released)."""
        return self.grad_bytes + max(self.weight_bytes, self.staging_bytes)


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
    exact = graph.traced_at(batch_windows)  # the traced batch's own figures
    for op in graph.ops:
        w = sum(graph.param(p).param_bytes for p in op.params)
        per_vector = w if staging_chunk_bytes is None else min(w, staging_chunk_bytes)
        # one chunk of master weights + optimizer state (+ accumulator) + one temporary of the update
        st = per_vector * (vectors + 1) if staging else 0
        held = 0 if weights_in_place else w
        if op.kind == RESIDENT_KIND:
            out.append(BlockCost(op.name, held, w, st, 0, 0, 0, resident=True))
            continue
        saved = op.saved_traced_bytes if exact else op.saved_bytes * batch_windows
        out.append(BlockCost(op.name, held, w, st, saved, op.output_bytes * batch_windows, prev_out * batch_windows))
        prev_out = op.output_bytes
    return out


def offload_peak(costs: list[BlockCost], recompute: list[bool], prefetch_depth: int, *,
                 fixed_bytes: int, update_overlap: UpdateOverlap = UpdateOverlap.BACKWARD,
                 loss_saved_bytes: int = 0, loss_peak_bytes: int = 0, outside_saved_bytes: int = 0) -> Peak:
    """The compute-tier peak of one step under the cost model in the module docstring.

    Args:
        costs: from :func:`block_costs`.
        recompute: per block (aligned with ``costs``), True when its activations are
            recomputed (ignored for resident blocks).
        prefetch_depth: blocks brought in ahead of use.
        fixed_bytes: held throughout (buffers and the input batch).
        update_overlap: how far each block's update runs beside the next block's backward.
        loss_saved_bytes: what the loss saves (a micro-batch's): held from the loss until the
            backward is over (the trainer charges it as the ops outside the blocks' activations).
        loss_peak_bytes: the most the loss holds at once while it runs forward and backward,
            beside every block's activations (the phase ``loss``).
        outside_saved_bytes: what the model's own code between blocks saves (a micro-batch's):
            counted in every phase from the forward's start to the backward's end.
    """
    fixed_bytes += outside_saved_bytes
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
    if loss_peak_bytes and n:
        # after the forward, before the last block's backward: every activation is held; the last
        # block's forward prefetched the blocks after it in the backward's order (not itself)
        ahead = w_upto[n - 1] - w_upto[max(0, min(n - 1, n - prefetch_depth))]
        total = fixed_bytes + act_upto[n] + ahead + loss_peak_bytes
        phases["loss"] = total
        if total > best[0]:
            best = (total, "loss")
    fixed_bytes += loss_saved_bytes  # the backward: the loss's saved tensors stay charged
    for k in range(n - 1, -1, -1):
        c = costs[k]
        ahead = w_upto[k] - w_upto[max(0, k - prefetch_depth)]
        rebuilt = c.saved_bytes if recompute[k] else 0
        # the update of the block before (in backward order) may still hold its gradients and staging
        previous = costs[k + 1].grad_bytes + costs[k + 1].staging_bytes if k + 1 < n else 0
        beside = previous if update_overlap is UpdateOverlap.BACKWARD else 0
        totals = {"backward": fixed_bytes + act_upto[k + 1] + rebuilt + c.output_bytes + c.input_bytes
                  + c.weight_bytes + c.grad_bytes + ahead + beside}
        if update_overlap is not UpdateOverlap.BACKWARD:
            # block k's own update: its weights and activations are gone, the gradients remain
            totals["update"] = (fixed_bytes + act_upto[k] + c.output_bytes + c.input_bytes + c.grad_bytes
                                + c.staging_bytes + ahead)
        if update_overlap is UpdateOverlap.RECOMPUTE and previous:
            # the update of the block before runs on while k's weights come in and k is recomputed
            totals["recompute"] = (fixed_bytes + act_upto[k + 1] + rebuilt + c.output_bytes + c.weight_bytes + ahead
                                   + previous)
        for phase, total in totals.items():
            phases[phase] = max(phases.get(phase, 0), total)
            if total > best[0]:
                best = (total, f"{phase}:{c.name}")
    if resident:
        # after the backward: every streamed block is gone; the resident blocks' updates stage their state
        total = fixed_bytes + max(c.staging_bytes for c in resident)
        phases["update"] = max(phases.get("update", 0), total)
        if total > best[0]:
            best = (total, f"update:{max(resident, key=lambda c: c.staging_bytes).name}")
    in_order = ("forward", "loss", "backward")  # the step's order, for reports
    phases = {k: phases[k] for k in in_order if k in phases} | {k: v for k, v in phases.items() if k not in in_order}
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
    overlap: UpdateOverlap = UpdateOverlap.BACKWARD


def plan_offload(graph: Graph, budget_bytes: int, *, batch_windows: int = 1, tier: str = "host",
                 optimizer: str = "adamw", recompute: bool | str | None = "auto", prefetch_depth: int = 1,
                 resident_bytes: int = 0, staging: bool | None = None,
                 staging_chunk_bytes: int | None = None, max_micro_batches: int = 1,
                 weights_in_place: bool = False) -> Plan:
    """Plan a streaming training step of ``graph`` under ``budget_bytes`` of compute memory.

    Searches recompute per block, the update chunk, the prefetch depth, the micro-batch size and
    whether each block's update overlaps the next block's backward (see the module docstring for
    the order of preference) and returns the first plan that fits.

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
        ``update_chunk_numel``, ``update_overlap`` and the predicted peak.

    Raises:
        BlockTooLarge: one block alone (:attr:`BlockCost.update_bytes`) exceeds
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

    def outside_blocks(mb: int) -> dict[str, int]:
        # what the model's own code between blocks saves is held, like the loss's saved tensors,
        # until the backward ends; counted from the forward's start (an upper bound)
        return {"loss_saved_bytes": graph.loss_saved_bytes * mb, "loss_peak_bytes": graph.loss_peak_bytes * mb,
                "outside_saved_bytes": graph.outside_traced_bytes if graph.traced_at(mb)
                else graph.outside_saved_bytes * mb}

    def fit(mb: int, depth: int, chunk: int, overlap: UpdateOverlap) -> _Setting | None:
        """The plan of these knobs with the least recompute that fits, or None."""
        costs = costs_of(mb, chunk)
        n = len(costs)
        can = [not c.resident and c.saved_bytes > 0 for c in costs]
        rec = [bool(recompute is True or recompute == "auto") and x for x in can]
        peak = offload_peak(costs, rec, depth, fixed_bytes=fixed, update_overlap=overlap, **outside_blocks(mb))
        if peak.peak_bytes > budget_bytes:
            return None
        if recompute == "auto":
            for k in sorted((k for k in range(n) if rec[k]), key=lambda k: -costs[k].saved_bytes):
                rec[k] = False
                q = offload_peak(costs, rec, depth, fixed_bytes=fixed, update_overlap=overlap, **outside_blocks(mb))
                if q.peak_bytes <= budget_bytes:
                    peak = q
                else:
                    rec[k] = True
        return _Setting(mb, depth, chunk, tuple(rec), peak, overlap)

    def smallest() -> _Setting:
        """The knobs of the smallest peak: per micro-batch size and overlap every other knob at its
        least (all recompute that the policy allows, prefetch 0, the smallest chunk), then the
        least of those (on a tie, the fewest micro-batches, then the most overlap)."""
        out = []
        for mb in micro:
            costs = costs_of(mb, chunks[-1])
            rec = [recompute in (True, "auto") and not c.resident and c.saved_bytes > 0 for c in costs]
            for overlap in OVERLAPS:
                peak = offload_peak(costs, rec, 0, fixed_bytes=fixed, update_overlap=overlap, **outside_blocks(mb))
                out.append(_Setting(mb, 0, chunks[-1], tuple(rec), peak, overlap))
        return min(out, key=lambda s: (s.peak.peak_bytes, -s.micro_windows, OVERLAPS.index(s.overlap)))

    least = smallest()
    if least.peak.peak_bytes > budget_bytes:
        _refuse(graph, least, costs_of(least.micro_windows, least.chunk_numel), fixed, budget_bytes,
                batch_windows, optimizer, recompute)

    depths = range(0 if weights_in_place else prefetch_depth, -1, -1)

    def best_for(mb: int, overlap: UpdateOverlap) -> _Setting | None:
        """The preferred plan with micro-batches of ``mb`` windows and this overlap (orders 2 and
        3), or None."""
        if staging:
            found = [s for s in (fit(mb, d, c, overlap) for d in depths for c in chunks) if s is not None]
            return min(found, default=None, key=lambda s: (
                added_step_flops(graph, s.recompute, s.micro_windows, s.chunk_numel, s.depth, batch_windows),
                _recomputed_bytes(s, costs_of(mb, s.chunk_numel)), -s.depth, -s.chunk_numel))
        for depth in depths:
            found = [s for s in (fit(mb, depth, c, overlap) for c in chunks) if s is not None]
            if found:
                return min(found, key=lambda s: (_recomputed_bytes(s, costs_of(mb, s.chunk_numel)), -s.chunk_numel))
        return None

    # order 4 inside order 1; the smallest setting fits, so one of these does
    chosen = next(s for s in (best_for(mb, overlap) for mb in micro for overlap in OVERLAPS) if s is not None)
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
        update_chunk_numel=chosen.chunk_numel, update_overlap=chosen.overlap,
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
             f"{least.chunk_numel} elements, micro-batches of {least.micro_windows} of {batch_windows} windows, "
             f"{OVERLAP_TEXT[least.overlap]}")
    hint = "" if recompute == "auto" else "; recompute='auto' trades compute for activation memory"
    held_res = sum(c.weight_bytes + c.grad_bytes for c in costs if c.resident)

    def alone(c: BlockCost) -> int:
        return fixed + (held_res + c.staging_bytes if c.resident else held_res + c.update_bytes)

    worst = max(costs, key=alone)
    beside = ("the gradients of the block before, whose update overlaps it, and the activations"
              if least.overlap is not UpdateOverlap.NONE else "the activations and the gradients flowing through it")
    if alone(worst) > budget_bytes:
        staged = f"staged master weights and {optimizer} state {format_bytes(worst.staging_bytes)}"
        parts = f"weights {format_bytes(worst.weight_bytes)} + gradients {format_bytes(worst.grad_bytes)}"
        if worst.resident and worst.staging_bytes:  # held all step, beside its update's staging
            parts += f" + {staged}"
        elif not worst.resident and worst.staging_bytes > worst.weight_bytes:  # its update is its largest moment
            parts = (f"gradients {format_bytes(worst.grad_bytes)} + {staged} during its update (its weights, "
                     f"{format_bytes(worst.weight_bytes)}, are released before it)")
        others = held_res - (worst.weight_bytes + worst.grad_bytes if worst.resident else 0)
        if others:
            parts += f" + weights and gradients of the resident blocks, held all step {format_bytes(others)}"
        if fixed:
            parts += f" + always-resident buffers and input {format_bytes(fixed)}"
        what = "the parameters outside every block (held for the whole step)" if worst.resident else "the block"
        raise BlockTooLarge(
            need, budget_bytes, worst.name,
            f"block {worst.name!r} alone holds {parts} ({format_bytes(alone(worst))}); with what runs beside it "
            f"({beside}), the smallest "
            f"budget at which a plan exists is {need} bytes ({format_bytes(need)}): raise the budget to it, or "
            f"split {what} into smaller modules")
    raise NoFeasiblePlan(
        need, budget_bytes, least.peak.where,
        detail=f"no combination of recompute, prefetch, update chunk, micro-batches and update overlap fits; the "
               f"smallest budget that fits is {need} bytes ({format_bytes(need)}) ({knobs}): raise the budget to at "
               f"least that or lower the batch size{hint}")
