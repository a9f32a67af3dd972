"""The streaming executor's optimizer update: each block's CPU AdamW (or SGD) as soon as its
gradients exist.

The :class:`BlockUpdater` reduces a block's gradients (``reduce(block_name, grads)``, a
collective when a process group is set), takes them off the compute device, and applies the
update on one background thread while the backward of the next block proceeds. Between the
micro-batches of a step it sums the gradients in the store's accumulator instead. Host tier:
in place on the master tensors. Disk tier: in chunks of :attr:`BlockUpdater.chunk_numel`
elements, read, updated and written back (the update is elementwise, so chunking changes no
bit): one chunk at a time on the update thread for a CPU run, pipelined on the I/O threads for a
GPU run.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ..optimizer_config import OptimizerConfig
from ..sched.offload import DEFAULT_CHUNK_NUMEL
from ..sched.plan import Plan, UpdateOverlap
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
        self.overlap = UpdateOverlap.BACKWARD  # how far an update runs beside the next backward
        self.micro, self.micro_count = 0, 1
        self.blocks_updated = 0  # final updates handed out in this step (a failed step may leave some applied)
        self._updater = ThreadPoolExecutor(max_workers=1, thread_name_prefix="edgeadapt-update")
        self._pending: list[Future] = []
        # a GPU run's disk-tier update reads and writes its chunks behind its arithmetic
        self._io = ThreadPoolExecutor(max_workers=4, thread_name_prefix="edgeadapt-io")

    def set_plan(self, plan: Plan) -> None:
        """Adopt the plan's update chunk (:attr:`chunk_numel`: elements per chunk of a staged
        update; staged bytes: 4 x this x (2 + optimizer-state vectors): master weights, state, one
        temporary) and how far an update runs beside the next block's backward (:attr:`overlap`)."""
        self.chunk_numel = int(plan.update_chunk_numel or DEFAULT_CHUNK_NUMEL)
        self.overlap = plan.update_overlap

    def owns(self, index: int) -> bool:
        """Whether this process runs block ``index``'s optimizer update (and keeps its state)."""
        return self.owned is None or index in self.owned

    def begin_step(self, slots: list[BlockSlot], *, micro: int, micro_count: int) -> None:
        """Micro-batch ``micro`` of ``micro_count`` in the step; the first one starts the sums."""
        if not 0 <= micro < micro_count:
            raise ValueError(f"micro-batch {micro} of {micro_count}")
        self.micro, self.micro_count = micro, micro_count
        if micro == 0:
            self.blocks_updated = 0
            for s in slots:
                s.accumulated = set()

    def update(self, slot: BlockSlot, grads: list[torch.Tensor | None]) -> None:
        """Reduce ``grads`` and hand the block's optimizer update (or, before the last micro-batch
        of a step, the accumulation of its gradients) to the update thread.

        The reduction (a collective when a process group is set) and the copy of the gradients
        off a GPU run on the calling thread, in block order; the update itself runs on one
        background thread while the backward of the next block proceeds (as far as
        :attr:`overlap` allows: with ``RECOMPUTE`` the next block calls :meth:`before_gradients`
        before its gradients exist, with ``NONE`` this call returns when the update is done).
        :meth:`wait` waits for it. The reservation ``grads:<block>`` is released when the
        gradients are no longer held in the compute tier. A block another rank owns (ZeRO-1) is
        not updated here: after the reduction its gradients are dropped (the owner broadcasts
        the new weights after the step).
        """
        present = [i for i, g in enumerate(grads) if g is not None]
        gl = [grads[i] for i in present]
        final = self.micro == self.micro_count - 1
        self.blocks_updated += final
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
        if self.overlap is UpdateOverlap.NONE:  # the plan has no room for them in the next backward
            self.wait()

    def before_gradients(self) -> None:
        """Called by a block's backward before its gradients are reserved: with updates that
        overlap only the next block's recompute, the update still running finishes here."""
        if self.overlap is UpdateOverlap.RECOMPUTE:
            self.wait()

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
        """The update in chunks of :attr:`chunk_numel` elements: each chunk's vectors (master weights
        and optimizer state, or the gradient accumulator) are read, updated and written back.

        A CPU run stages the chunks in the compute tier's own memory and runs them one at a time
        on this thread (one chunk staged, plus one temporary of the update: what the planner
        counts); handing each chunk's reads and writes to other threads cost more CPU time than
        it hid on a CPU run, where the reads are copies from the page cache. A GPU run's update
        stages in host memory and pipelines the chunks on the I/O threads
        (:meth:`_pipelined_chunks`).
        """
        flat_grads = {i: g.reshape(-1) for i, g in zip(present, gl)}
        kinds = ("param", *self.optimizer.state_kinds) if final else ()
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
        try:
            if self.device.type == "cpu":
                self._staged_chunks(slot, chunks, flat_grads, had, kinds, final)
            else:
                self._pipelined_chunks(slot, chunks, flat_grads, had, kinds, final)
        finally:
            self.store.drop_pages(slot.index, (*kinds, ACCUMULATOR))

    def _staged_chunks(self, slot: BlockSlot, chunks: list, flat_grads: dict[int, torch.Tensor], had: frozenset[int],
                       kinds: tuple[str, ...], final: bool) -> None:
        """The chunks one after another on this thread, each staged in the compute tier (a CPU run)."""
        key = f"staging:{slot.name}"
        room: dict[str, torch.Tensor] = {}   # one staging set, allocated once per update
        n = min(self.chunk_numel, slot.numel)
        for a, b, parts, read_acc in chunks:
            self.ledger.reserve(key, 4 * n * (len(kinds) + read_acc))
            try:
                bufs = self._read_chunk(slot.index, kinds, read_acc, a, b - a, room, n)
                self._write_chunk(slot.index, a, self._update_chunk(slot, a, b, parts, bufs, flat_grads, had, kinds,
                                                                    final, key))
            finally:
                self.ledger.release(key)

    def _pipelined_chunks(self, slot: BlockSlot, chunks: list, flat_grads: dict[int, torch.Tensor],
                          had: frozenset[int], kinds: tuple[str, ...], final: bool) -> None:
        """The chunks pipelined on the I/O threads (a GPU run; staged in host memory): while chunk
        ``i`` is updated, chunk ``i + 1`` is read, and chunk ``i``'s writes run behind; chunk ``i + 1``'s
        reads start only once chunk ``i - 1``'s writes are done, so at most two chunks' vectors are
        staged at once."""
        inflight: dict[int, tuple[Future, list[Future]]] = {}  # chunk -> (reads, writes)
        buffers: list[dict[str, torch.Tensor]] = [{}, {}]  # two staging sets, allocated once per update
        n = min(self.chunk_numel, slot.numel)

        def start_reads(j: int) -> None:
            a, b, _, read_acc = chunks[j]
            inflight[j] = (self._io.submit(self._read_chunk, slot.index, kinds, read_acc, a, b - a, buffers[j % 2], n),
                           [])

        def finish(j: int) -> None:
            """Wait for chunk ``j``'s reads and writes."""
            reads, writes = inflight.pop(j)
            for f in [reads, *writes]:
                f.result()

        try:
            if chunks:
                start_reads(0)
            for j, (a, b, parts, _) in enumerate(chunks):
                bufs = inflight[j][0].result()
                if j >= 1:
                    finish(j - 1)  # its writes are done before the next chunk's reads take its room
                if j + 1 < len(chunks):
                    start_reads(j + 1)
                writes = self._update_chunk(slot, a, b, parts, bufs, flat_grads, had, kinds, final, None)
                inflight[j][1].append(self._io.submit(self._write_chunk, slot.index, a, writes))
                del bufs, writes
        finally:
            for j in sorted(inflight):
                finish(j)

    def _update_chunk(self, slot: BlockSlot, a: int, b: int, parts: list, bufs: dict[str, torch.Tensor],
                      flat_grads: dict[int, torch.Tensor], had: frozenset[int], kinds: tuple[str, ...], final: bool,
                      temp_key: str | None) -> dict[str, torch.Tensor]:
        """Update the chunk ``a .. b`` read into ``bufs`` (or add its gradients to the accumulator
        before the last micro-batch); returns the vectors to write back. ``temp_key``: reserve the
        update's one chunk-sized temporary (the foreach AdamW's sqrt) under this name."""
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
        if not final:
            return {ACCUMULATOR: bufs[ACCUMULATOR][:b - a]}
        if temp_key is not None:
            self.ledger.reserve(f"{temp_key}:temp", 4 * (b - a))
        try:
            update_block(self.optimizer, pieces["param"], gp, {k: pieces[k] for k in self.optimizer.state_kinds},
                         sp, lr=self.lr)
        finally:
            if temp_key is not None:
                self.ledger.release(f"{temp_key}:temp")
        return {k: bufs[k][:b - a] for k in kinds}

    def _read_chunk(self, block: int, kinds: tuple[str, ...], read_acc: bool, start: int, count: int,
                    room: dict[str, torch.Tensor], room_numel: int) -> dict[str, torch.Tensor]:
        """Read one chunk of each of ``kinds`` (and of the accumulator when ``read_acc``) into
        ``room``, whose vectors of ``room_numel`` elements are allocated on first use; one call
        reads a chunk's vectors one after another (one I/O task on the pipelined path)."""
        reads = [*kinds, ACCUMULATOR] if read_acc else list(kinds)
        for k in reads:
            if k not in room:
                room[k] = torch.empty(room_numel, dtype=torch.float32)
        return {k: self.store.read_range(block, k, start, count, room[k][:count], drop=False) for k in reads}

    def _write_chunk(self, block: int, start: int, values: dict[str, torch.Tensor]) -> None:
        """Write one chunk of each vector in ``values`` back (one I/O task)."""
        for k, v in values.items():
            self.store.write_range(block, k, start, v, drop=False)

    def close(self) -> None:
        """Wait for the updates in flight and stop the update and I/O threads."""
        self.wait()
        self._updater.shutdown(wait=True)
        self._io.shutdown(wait=True)
