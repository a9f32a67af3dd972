"""The streaming executor: runs a model block by block with its state outside the compute tier.

Each block (see :mod:`edgeadapt.server.trace`) is wrapped so that calling it inside the
model's own ``forward`` goes through one ``torch.autograd.Function``:

* **forward**: the block's weights are brought into the compute tier (already in flight when
  the previous block prefetched them), the block runs on them, and the weights are released.
  With ``keep`` the block's autograd graph is kept (its weights' storage is freed and brought
  back for backward, so saved views stay valid); with ``recompute`` it runs without a graph
  and only its inputs are kept.
* **backward**: the weights come back, the block's gradient is computed (re-running its
  forward from the saved input first, with the same random numbers, when recomputed), the
  gradient leaves the compute tier, passes ``reduce(block_name, grads)`` (a no-op unless a
  process group is set) and the optimizer updates that block's master copy on the CPU
  straight away. Then weights and gradients are released.

So each block's update happens as soon as its gradient exists, which gives the same result as
one optimizer step after the whole backward (no block's backward reads another block's
weights). A block must run once per forward; gradient clipping by the global norm is not
possible in this scheme.

The root block (``Block.resident``: parameters outside every streamed block, e.g. a
positional embedding on the model itself) is not streamed: a forward pre-hook on the model
brings its weights in (and reserves its gradients) before the model's forward and binds them
to the owning modules as leaves, so that autograd accumulates their gradient over every use
(in the model's own code or passed into blocks); :meth:`StreamingExecutor.update_resident`,
called after the backward, hands that gradient to the same reduction and CPU update and
releases the weights.

Every byte the executor holds in the compute tier is reserved in the
:class:`~edgeadapt.server.residency.MemoryLedger` before it is allocated (weights, prefetched
weights, gradients, staged optimizer state) or charged as soon as it exists (activations:
every tensor autograd saves inside a block, the blocks' outputs, and what the ops between
blocks save), released when freed.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn.utils.stateless import _reparametrize_module

from ..sched.offload import DEFAULT_CHUNK_NUMEL
from ..sched.plan import Plan
from ..optimizer_config import OptimizerConfig
from .optim import update_block
from .residency import MemoryLedger, Residency
from .store import ACCUMULATOR, StateStore
from .trace import Block

__all__ = ["StreamingExecutor", "BlockSlot", "ReduceFn"]

log = logging.getLogger(__name__)

ReduceFn = Callable[[str, list[torch.Tensor]], None]


def _no_reduce(block_name: str, grads: list[torch.Tensor]) -> None:
    """Default gradient reduction: nothing (one process)."""


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
    event: object = None
    steps: list[int] = field(default_factory=list)
    full_names: tuple[str, ...] = ()
    resident: bool = False
    placeholders: list[torch.Tensor] | None = None
    accumulated: set[int] = field(default_factory=set)

    @property
    def weight_bytes(self) -> int:
        return 4 * self.numel

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat[o:o + s.numel()].view(s) for o, s in zip(self.offsets, self.shapes)]


def _storage_ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _storage_bytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


class _BlockFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, runner, anchor, *inputs):  # noqa: D401 - autograd protocol
        return runner.forward(ctx, inputs)

    @staticmethod
    def backward(ctx, *grads):
        return (None, None, *ctx.runner.backward(ctx, grads))


class StreamingExecutor:
    """Runs a model's blocks from a :class:`StateStore` under a :class:`MemoryLedger`.

    Args:
        blocks: the model's blocks (``find_blocks``); their parameters must be float32.
        store: master weights and optimizer state (filled by :meth:`load_weights`).
        ledger: the compute tier's account.
        device: the compute device.
        plan: the offload plan (order, prefetch depth, keep/recompute per block).
        optimizer: hyper-parameters.
        reduce: gradient reduction hook, called before each block's update.
        owned: the block indices whose optimizer update this process runs (ZeRO-1: another
            rank updates the others and broadcasts their weights, :mod:`edgeadapt.server.zero`);
            ``None``: every block.
    """

    def __init__(self, blocks: list[Block], store: StateStore, ledger: MemoryLedger, device: torch.device,
                 plan: Plan, optimizer: OptimizerConfig, reduce: ReduceFn | None = None,
                 owned=None):
        self.store, self.ledger, self.device, self.optimizer = store, ledger, device, optimizer
        self.reduce: ReduceFn = reduce or _no_reduce
        self.owned = None if owned is None else frozenset(owned)
        self.lr = optimizer.lr
        self.slots: list[BlockSlot] = []
        for i, b in enumerate(blocks):
            shapes = tuple(p.shape for p in b.parameters())
            offsets, o = [], 0
            for s in shapes:
                offsets.append(o)
                o += s.numel()
            self.slots.append(BlockSlot(i, b.name, b.module, b.local_names, shapes, tuple(offsets), o,
                                        steps=[0] * len(shapes), full_names=b.param_names, resident=b.resident))
        self._by_name = {s.name: s for s in self.slots}
        self.resident_slots = [s for s in self.slots if s.resident]
        self._root_hook = None
        self._hooks_on = True
        self._act_ptrs: dict[int, int] = {}
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="edgeadapt-prefetch")
        self._updater = ThreadPoolExecutor(max_workers=1, thread_name_prefix="edgeadapt-update")
        self._pending: list[Future] = []
        # the disk tier's update reads and writes its vectors (weights, moments) concurrently
        self._io = ThreadPoolExecutor(max_workers=4, thread_name_prefix="edgeadapt-io")
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.set_plan(plan)
        self._originals: dict[int, Callable] = {}
        self._ran: set[int] = set()
        self._act_keys: dict[int, set[int]] = {}
        self._anchor = torch.zeros((), requires_grad=True)
        self.micro, self.micro_count = 0, 1

    # ---- setup ------------------------------------------------------------------------
    def set_plan(self, plan: Plan) -> None:
        """Adopt a (re-)plan: order, prefetch depth, keep/recompute per block and the update chunk
        (:attr:`chunk_numel`: elements per chunk of a staged update; staged bytes: 4 x this x
        (2 + optimizer-state vectors): master weights, state, one temporary)."""
        self.plan = plan
        self.chunk_numel = int(plan.update_chunk_numel or DEFAULT_CHUNK_NUMEL)
        order = [self._by_name[n].index for n in plan.order] if plan.order else [s.index for s in self.slots]
        order = [i for i in order if not self.slots[i].resident]
        self.schedule = order + order[::-1]
        self.depth = plan.prefetch_depth
        self.recompute = {self._by_name[n].index for n in plan.recomputed}

    def load_weights(self, params: dict[str, torch.Tensor]) -> None:
        """Fill the store from full parameter tensors (``block.local`` names) and zero the
        optimizer state."""
        for s in self.slots:
            flat = torch.empty(s.numel, dtype=torch.float32)
            for v, n in zip(s.views(flat), s.full_names):
                v.copy_(params[n].detach().to(torch.float32))
            self.store.write(s.index, "param", flat)
            if self.owns(s.index):
                for k in self.optimizer.state_kinds:
                    self.store.write(s.index, k, torch.zeros(s.numel, dtype=torch.float32))

    def owns(self, index: int) -> bool:
        """Whether this process runs block ``index``'s optimizer update (and keeps its state)."""
        return self.owned is None or index in self.owned

    def install(self) -> None:
        """Route each block's calls through the executor and drop its own parameter storage; the
        root block's parameters are brought in by a forward pre-hook on the model."""
        for s in self.slots:
            if s.index in self._originals:
                continue
            mod = s.module
            self._originals[s.index] = type(mod).forward.__get__(mod)
            placeholders = [nn.Parameter(torch.empty(0), requires_grad=True) for _ in s.local_names]
            _bind(mod, s.local_names, placeholders)
            if s.resident:
                s.placeholders = placeholders
                if self._root_hook is None:
                    ex = self

                    def root_pre_hook(module, args):  # a plain function: a deepcopy of the model shares it
                        ex._load_resident()

                    self._root_hook = mod.register_forward_pre_hook(root_pre_hook)
            else:
                mod.forward = self._make_forward(s)

    @property
    def root_hook_id(self) -> int | None:
        """The id of the model's forward pre-hook (to remove it from a copy of the model)."""
        return None if self._root_hook is None else self._root_hook.id

    @contextlib.contextmanager
    def uninstalled(self):
        """The blocks' own forwards for the body (a shape trace of the model), the root hook off."""
        patched = {s.index: s.module.__dict__.pop("forward") for s in self.slots if "forward" in s.module.__dict__}
        self._hooks_on = False
        try:
            yield
        finally:
            self._hooks_on = True
            for s in self.slots:
                if s.index in patched:
                    s.module.forward = patched[s.index]

    # ---- the root block ---------------------------------------------------------------------
    def _load_resident(self) -> None:
        """Bring the root block in for the step (the model's forward pre-hook): its weights and,
        with gradients enabled, the reservation of its gradients, held until
        :meth:`update_resident` (or :meth:`end_step`)."""
        if not self._hooks_on:
            return
        grad = torch.is_grad_enabled()
        for s in self.resident_slots:
            if s.state is Residency.RESIDENT:
                continue  # a second forward in the same step: the gradients accumulate
            if grad:
                self.ledger.reserve(f"grads:{s.name}", s.weight_bytes)
            try:
                self.acquire(s.index)
            except BaseException:
                self.ledger.release(f"grads:{s.name}")
                raise
            if not grad:
                s.leaves = [v.detach() for v in s.leaves]
            # autograd keeps these leaves for backward: they are charged as weights, not activations
            self._act_ptrs.setdefault(_storage_ptr(s.flat), 0)
            _bind(s.module, s.local_names, s.leaves)

    def update_resident(self) -> None:
        """After the backward: reduce and update the root block with the gradient accumulated over
        the step, then release its weights (the gradients' reservation goes with the update)."""
        for s in self.resident_slots:
            if s.state is not Residency.RESIDENT or s.leaves is None:
                continue
            grads = [v.grad for v in s.leaves]
            for v in s.leaves:
                v.grad = None
            self.release(s.index)
            if all(g is None for g in grads):
                self.ledger.release(f"grads:{s.name}")
                continue
            self.update(s, grads)  # owns the gradients' reservation from here on
            del grads
    def _make_forward(self, slot: BlockSlot):
        def forward(*args, **kwargs):
            return self._call_block(slot, args, kwargs)
        return forward

    # ---- residency ----------------------------------------------------------------------
    def _load(self, slot: BlockSlot):
        """Read the block's master weights into the compute tier (runs on the prefetch thread).

        A block whose kept autograd graph still refers to its (emptied) weight storage gets the
        weights back into that same storage; otherwise a new vector is allocated.

        Returns:
            ``(flat, event)``: the weights and, on a GPU, the event that marks the copy done.
        """
        refill = slot.flat is not None
        if refill:
            st = slot.flat.untyped_storage()
            st.resize_(slot.weight_bytes)
            dst = torch.empty(0, dtype=torch.float32, device=self.device).set_(st, 0, (slot.numel,))
        else:
            dst = torch.empty(slot.numel, dtype=torch.float32, device=self.device)
        ev = None
        with torch.no_grad():
            if self.device.type == "cpu":
                self.store.read(slot.index, "param", out=dst)
            else:
                host = self.store.read(slot.index, "param")
                if not host.is_pinned():
                    host = host.pin_memory()
                with torch.cuda.stream(self._copy_stream):
                    dst.copy_(host, non_blocking=True)
                    ev = torch.cuda.Event()
                    ev.record(self._copy_stream)
                ev.synchronize()  # the pinned source must outlive the copy
        return (slot.flat if refill else dst), ev

    @property
    def weights_in_place(self) -> bool:
        """The blocks compute on the master weights themselves: a CPU run from the host tier, whose
        master weights already are in the memory the CPU computes in (no copy, no compute-tier
        bytes; each block's update comes after its backward, so no kept graph sees it change)."""
        return self.device.type == "cpu" and self.store.in_place()

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
        self.ledger.reserve(f"weights:{slot.name}", slot.weight_bytes)
        slot.state = Residency.INFLIGHT
        slot.future = self._pool.submit(self._load, slot)

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
        if slot.state is Residency.INFLIGHT:
            slot.future.result()
            slot.future = None
        if keep_storage_object and slot.flat is not None:
            if not self.weights_in_place:  # the master weights themselves are never freed
                slot.flat.untyped_storage().resize_(0)
        else:
            slot.flat, slot.leaves = None, None
        if slot.resident and slot.placeholders is not None:
            _bind(slot.module, slot.local_names, slot.placeholders)
        self.ledger.release(f"weights:{slot.name}")
        slot.state = Residency.OFFLOADED

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

    # ---- the step ---------------------------------------------------------------------------
    def begin_step(self, *, micro: int = 0, micro_count: int = 1) -> None:
        """Start a forward/backward: micro-batch ``micro`` of ``micro_count`` in the step. Each block's
        gradients are summed over a step's micro-batches in the store (:data:`ACCUMULATOR`) and the
        block is updated after the last one."""
        if not 0 <= micro < micro_count:
            raise ValueError(f"micro-batch {micro} of {micro_count}")
        self.micro, self.micro_count = micro, micro_count
        if micro == 0:
            for s in self.slots:
                s.accumulated = set()
        self._ran.clear()
        self._act_keys.clear()
        self._act_ptrs = {}
        if self.schedule:
            self.prefetch(self.schedule[0])
            self._prefetch_after(0)

    def wait_updates(self) -> None:
        """Wait for the step's optimizer updates; re-raises the first failure."""
        pending, self._pending = self._pending, []
        errors = [f.exception() for f in pending]
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first

    def end_step(self) -> None:
        """Wait for the updates and release whatever the step left behind (prefetches for blocks
        that did not run, graphs of a step that failed)."""
        self.wait_updates()
        for s in self.slots:
            if s.state is not Residency.OFFLOADED or s.flat is not None:
                self.release(s.index)
        for s in self.resident_slots:  # a step that failed before update_resident
            self.ledger.release(f"grads:{s.name}")
        for k in list(self._act_keys):
            self.ledger.release(f"activations:{self.slots[k].name}")
        self._act_keys.clear()

    def charge_activations(self, owner: str, tensors: list[torch.Tensor]) -> None:
        """Charge the storages among ``tensors`` not yet charged this step to ``owner``."""
        total = 0
        for t in tensors:
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            ptr = _storage_ptr(t)
            if ptr and ptr not in self._act_ptrs:
                self._act_ptrs[ptr] = _storage_bytes(t)
                total += self._act_ptrs[ptr]
        if total:
            self.ledger.reserve(f"activations:{owner}", total)

    def _call_block(self, slot: BlockSlot, args: tuple, kwargs: dict):
        if not torch.is_grad_enabled():  # inference (Trainer.predict): stream the weights, keep nothing
            self.acquire(slot.index)
            self._prefetch_after(self._position(slot.index, backward=False))
            try:
                return self._run(slot, args, kwargs, [v.detach() for v in slot.leaves])
            finally:
                self.release(slot.index)
        if slot.index in self._ran:
            raise RuntimeError(f"block {slot.name!r} ran twice in one step; the streaming trainer updates each "
                               "block once per step, so a block may be called only once per forward")
        self._ran.add(slot.index)
        tensor_pos = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        hidden = [t for i, a in enumerate(args) if i not in tensor_pos for t in _nested_tensors(a)]
        hidden += [t for v in kwargs.values() for t in _nested_tensors(v)]
        if any(t.requires_grad for t in hidden):
            raise TypeError(f"block {slot.name!r} is called with a tensor that needs a gradient inside a keyword "
                            "argument or a container; the streaming trainer passes gradients through positional "
                            "tensor arguments only, so pass it positionally")
        runner = _Call(self, slot, args, kwargs, tensor_pos)
        # the anchor requires grad so that the block's backward runs even when no input needs a
        # gradient (the first block): the block's parameters are not inputs of the Function
        outs = _BlockFn.apply(runner, self._anchor, *[args[i] for i in tensor_pos])
        return outs[0] if runner.single else outs

    def _run(self, slot: BlockSlot, args: tuple, kwargs: dict, params: list[torch.Tensor],
             buffers: dict[str, torch.Tensor] | None = None):
        mapping = dict(zip(slot.local_names, params))
        if buffers:
            mapping.update(buffers)
        with _reparametrize_module(slot.module, mapping, strict=False):
            return self._originals[slot.index](*args, **kwargs)

    def update(self, slot: BlockSlot, grads: list[torch.Tensor | None]) -> None:
        """Reduce ``grads`` and hand the block's optimizer update (or, before the last micro-batch
        of a step, the accumulation of its gradients) to the update thread.

        The reduction (a collective when a process group is set) and the copy of the gradients
        off a GPU run on the calling thread, in block order; the update itself runs on one
        background thread while the backward of the next block proceeds. :meth:`end_step`
        waits for it. The reservation ``grads:<block>`` is released when the gradients are
        no longer held in the compute tier. A block another rank owns (ZeRO-1) is not updated
        here: after the reduction its gradients are dropped (the owner broadcasts the new
        weights after the step).
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
        self.wait_updates()  # at most one update in flight: the planner counts one block's gradients
        self._pending.append(self._updater.submit(self._apply, slot, present, gl, had, final))

    def _apply(self, slot: BlockSlot, present: list[int], gl: list[torch.Tensor], had: frozenset[int],
               final: bool) -> None:
        """The optimizer update of one block, or the accumulation of its gradients (update thread).

        ``had``: the parameters whose gradients earlier micro-batches of this step accumulated.
        The accumulator holds ``g1``, then ``g1 + g2``, ...; the last micro-batch's gradient is
        added to it and the sum updates the block (the order of torch's own ``p.grad``
        accumulation). Host tier: in place on the master tensors. Disk tier: in chunks of
        :attr:`chunk_numel` elements (read, updated and written back a chunk at a time; the
        update is elementwise, so chunking changes no bit).
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
        self.wait_updates()
        if self._root_hook is not None:
            self._root_hook.remove()
            self._root_hook = None
        self._pool.shutdown(wait=True)
        self._updater.shutdown(wait=True)
        self._io.shutdown(wait=True)


class _Call:
    """One call of one block: carries state from the autograd forward to its backward."""

    def __init__(self, ex: StreamingExecutor, slot: BlockSlot, args: tuple, kwargs: dict, tensor_pos: list[int]):
        self.ex, self.slot, self.args, self.kwargs, self.tensor_pos = ex, slot, args, kwargs, tensor_pos
        self.single = True

    def _args_with(self, tensors) -> tuple:
        args = list(self.args)
        for i, t in zip(self.tensor_pos, tensors):
            args[i] = t
        return tuple(args)

    def forward(self, ctx, inputs: tuple[torch.Tensor, ...]):
        ex, slot = self.ex, self.slot
        ctx.runner = self
        ex.acquire(slot.index)
        ex._prefetch_after(ex._position(slot.index, backward=False))
        self.recompute = slot.index in ex.recompute
        if self.recompute:
            self.rng = _rng_state(ex.device)
            with torch.no_grad():
                out = ex._run(slot, self._args_with(inputs), self.kwargs, slot.leaves)
            self.inputs = inputs
            outs = _as_tuple(out)
            ex.charge_activations(slot.name, list(outs))
            ex.release(slot.index)
        else:
            xs = [t.detach().requires_grad_(t.requires_grad or ctx.needs_input_grad[2 + j])
                  if t.is_floating_point() else t.detach() for j, t in enumerate(inputs)]
            saved: list[torch.Tensor] = []
            skip = {_storage_ptr(slot.flat)} | {_storage_ptr(t) for t in inputs}
            skip |= {_storage_ptr(b) for b in slot.module.buffers()}

            def pack(t):
                if _storage_ptr(t) not in skip:
                    saved.append(t)
                return t

            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = ex._run(slot, self._args_with(xs), self.kwargs, slot.leaves)
            outs = _as_tuple(out)
            self.xs, self.inner = xs, outs
            ex.charge_activations(slot.name, saved + list(outs))
            ex.release(slot.index, keep_storage_object=True)
        self.single = isinstance(out, torch.Tensor)
        ex._act_keys.setdefault(slot.index, set())
        result = tuple(o.detach() for o in outs)
        nondiff = [o for o in result if not o.is_floating_point()]
        if nondiff:
            ctx.mark_non_differentiable(*nondiff)
        return result

    def backward(self, ctx, grads):
        ex, slot = self.ex, self.slot
        ex.acquire(slot.index)
        ex._prefetch_after(ex._position(slot.index, backward=True))
        need_in = [bool(n) for n in ctx.needs_input_grad[2:]]
        if self.recompute:
            xs = [t.detach().requires_grad_(need) if t.is_floating_point() else t.detach()
                  for t, need in zip(self.inputs, need_in)]
            buffers = {n: b.clone() for n, b in slot.module.named_buffers()}
            with _fork_rng(ex.device, self.rng), torch.enable_grad():
                outs = _as_tuple(ex._run(slot, self._args_with(xs), self.kwargs, slot.leaves, buffers))
            self.inputs = None
        else:
            xs, outs = self.xs, self.inner
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
        wrt_in = [x for x, need in zip(xs, need_in) if need and x.requires_grad]
        ex.ledger.reserve(f"grads:{slot.name}", slot.weight_bytes)
        try:
            if pairs:
                got = torch.autograd.grad([o for o, _ in pairs], slot.leaves + wrt_in, [g for _, g in pairs],
                                          allow_unused=True)
            else:
                got = (None,) * (len(slot.leaves) + len(wrt_in))
            del pairs, outs
            self.xs = self.inner = None
            pgrads, igrads = list(got[:len(slot.leaves)]), list(got[len(slot.leaves):])
            del got
            ex.release(slot.index)
            ex.ledger.release(f"activations:{slot.name}")
            ex._act_keys.pop(slot.index, None)
        except BaseException:
            ex.ledger.release(f"grads:{slot.name}")
            raise
        ex.update(slot, pgrads)  # owns the gradients' reservation from here on
        del pgrads
        it = iter(igrads)
        return tuple(next(it) if need and x.requires_grad else None for x, need in zip(xs, need_in))


def _bind(module: nn.Module, names: tuple[str, ...], tensors: list[torch.Tensor]) -> None:
    """Register ``tensors`` as the parameters ``names`` (dotted paths under ``module``)."""
    for n, t in zip(names, tensors):
        owner, _, leaf = n.rpartition(".")
        (module.get_submodule(owner) if owner else module)._parameters[leaf] = t


def _nested_tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _nested_tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _nested_tensors(v)]
    return []


def _as_tuple(out) -> tuple[torch.Tensor, ...]:
    if isinstance(out, torch.Tensor):
        return (out,)
    if isinstance(out, (tuple, list)) and all(isinstance(o, torch.Tensor) for o in out):
        return tuple(out)
    raise TypeError(f"a streamed block must return a tensor or a tuple of tensors, got {type(out).__name__}")


def _rng_state(device: torch.device):
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


@contextlib.contextmanager
def _fork_rng(device: torch.device, state):
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], device)
        yield
