"""The streaming executor's optimizer update: each block's CPU AdamW (or SGD) as soon as its
gradients exist.

The :class:`BlockUpdater` reduces a block's gradients (``reduce(block_name, grads)``, a
collective when a process group is set), takes them off the compute device, and applies the
update on one background thread while the backward of the next block proceeds. Between the
micro-batches of a step it sums the gradients in the store's accumulator instead. Host tier:
in place on the master tensors. Disk tier: in chunks of :attr:`BlockUpdater.chunk_numel`
elements, read, updated and written back on the I/O threads (the update is elementwise, so
chunking changes no bit).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ..optimizer_config import OptimizerConfig
from ..sched.offload import DEFAULT_CHUNK_NUMEL
from ..sched.plan import Plan
from .coordinator import BlockSlot
from .optim import update_block
from .residency import MemoryLedger
from .store import ACCUMULATOR, StateStore

__all__ = ["BlockUpdater", "ReduceFn"]

ReduceFn = Callable[[str, list[torch.Tensor]], None]


def _no_reduce(block_name: str, grads: list[torch.Tensor]) -> None:
    """Default gradient reduction: nothing (one process)."""


class BlockUpdater:
    """Per-block optimizer updates of the master copy in the store.

    Args:
        store: master weights and optimizer state.
        ledger: the compute tier's account (the gradients' reservation ``grads:<block>`` is
            released here; staged chunks are reserved here).
        device: the compute device (where the gradients come from).
        optimizer: hyper-parameters.
        reduce: gradient reduction hook, called before each block's update.
        owned: the block indices whose update this process runs (ZeRO-1); ``None``: every block.
    """

    def __init__(self, store: StateStore, ledger: MemoryLedger, device: torch.device, optimizer: OptimizerConfig,
                 reduce: ReduceFn | None = None, owned=None):
        self.store, self.ledger, self.device, self.optimizer = store, ledger, device, optimizer
        self.reduce: ReduceFn = reduce or _no_reduce
        self.owned = None if owned is None else frozenset(owned)
        self.lr = optimizer.lr
        self.chunk_numel = DEFAULT_CHUNK_NUMEL
        self.micro, self.micro_count = 0, 1
        self._updater = ThreadPoolExecutor(max_workers=1, thread_name_prefix="edgeadapt-update")
        self._pending: list[Future] = []
        # the disk tier's update reads and writes its vectors (weights, moments) concurrently
        self._io = ThreadPoolExecutor(max_workers=4, thread_name_prefix="edgeadapt-io")

    def set_plan(self, plan: Plan) -> None:
        """Adopt the plan's update chunk (:attr:`chunk_numel`: elements per chunk of a staged
        update; staged bytes: 4 x this x (2 + optimizer-state vectors): master weights, state, one
        temporary)."""
        self.chunk_numel = int(plan.update_chunk_numel or DEFAULT_CHUNK_NUMEL)

    def owns(self, index: int) -> bool:
        """Whether this process runs block ``index``'s optimizer update (and keeps its state)."""
        return self.owned is None or index in self.owned

    def begin_step(self, slots: list[BlockSlot], *, micro: int, micro_count: int) -> None:
        """Micro-batch ``micro`` of ``micro_count`` in the step; the first one starts the sums."""
        if not 0 <= micro < micro_count:
            raise ValueError(f"micro-batch {micro} of {micro_count}")
        self.micro, self.micro_count = micro, micro_count
        if micro == 0:
            for s in slots:
                s.accumulated = set()

    def update(self, slot: BlockSlot, grads: list[torch.Tensor | None]) -> None:
        """Reduce ``grads`` and hand the block's optimizer update (or, before the last micro-batch
        of a step, the accumulation of its gradients) to the update thread.

        The reduction (a collective when a process group is set) and the copy of the gradients
        off a GPU run on the calling thread, in block order; the update itself runs on one
        background thread while the backward of the next block proceeds. :meth:`wait` waits
        for it. The reservation ``grads:<block>`` is released when the gradients are no longer
        held in the compute tier. A block another rank owns (ZeRO-1) is not updated here: after
        the reduction its gradients are dropped (the owner broadcasts the new weights after the
        step).
        """
        present = [i for i, g in enumerate(grads) if g is not None]
        gl = [grads[i] for i in present]
        final = self.micro == self.micro_count - 1
        try:
            self.reduce(slot.name, gl)
            if not self.owns(slot.index):
                del gl, grads
                self.ledger.release(f"grads:{slot.name}")
                for i in present:  # kept in step with the owner's count (checkpoints, resume)
                    slot.steps[i] += 1
                return
            if self.device.type != "cpu":
                gl = [g.to("cpu") for g in gl]
                self.ledger.release(f"grads:{slot.name}")
        except BaseException:
            self.ledger.release(f"grads:{slot.name}")
            raise
        had = frozenset(slot.accumulated)
        if final:
            for i in sorted(set(present) | had):
                slot.steps[i] += 1
        else:
            slot.accumulated |= set(present)
        self.wait()  # at most one update in flight: the planner counts one block's gradients
        self._pending.append(self._updater.submit(self._apply, slot, present, gl, had, final))

    def wait(self) -> None:
        """Wait for the step's optimizer updates; re-raises the first failure."""
        pending, self._pending = self._pending, []
        errors = [f.exception() for f in pending]
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first

    def _apply(self, slot: BlockSlot, present: list[int], gl: list[torch.Tensor], had: frozenset[int],
               final: bool) -> None:
        """The optimizer update of one block, or the accumulation of its gradients (update thread).

        ``had``: the parameters whose gradients earlier micro-batches of this step accumulated.
        The accumulator holds ``g1``, then ``g1 + g2``, ...; the last micro-batch's gradient is
        added to it and the sum updates the block (the order of torch's own ``p.grad``
        accumulation).
        """
        try:
            if self.store.in_place():
                self._apply_in_place(slot, present, gl, had, final)
            else:
                self._apply_chunked(slot, present, gl, had, final)
        finally:
            self.ledger.release(f"grads:{slot.name}")

    def _apply_in_place(self, slot: BlockSlot, present: list[int], gl: list[torch.Tensor], had: frozenset[int],
                        final: bool) -> None:
        grads = dict(zip(present, gl))
        acc = slot.views(self.store.read(slot.index, ACCUMULATOR)) if had or not final else None
        if not final:
            for i, g in grads.items():
                acc[i].add_(g) if i in had else acc[i].copy_(g)
            return
        for i in had:
            grads[i] = acc[i].add_(grads[i]) if i in grads else acc[i]
        idx = sorted(grads)
        views = {k: slot.views(self.store.read(slot.index, k)) for k in ("param", *self.optimizer.state_kinds)}
        update_block(self.optimizer, [views["param"][i] for i in idx], [grads[i] for i in idx],
                     {k: [views[k][i] for i in idx] for k in self.optimizer.state_kinds},
                     [slot.steps[i] for i in idx], lr=self.lr)

    def _apply_chunked(self, slot: BlockSlot, present: list[int], gl: list[torch.Tensor], had: frozenset[int],
                       final: bool) -> None:
        """The staged update, pipelined over chunks on the I/O threads: while chunk ``i`` is updated,
        chunk ``i + 1`` is read, and chunk ``i``'s writes run behind; chunk ``i + 1``'s reads start only
        once chunk ``i - 1``'s writes are done, so at most two chunks' vectors are staged at once (the
        planner counts two, plus one temporary of the update)."""
        flat_grads = {i: g.reshape(-1) for i, g in zip(present, gl)}
        kinds = ("param", *self.optimizer.state_kinds) if final else ()
        staged_here = self.device.type == "cpu"
        idx = sorted(set(flat_grads) | had)
        chunks = []
        for a in range(0, slot.numel, self.chunk_numel):
            b = min(slot.numel, a + self.chunk_numel)
            parts = [(i, max(a, slot.offsets[i]), min(b, slot.offsets[i] + slot.shapes[i].numel())) for i in idx]
            parts = [(i, lo, hi) for i, lo, hi in parts if lo < hi]
            if parts:
                chunks.append((a, b, parts, any(i in had for i, _, _ in parts)))
        if not final:  # the first micro-batch's gradients go straight to the accumulator
            for a, b, parts, read_acc in [c for c in chunks if not c[3]]:
                for i, lo, hi in parts:
                    o = slot.offsets[i]
                    self.store.write_range(slot.index, ACCUMULATOR, lo, flat_grads[i][lo - o:hi - o])
            chunks = [c for c in chunks if c[3]]
        key = f"staging:{slot.name}"
        inflight: dict[int, tuple[dict[str, Future], list[Future]]] = {}  # chunk -> (reads, writes)
        buffers: list[dict[str, torch.Tensor]] = [{}, {}]  # two staging sets, allocated once per update

        def start_reads(j: int) -> None:
            a, b, _, read_acc = chunks[j]
            reads = [*kinds, ACCUMULATOR] if read_acc else list(kinds)
            if staged_here:
                self.ledger.reserve(f"{key}:{j % 2}", 4 * min(self.chunk_numel, slot.numel) * len(reads))
            room = buffers[j % 2]
            for k in reads:
                if k not in room:
                    room[k] = torch.empty(min(self.chunk_numel, slot.numel), dtype=torch.float32)
            inflight[j] = ({k: self._io.submit(self.store.read_range, slot.index, k, a, b - a, room[k][:b - a])
                            for k in reads}, [])

        def finish(j: int) -> None:
            """Wait for chunk ``j``'s reads and writes; release its staged bytes."""
            reads, writes = inflight.pop(j)
            try:
                for f in [*reads.values(), *writes]:
                    f.result()
            finally:
                self.ledger.release(f"{key}:{j % 2}")

        try:
            if chunks:
                start_reads(0)
            for j, (a, b, parts, read_acc) in enumerate(chunks):
                bufs = {k: f.result() for k, f in inflight[j][0].items()}
                if j >= 1:
                    finish(j - 1)  # its writes are done before the next chunk's reads take its room
                if j + 1 < len(chunks):
                    start_reads(j + 1)
                pieces: dict[str, list[torch.Tensor]] = {k: [] for k in kinds}
                gp, sp = [], []
                for i, lo, hi in parts:
                    o = slot.offsets[i]
                    g = flat_grads[i][lo - o:hi - o] if i in flat_grads else None
                    if i in had:
                        acc = bufs[ACCUMULATOR][lo - a:hi - a]
                        g = acc if g is None else acc.add_(g)
                    elif not final:
                        g = bufs[ACCUMULATOR][lo - a:hi - a].copy_(g)
                    for k in kinds:
                        pieces[k].append(bufs[k][lo - a:hi - a])
                    gp.append(g)
                    sp.append(slot.steps[i])
                if final:
                    if staged_here:  # one chunk-sized temporary of the foreach AdamW (its sqrt)
                        self.ledger.reserve(f"{key}:temp", 4 * (b - a))
                    try:
                        update_block(self.optimizer, pieces["param"], gp,
                                     {k: pieces[k] for k in self.optimizer.state_kinds}, sp, lr=self.lr)
                    finally:
                        self.ledger.release(f"{key}:temp")
                    writes = {k: bufs[k] for k in kinds}
                else:
                    writes = {ACCUMULATOR: bufs[ACCUMULATOR]}
                inflight[j][1].extend(self._io.submit(self.store.write_range, slot.index, k, a, v)
                                      for k, v in writes.items())
                del bufs, pieces, gp
        finally:
            for j in sorted(inflight):
                finish(j)

    def close(self) -> None:
        """Wait for the updates in flight and stop the update and I/O threads."""
        self.wait()
        self._updater.shutdown(wait=True)
        self._io.shutdown(wait=True)
