"""Where each block's weights are: the residency coordinator of the streaming executor.

The :class:`ResidencyCoordinator` brings blocks' master weights from the
:class:`~edgeadapt.server.store.StateStore` into the compute tier (``fetch`` on a background
thread, ``prefetch`` ahead of use in the plan's order, ``acquire`` when a block runs) and frees
them (``release``), and keeps the :class:`~edgeadapt.server.residency.MemoryLedger` account of
every byte it holds there: weights of resident and in-flight blocks and the step's activations
(each storage charged once). It knows nothing of autograd or of the optimizer (see
:mod:`edgeadapt.server.block_autograd` and :mod:`edgeadapt.server.updater`).
"""

from __future__ import annotations

import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from torch import nn

from ..memory import AnonHighWater
from ..sched.plan import Plan
from .residency import MemoryLedger, Residency
from .store import StateStore
from .trace import Block

__all__ = ["BlockSlot", "ResidencyCoordinator", "bind_parameters", "storage_ptr"]


@dataclass
class BlockSlot:
    """One block's layout and working state.

    Attributes:
        index: position in the block list (the store's key).
        name: module path.
        module: the block module (its own parameters are empty placeholders).
        local_names: parameter names relative to the block.
        shapes: parameter shapes.
        offsets: start of each parameter in the flat vector.
        numel: elements of the flat vector.
        state: residency.
        flat: compute-tier flat weights (``None`` when offloaded).
        leaves: per-parameter views of ``flat`` that require grad.
        future: the weights' load in flight (prefetch thread).
        steps: optimizer steps taken per parameter.
        full_names: parameter names relative to the model.
        resident: the root block (parameters outside every streamed block).
        placeholders: the root block's empty parameters, bound while its weights are away.
        accumulated: parameters whose gradients earlier micro-batches of the step accumulated.
    """

    index: int
    name: str
    module: nn.Module
    local_names: tuple[str, ...]
    shapes: tuple[torch.Size, ...]
    offsets: tuple[int, ...]
    numel: int
    state: Residency = Residency.OFFLOADED
    flat: torch.Tensor | None = None
    leaves: list[torch.Tensor] | None = None
    future: Future | None = None
    steps: list[int] = field(default_factory=list)
    full_names: tuple[str, ...] = ()
    resident: bool = False
    placeholders: list[torch.Tensor] | None = None
    accumulated: set[int] = field(default_factory=set)

    @classmethod
    def of(cls, index: int, block: Block) -> BlockSlot:
        """The slot of ``block`` (its parameters laid out one after another in a flat vector)."""
        shapes = tuple(p.shape for p in block.parameters())
        offsets, o = [], 0
        for s in shapes:
            offsets.append(o)
            o += s.numel()
        return cls(index, block.name, block.module, block.local_names, shapes, tuple(offsets), o,
                   steps=[0] * len(shapes), full_names=block.param_names, resident=block.resident)

    @property
    def weight_bytes(self) -> int:
        return 4 * self.numel

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Per-parameter views of a flat vector of this block's layout."""
        return [flat[o:o + s.numel()].view(s) for o, s in zip(self.offsets, self.shapes)]


def storage_ptr(t: torch.Tensor) -> int:
    """The address of ``t``'s storage (the key under which its bytes are charged once)."""
    return t.untyped_storage().data_ptr()


def bind_parameters(module: nn.Module, names: tuple[str, ...], tensors: list[torch.Tensor]) -> None:
    """Register ``tensors`` as the parameters ``names`` (dotted paths under ``module``)."""
    for n, t in zip(names, tensors):
        owner, _, leaf = n.rpartition(".")
        (module.get_submodule(owner) if owner else module)._parameters[leaf] = t


class ResidencyCoordinator:
    """Fetches, prefetches and releases blocks' weights in the compute tier, under the ledger.

    Args:
        slots: the blocks' slots.
        store: master weights (read from here).
        ledger: the compute tier's account.
        device: the compute device.
        probe: sampled at every block's fetch and release (the process's anonymous memory beside
            the ledger's account); ``None``: not sampled.
    """

    def __init__(self, slots: list[BlockSlot], store: StateStore, ledger: MemoryLedger, device: torch.device,
                 probe: AnonHighWater | None = None):
        self.slots, self.store, self.ledger, self.device = slots, store, ledger, device
        self.probe = probe
        self._by_name = {s.name: s for s in slots}
        self.schedule: list[int] = []
        self.depth = 1
        # storages charged this step (or charged otherwise), by data address: while the storage
        # recorded there is alive the memory is the same (a view, or another storage over it: two
        # tensors made from one numpy array); once it died, a storage at that address is new
        self._act_ptrs: dict[int, weakref.ref] = {}
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="edgeadapt-prefetch")
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def set_plan(self, plan: Plan) -> None:
        """Adopt the plan's block order (forward then backward) and prefetch depth."""
        order = [self._by_name[n].index for n in plan.order] if plan.order else [s.index for s in self.slots]
        order = [i for i in order if not self.slots[i].resident]
        self.schedule = order + order[::-1]
        self.depth = plan.prefetch_depth

    def index_of(self, name: str) -> int:
        """The index of block ``name``."""
        return self._by_name[name].index

    @property
    def weights_in_place(self) -> bool:
        """The blocks compute on the master weights themselves: a CPU run from the host tier, whose
        master weights already are in the memory the CPU computes in (no copy, no compute-tier
        bytes; each block's update comes after its backward, so no kept graph sees it change)."""
        return self.device.type == "cpu" and self.store.in_place()

    def _compute_buffer(self, slot: BlockSlot) -> torch.Tensor:
        """The compute-tier vector the block's weights are read into (runs on the calling thread).

        A block whose kept autograd graph still refers to its (emptied) weight storage gets that
        same storage back; otherwise a new vector is allocated. Allocating here, on the thread that
        enqueues the compute, keeps the caching allocator's stream order: memory just freed by that
        stream is handed out only behind the kernels that last used it (see :meth:`_load`).
        """
        if slot.flat is not None:
            st = slot.flat.untyped_storage()
            st.resize_(slot.weight_bytes)
            # a new tensor on the same storage: the copy into it leaves the version counter of the
            # weights the kept graph saved untouched
            return torch.empty(0, dtype=torch.float32, device=self.device).set_(st, 0, (slot.numel,))
        return torch.empty(slot.numel, dtype=torch.float32, device=self.device)

    def _load(self, slot: BlockSlot, dst: torch.Tensor, ready):
        """Read the block's master weights into ``dst`` (runs on the prefetch thread).

        On a GPU the copy runs on a side stream. ``dst`` may be memory the compute stream freed
        while kernels that read it were still queued, so the copy first waits for ``ready``, an
        event recorded on the compute stream after ``dst`` was allocated: without that wait the
        copy could overwrite a previous block's weights or activations under running kernels.

        Returns:
            ``(dst, event)``: the weights (for a refill, a tensor on the block's own storage) and,
            on a GPU, the event that marks the copy done.
        """
        ev = None
        with torch.no_grad():
            if self.device.type == "cpu":
                self.store.read(slot.index, "param", out=dst)
            else:
                host = self.store.read(slot.index, "param")
                if not host.is_pinned():
                    host = host.pin_memory()
                with torch.cuda.stream(self._copy_stream):
                    self._copy_stream.wait_event(ready)
                    dst.copy_(host, non_blocking=True)
                    ev = torch.cuda.Event()
                    ev.record(self._copy_stream)
                ev.synchronize()  # the pinned source must outlive the copy
        return dst, ev

    def prefetch(self, index: int) -> None:
        """Start bringing block ``index`` in (no-op unless offloaded)."""
        slot = self.slots[index]
        if slot.state is not Residency.OFFLOADED:
            return
        if self.weights_in_place:
            if slot.flat is None:
                slot.flat = self.store.read(slot.index, "param")
                slot.leaves = [v.requires_grad_() for v in slot.views(slot.flat)]
            slot.state = Residency.RESIDENT
            return
        key = f"weights:{slot.name}"
        self.ledger.reserve(key, slot.weight_bytes)
        try:
            dst = self._compute_buffer(slot)
            ready = None
            if self.device.type != "cpu":
                ready = torch.cuda.Event()
                ready.record(torch.cuda.current_stream(self.device))
        except BaseException:  # out of memory: nothing is in flight, so nothing else would release it
            self.ledger.release(key)
            raise
        slot.state = Residency.INFLIGHT
        slot.future = self._pool.submit(self._load, slot, dst, ready)

    def acquire(self, index: int) -> BlockSlot:
        """Block ``index`` resident (waiting for its prefetch, or loading it now)."""
        slot = self.slots[index]
        if slot.state is Residency.OFFLOADED:
            self.prefetch(index)
        if slot.state is Residency.INFLIGHT:
            flat, ev = slot.future.result()
            slot.future = None
            if ev is not None:
                torch.cuda.current_stream(self.device).wait_event(ev)
            if slot.flat is None:
                slot.flat = flat
                slot.leaves = [v.requires_grad_() for v in slot.views(flat)]
            slot.state = Residency.RESIDENT
        return slot

    def release(self, index: int, *, keep_storage_object: bool = False) -> None:
        """Free block ``index``'s compute copy. ``keep_storage_object``: free the bytes but keep
        the tensors (a kept autograd graph refers to them; the next load refills them)."""
        slot = self.slots[index]
        if self.probe is not None:  # the block's work is done: its gradients and activations are still here
            self.probe.sample()
        if slot.state is Residency.INFLIGHT:
            slot.future.result()
            slot.future = None
        if keep_storage_object and slot.flat is not None:
            if not self.weights_in_place:  # the master weights themselves are never freed
                slot.flat.untyped_storage().resize_(0)
        else:
            slot.flat, slot.leaves = None, None
        if slot.resident and slot.placeholders is not None:
            bind_parameters(slot.module, slot.local_names, slot.placeholders)
        self.ledger.release(f"weights:{slot.name}")
        slot.state = Residency.OFFLOADED

    def acquire_in_order(self, index: int, *, backward: bool) -> BlockSlot:
        """Block ``index`` resident, and the blocks after it in the schedule prefetched."""
        if self.probe is not None:
            self.probe.sample()
        slot = self.acquire(index)
        self._prefetch_after(self._position(index, backward))
        return slot

    def _prefetch_after(self, pos: int) -> None:
        seen = {self.schedule[pos]}
        for j in range(pos + 1, min(len(self.schedule), pos + 1 + self.depth)):
            k = self.schedule[j]
            if k not in seen:
                self.prefetch(k)
                seen.add(k)

    def _position(self, index: int, backward: bool) -> int:
        n = len(self.schedule) // 2
        half = self.schedule[n:] if backward else self.schedule[:n]
        try:
            return half.index(index) + (n if backward else 0)
        except ValueError:
            return len(self.schedule)

    def begin_step(self) -> None:
        """A new forward: nothing charged as activations yet; the first blocks prefetched."""
        self._act_ptrs = {}
        if self.schedule:
            self.prefetch(self.schedule[0])
            self._prefetch_after(0)

    def _charged(self, t: torch.Tensor) -> bool:
        ref = self._act_ptrs.get(storage_ptr(t))
        return ref is not None and ref() is not None

    def mark_charged(self, t: torch.Tensor) -> None:
        """Never charge ``t``'s storage as activations this step (it is charged otherwise)."""
        if not self._charged(t):
            self._act_ptrs[storage_ptr(t)] = weakref.ref(t.untyped_storage())

    def charge_activations(self, owner: str, tensors: list[torch.Tensor]) -> None:
        """Charge the storages among ``tensors`` not yet charged this step to ``owner`` (a storage
        at the address of one charged and freed before is new, and charged)."""
        total = 0
        for t in tensors:
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            ptr = storage_ptr(t)
            if ptr and not self._charged(t):
                self._act_ptrs[ptr] = weakref.ref(t.untyped_storage())
                total += t.untyped_storage().nbytes()
        if total:
            self.ledger.reserve(f"activations:{owner}", total)

    def release_all(self) -> None:
        """Release every block's weights still held (prefetches of blocks that did not run,
        graphs of a step that failed)."""
        for s in self.slots:
            if s.state is not Residency.OFFLOADED or s.flat is not None:
                self.release(s.index)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
