"""The server-side ``Trainer``: full training of every parameter, streamed through a budget.

Typical use::

    from edgeadapt.server import Trainer
    t = Trainer(model, loss="cross_entropy", optimizer="adamw", memory_budget="64MiB",
                offload="disk", offload_dir="runs/x/state", device="auto", example_input=x)
    loss = t.step(x, y)               # one optimizer step
    t.tracked_peak_bytes              # most bytes ever held in the compute tier
    t.process_peak_bytes              # the process's anonymous memory at its highest, over the loaded trainer
    t.gpu_peak_bytes                  # on a GPU: the CUDA allocator's peak over the loaded trainer
    t.save_checkpoint("runs/x/ckpt")  # atomic, resumable with Trainer.resume

With ``offload="host"`` or ``"disk"`` the :class:`~edgeadapt.server.executor.StreamingExecutor`
keeps master weights and AdamW state in that tier and streams blocks through the compute
device as :func:`edgeadapt.sched.offload.plan_offload` decides; ``offload=None`` trains in
memory with ``torch.optim.AdamW(foreach=True)`` (the baseline, and what a model that fits
uses). The trainer takes the model over: with offload its parameters' storage is dropped and
:meth:`Trainer.model` returns a module with the current weights.

Gradient reduction: before each block's optimizer update the trainer calls
``self._reduce(block_name, grads)``, a no-op by default. With ``process_group`` it becomes
``edgeadapt.server.distributed.allreduce_gradients(block_name, grads, group=process_group)``,
which must average ``grads`` in place across the group. With ``shard_optimizer_state=True``
(ZeRO-1, :mod:`edgeadapt.server.zero`) each rank keeps the optimizer state of its own blocks
only: the hook reduces each block's gradients onto its owner, the owner updates it, and after
the step every block's owner broadcasts its new weights.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from ..memory import AnonHighWater
from ..sched.ir import Graph
from ..sched.offload import plan_offload
from ..sched.plan import Plan
from ..units import format_bytes, parse_bytes
from . import checkpoint as _ckpt
from .allocator import DISK_MMAP_THRESHOLD_BYTES, set_mmap_threshold
from .device_memory import CudaAllocatedPeak
from .executor import StreamingExecutor
from ..optimizer_config import OptimizerConfig
from .residency import LOSS_KEY, MemoryLedger
from .steps import InMemorySteps, StepStrategy, StreamedSteps
from .store import DiskStore, HostStore
from .loss_memory import TargetKind
from .trace import Block, find_blocks, nested_tensors, trace_graph

__all__ = ["Trainer", "resolve_device", "LOSSES", "offload_plan", "plan_training"]

log = logging.getLogger(__name__)

LOSSES: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "cross_entropy": lambda out, y: nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1)),
    "mse": nn.functional.mse_loss,
    "bce_with_logits": nn.functional.binary_cross_entropy_with_logits,
}
LOSS_TARGETS: dict[str, TargetKind] = {"cross_entropy": "class", "mse": "like", "bce_with_logits": "like"}
"""The targets' kind of each built-in loss (the loss's memory is traced before targets are seen)."""


def resolve_device(device: str | torch.device) -> torch.device:
    """``"auto"`` -> CUDA when torch sees a GPU, else CPU; ``"cuda"`` without one raises.

    Raises:
        DeviceUnavailableError: ``"cuda"`` (or ``"cuda:N"``) requested and torch has no CUDA
            device (the same error class as the on-device runner's).
        ValueError: an unknown device string.
    """
    name = str(device)
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cpu":
        return torch.device("cpu")
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            from ..runtime.errors import DeviceUnavailableError

            raise DeviceUnavailableError(
                f"device {name!r} was requested but this torch build ({torch.__version__}) sees no CUDA device; "
                "install a CUDA build of torch on a machine with a GPU, or use --device cpu / device='cpu'")
        return torch.device(name)
    raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {device!r}")


def offload_plan(graph: Graph, batch: int, *, budget_bytes: int | None, offload: str, device: torch.device,
                 optimizer: str = "adamw", recompute: bool | str = "auto", prefetch_depth: int = 1,
                 buffer_bytes: int = 0, update_chunk_numel: int | None = None,
                 max_micro_batches: int | None = None) -> Plan:
    """The plan the :class:`Trainer` follows for steps of ``batch`` windows (its arguments of the
    same names; ``graph`` from :func:`~edgeadapt.server.trace.trace_graph`); see
    :func:`edgeadapt.sched.offload.plan_offload`.

    Raises:
        NoFeasiblePlan: no plan fits ``budget_bytes``; names the smallest budget that does.
    """
    plan = plan_offload(
        graph, budget_bytes or 2**62, batch_windows=batch, tier=offload, optimizer=optimizer, recompute=recompute,
        prefetch_depth=prefetch_depth, resident_bytes=buffer_bytes,
        staging=offload == "disk" and device.type == "cpu",
        staging_chunk_bytes=None if update_chunk_numel is None else 4 * update_chunk_numel,
        max_micro_batches=batch if max_micro_batches is None else min(batch, max_micro_batches),
        weights_in_place=offload == "host" and device.type == "cpu")
    log.info("offload plan for %d windows: predicted peak %s at %s, prefetch %d, update chunk %d, "
             "micro-batches of %d, update overlap %s, recompute %s", batch, format_bytes(plan.predicted.peak_bytes),
             plan.predicted.where, plan.prefetch_depth, plan.update_chunk_numel, plan.micro_batch_windows,
             plan.update_overlap.value, list(plan.recomputed))
    return plan


def resolve_loss(loss: str | Callable) -> tuple[str, Callable]:
    """``(name, fn)`` of a loss given by name (a key of :data:`LOSSES`) or as ``fn(output, target)``
    (named by its ``__name__``, else ``custom``)."""
    if isinstance(loss, str):
        if loss not in LOSSES:
            raise ValueError(f"loss must be one of {sorted(LOSSES)} or a callable, got {loss!r}")
        return loss, LOSSES[loss]
    return getattr(loss, "__name__", "custom"), loss


MAX_KEPT_SHAPES = 16
"""Window shapes whose graph and plans a trainer keeps besides the current one (each new shape is
traced, about a second; batches of many lengths are best padded to a few)."""


def window_shapes(tensors) -> tuple:
    """The shape of one window of each input tensor (every axis after the batch's) and its dtype:
    what a traced graph's per-window bytes depend on."""
    return tuple((tuple(t.shape[1:]), str(t.dtype)) for t in tensors)


def plan_training(model: nn.Module, example_input, *, offload: str = "host", memory_budget: int | str | None = None,
                  device: str = "auto", optimizer: str = "adamw", recompute: bool | str = "auto",
                  prefetch_depth: int = 1, update_chunk_numel: int | None = None,
                  max_micro_batches: int | None = None, loss: str | Callable = "cross_entropy",
                  example_target: torch.Tensor | None = None) -> Plan:
    """The plan ``Trainer(model, loss, ..., example_input=example_input)`` would follow for batches
    like ``(example_input, example_target)``, without building the trainer (no state is written;
    the model is not changed). ``example_target``: ``None`` guesses the targets' shape (see
    :func:`~edgeadapt.server.trace.trace_graph`)."""
    if offload not in ("host", "disk"):
        raise ValueError(f"a plan is made for offload 'host' or 'disk', got {offload!r}")
    blocks = find_blocks(model)
    whole = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    name, loss_fn = resolve_loss(loss)
    compute = resolve_device(device)
    graph = trace_graph(model, example_input, blocks, loss_fn=loss_fn, device=compute,
                        target=LOSS_TARGETS.get(name) if example_target is None else example_target)
    if not graph.loss_peak_bytes and example_target is None and name not in LOSS_TARGETS:
        log.warning("the loss %r could not be measured with guessed targets: its memory is not in this plan; pass "
                    "example_target", name)
    return offload_plan(graph, int(nested_tensors(example_input)[0].shape[0]),
                        budget_bytes=None if memory_budget is None else parse_bytes(memory_budget),
                        offload=offload, device=compute, optimizer=optimizer, recompute=recompute,
                        prefetch_depth=prefetch_depth,
                        buffer_bytes=sum(b.numel() * b.element_size() for b in model.buffers()),
                        update_chunk_numel=update_chunk_numel, max_micro_batches=1 if whole else max_micro_batches)


class Trainer:
    """Full training of ``model`` under a compute-memory budget, optionally offloaded.

    Args:
        model: the model; every parameter is trained; parameters must be float32 (see
            :func:`edgeadapt.server.trace.find_blocks` for how the model is cut into blocks;
            parameters outside every block are held in the compute tier for the whole step).
        loss: ``"cross_entropy"``, ``"mse"``, ``"bce_with_logits"`` or ``fn(output, target)``.
        optimizer: ``"adamw"``/``"sgd"``, a dict of its fields or an
            :class:`~edgeadapt.optimizer_config.OptimizerConfig`.
        memory_budget: compute-tier budget (``"64MiB"`` or bytes); ``None``: unlimited.
        offload: ``"host"``, ``"disk"`` or ``None`` (train in memory).
        offload_dir: the disk tier's folder (required for ``"disk"``).
        device: ``"auto"``, ``"cpu"`` or ``"cuda"``.
        recompute: ``"auto"`` (default: the planner recomputes only what the budget needs),
            ``False`` (never) or ``True`` (every block).
        process_group: a ``torch.distributed`` group to average gradients over.
        shard_optimizer_state: ZeRO-1 (needs ``offload="host"`` or ``"disk"``): each rank of
            ``process_group`` keeps the optimizer state of, and updates, only the blocks
            assigned to it (balanced by bytes, :func:`edgeadapt.server.zero.assign_blocks`);
            the owner broadcasts the updated weights. Every rank still holds all master weights.
            ``False`` (default): every rank keeps all state and runs every update.
        example_input: one batch (or tuple of inputs) to trace the model; the first
            :meth:`step` batch is used when omitted.
        prefetch_depth: the deepest prefetch (blocks brought in ahead of use); the planner
            lowers it when a deeper one does not fit.
        update_chunk_numel: the disk tier updates master weights and optimizer state this many
            elements at a time (bounds the staged bytes; the result does not depend on it);
            ``None`` (default): chosen by the planner.
        max_micro_batches: the most micro-batches the planner may split a step into when a whole
            batch does not fit (gradients accumulated per block in the state's tier, one update
            after the last; see :meth:`step`); ``None`` (default): up to one window each; 1: never.
            Models with BatchNorm and data-parallel runs always take whole batches (batch
            statistics and the per-block reduction are per batch).
        malloc_mmap_threshold_bytes: with offload, fix glibc's mmap threshold at this size so
            that freed blocks return to the OS and the process peak follows the tracked peak
            (process-wide; see :mod:`edgeadapt.server.allocator`); ``None`` leaves malloc alone;
            ``"auto"`` (default): 256 KiB on the disk tier, malloc left alone on the host tier
            (whose state is process memory already: there the fixed threshold cost 25-40 %
            more CPU time per step in page faults and did not lower the process peak).

    Raises:
        BudgetExceeded: the budget cannot hold the largest block (named), or one step.
        OffloadDirError: the disk tier's folder is not writable or too full.
        DeviceUnavailableError: ``device="cuda"`` without CUDA.
    """

    def __init__(self, model: nn.Module, loss: str | Callable = "cross_entropy", optimizer=None, *,
                 memory_budget: int | str | None = None, offload: str | None = "host",
                 offload_dir: str | os.PathLike | None = None, device: str = "auto",
                 recompute: bool | str = "auto", process_group=None, example_input=None, prefetch_depth: int = 1,
                 update_chunk_numel: int | None = None, malloc_mmap_threshold_bytes: int | str | None = "auto",
                 shard_optimizer_state: bool = False, max_micro_batches: int | None = None):
        if offload not in ("host", "disk", None):
            raise ValueError(f"offload must be 'host', 'disk' or None, got {offload!r}")
        if shard_optimizer_state and offload is None:
            raise ValueError("shard_optimizer_state=True (ZeRO-1) shards the streaming trainer's optimizer state: "
                             "use offload='host' or 'disk' (--offload host|disk)")
        if recompute not in (False, True, "auto"):
            raise ValueError(f"recompute must be False, True or 'auto', got {recompute!r}")
        if max_micro_batches is not None and int(max_micro_batches) < 1:
            raise ValueError(f"max_micro_batches must be >= 1 (or None), got {max_micro_batches}")
        if offload == "disk" and offload_dir is None:
            raise ValueError("offload='disk' needs offload_dir, the folder for the state files")
        self.device = resolve_device(device)
        self.spec: OptimizerConfig = OptimizerConfig.coerce("adamw" if optimizer is None else optimizer)
        self.loss_name, self.loss_fn = resolve_loss(loss)
        self.offload, self.recompute, self.prefetch_depth = offload, recompute, int(prefetch_depth)
        if update_chunk_numel is not None and int(update_chunk_numel) < 1:
            raise ValueError(f"update_chunk_numel must be >= 1, got {update_chunk_numel}")
        self.chunk_numel = None if update_chunk_numel is None else int(update_chunk_numel)
        if malloc_mmap_threshold_bytes == "auto":
            malloc_mmap_threshold_bytes = DISK_MMAP_THRESHOLD_BYTES if offload == "disk" else None
        elif malloc_mmap_threshold_bytes is not None and not isinstance(malloc_mmap_threshold_bytes, int):
            raise ValueError("malloc_mmap_threshold_bytes must be a number of bytes, None or 'auto', got "
                             f"{malloc_mmap_threshold_bytes!r}")
        if offload is not None and malloc_mmap_threshold_bytes is not None:
            set_mmap_threshold(malloc_mmap_threshold_bytes)
        self.budget_bytes = None if memory_budget is None else parse_bytes(memory_budget)
        self.ledger = MemoryLedger(self.budget_bytes)
        self.step_count = 0
        self.checkpoint_extra: dict = {}
        self._unusable: str | None = None  # why no step may run (closed, or a step failed half-applied)
        self._closed = False  # close() dropped the state: nothing that reads it may run
        self._reduce: Callable[[str, list[torch.Tensor]], None] = lambda name, grads: None
        self.sharding = None  # ZeRO-1: set up below, once the blocks are known
        if process_group is not None and not shard_optimizer_state:
            from .distributed import allreduce_gradients

            self._reduce = lambda name, grads: allreduce_gradients(name, grads, group=process_group)
        self.process_group = process_group

        self.blocks: list[Block] = find_blocks(model)
        bad = [n for n, p in model.named_parameters() if p.dtype != torch.float32]
        if bad:
            raise TypeError(f"parameters {bad[:4]} are not float32; the trainer keeps float32 master weights "
                            "(convert with model.float())")
        self.param_shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
        whole = process_group is not None or any(isinstance(m, nn.modules.batchnorm._BatchNorm)
                                                 for m in model.modules())
        self.max_micro_batches = 1 if whole else max_micro_batches
        self._model = model
        self._graph: Graph | None = None
        self._plans: dict[int, Plan] = {}
        # the graph and plans of each window shape met (a plan made for short sequences does not fit
        # long ones): the current ones are _graph / _plans, of the inputs' window shape _graph_key
        self._graph_key: tuple | None = None
        self._other_shapes: dict[tuple, tuple[Graph, dict[int, Plan]]] = {}
        model.train()
        self.buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
        # the loss's bytes are measured with targets of a known kind (a built-in loss), or again with
        # the first batch's targets (a custom loss, whose targets were guessed)
        self._loss_measured = self.loss_name in LOSS_TARGETS
        if example_input is not None:
            self._graph = trace_graph(model, example_input, self.blocks, loss_fn=self.loss_fn,
                                      target=LOSS_TARGETS.get(self.loss_name), device=self.device)
            self._graph_key = window_shapes(nested_tensors(example_input))

        self.executor: StreamingExecutor | None = None
        self.store = None
        # the process's RssAnon sampled at block boundaries (process_peak_bytes); its baseline is
        # taken once the state is loaded
        self.process_memory = AnonHighWater()
        self.gpu_memory = CudaAllocatedPeak(self.device)  # the allocator's own peak, on a GPU run
        self._steps: StepStrategy
        if offload is None:
            self._steps = InMemorySteps(model, self.blocks, self.spec, self.ledger, self.device,
                                        budget_bytes=self.budget_bytes, buffer_bytes=self.buffer_bytes,
                                        reduce=lambda name, grads: self._reduce(name, grads))
        else:
            numels = [sum(p.numel() for p in b.parameters()) for b in self.blocks]
            kinds = ("param", *self.spec.state_kinds)
            owned = None
            if shard_optimizer_state:
                from .zero import OptimizerSharding

                self.sharding = OptimizerSharding([b.name for b in self.blocks], [4 * n for n in numels],
                                                  group=process_group)
                self._reduce = self.sharding.reduce
                owned = self.sharding.owned
                log.info("ZeRO-1: rank %d of %d keeps the optimizer state of %d of %d blocks",
                         self.sharding.rank, self.sharding.world_size, len(owned), len(self.blocks))
            if offload == "disk":
                self.store = DiskStore(numels, kinds, offload_dir, state_blocks=owned)
            else:
                self.store = HostStore(numels, kinds, pin=self.device.type == "cuda", state_blocks=owned)
            if self._graph is not None:
                self._plan_for(int(nested_tensors(example_input)[0].shape[0]))
            self.executor = StreamingExecutor(self.blocks, self.store, self.ledger, self.device,
                                              self._plans.get(self._first_batch(), None) or self._default_plan(),
                                              self.spec, reduce=lambda name, grads: self._reduce(name, grads),
                                              owned=owned, probe=self.process_memory)
            self.executor.load_weights(dict(model.named_parameters()))
            self.executor.install()
            for mod in model.modules():
                for name, b in list(mod._buffers.items()):
                    if b is not None:
                        mod._buffers[name] = b.to(self.device)
            self.ledger.reserve("buffers", self.buffer_bytes)
            self._steps = StreamedSteps(model, self.blocks, self.spec, self.executor, self.store, self.sharding)
        self._open_baselines()

    # ---- planning ---------------------------------------------------------------------
    def _first_batch(self) -> int:
        return next(iter(self._plans), 0)

    def _default_plan(self) -> Plan:
        from ..sched.plan import Mode, ParamPlan, Tier

        return Plan(graph=type(self._model).__name__,
                    params=tuple(ParamPlan(n, Mode.FULL, None, Tier(self.offload)) for n in self.param_shapes),
                    order=tuple(b.name for b in self.blocks if not b.resident), prefetch_depth=self.prefetch_depth)

    def _plan_for(self, batch: int) -> Plan | None:
        if self.offload is None:
            return None
        if batch not in self._plans:
            self._plans[batch] = offload_plan(
                self._graph, batch, budget_bytes=self.budget_bytes, offload=self.offload, device=self.device,
                optimizer=self.spec.name, recompute=self.recompute, prefetch_depth=self.prefetch_depth,
                buffer_bytes=self.buffer_bytes, update_chunk_numel=self.chunk_numel,
                max_micro_batches=self.max_micro_batches)
        return self._plans[batch]

    @property
    def plan(self) -> Plan | None:
        """The plan of the latest batch size and window shape (``None`` in memory)."""
        return self._steps.plan

    @property
    def lr(self) -> float:
        return self._steps.lr

    @lr.setter
    def lr(self, value: float) -> None:
        self._steps.lr = float(value)

    # ---- training ---------------------------------------------------------------------
    def step(self, x, y) -> float:
        """One optimizer step on the batch ``(x, y)``; returns the loss (before the update).

        When the plan splits the batch into micro-batches, each runs its forward and backward
        with its loss weighted by its share of the windows (the loss is taken to be a mean over
        windows, as the built-in ones are), each block's gradients are summed over them in the
        state's tier, and each block is updated once, after the last micro-batch's backward.
        The returned loss is the sum of the weighted micro-batch losses.

        Raises:
            FloatingPointError: the loss is NaN or infinite (no update applied).
            BudgetExceeded: this batch size does not fit the budget.
        """
        self._check_usable()
        xs = [t.to(self.device) for t in nested_tensors(x)]
        x = xs[0] if isinstance(x, torch.Tensor) else type(x)(xs)
        y = y.to(self.device)
        batch = int(xs[0].shape[0])
        key = window_shapes(xs)
        if self.offload is None:  # in memory nothing is planned: no trace
            pass
        elif self._graph is None or not self._loss_measured:
            self._trace(x, y)
            self._graph_key = key
        elif key != self._graph_key:
            self._switch_shapes(x, y, key)
        in_bytes = sum(t.numel() * t.element_size() for t in xs) + y.numel() * y.element_size()
        plan = self._plan_for(batch)
        micro = plan.micro_batch_windows if plan is not None else batch
        parts = [(a, min(batch, a + micro)) for a in range(0, batch, micro)]
        self._steps.prepare(plan, len(parts))
        self.ledger.reserve("input", in_bytes)
        try:
            value = self._run_parts(x, xs, y, parts, batch)
        finally:
            self.ledger.release("input")
        self.step_count += 1
        return value

    def _trace(self, x, y: torch.Tensor) -> None:
        """Trace the model and its loss with the first batch (the loss with its real targets; a graph
        traced from ``example_input`` had them guessed): plans made before are dropped if the loss's
        bytes changed."""
        first = self._graph is None
        graph = self._traced_graph(x, y)
        if first or graph != self._graph:
            self._graph, self._plans = graph, {}
        self._loss_measured = True
        if first:
            self._open_baselines()  # the one-off trace is loading, not training: the baseline after it

    def _traced_graph(self, x, y: torch.Tensor) -> Graph:
        """The graph of the model and its loss traced on the batch ``(x, y)`` (the weights as the
        steps hold them)."""
        with self._steps.tracing():
            return trace_graph(self._model, x, self.blocks, param_shapes=self.param_shapes, loss_fn=self.loss_fn,
                               target=LOSS_TARGETS.get(self.loss_name, y), device=self.device)

    def _switch_shapes(self, x, y: torch.Tensor, key: tuple) -> None:
        """Plan for windows of another shape (longer sequences, larger images): the graph and plans
        of a shape met before come back; a new shape is traced (its plans are made per batch size
        as they come)."""
        self._other_shapes[self._graph_key] = (self._graph, self._plans)
        while len(self._other_shapes) > MAX_KEPT_SHAPES:  # the least recently used goes
            self._other_shapes.pop(next(iter(self._other_shapes)))
        if key in self._other_shapes:
            self._graph, self._plans = self._other_shapes.pop(key)
        else:
            log.info("windows of a new shape %s (planned for %s): tracing the model again", key, self._graph_key)
            self._graph, self._plans = self._traced_graph(x, y), {}
        self._graph_key = key

    def _open_baselines(self) -> None:
        self.process_memory.open()
        self.gpu_memory.open()

    def _run_parts(self, x, xs: list[torch.Tensor], y: torch.Tensor, parts: list[tuple[int, int]],
                   batch: int) -> float:
        """The step's (micro-)batches and their summed loss. A failure after some blocks were
        updated makes the trainer unusable: their weights and optimizer state moved, the others'
        did not, so no later step could be the one a complete step would give."""
        try:
            if len(parts) == 1:
                value = self._forward_backward(x, xs, y, None, 0, 1)
            else:
                value = 0.0
                for i, (a, b) in enumerate(parts):
                    sub = [t[a:b] for t in xs]
                    value += self._forward_backward(sub[0] if isinstance(x, torch.Tensor) else type(x)(sub), sub,
                                                    y[a:b], (b - a) / batch, i, len(parts))
        except BaseException as e:
            updated = self._steps.blocks_updated()
            if updated:
                self._unusable = (f"step {self.step_count + 1} failed ({type(e).__name__}) after updating {updated} of "
                                  f"{len(self.blocks)} blocks, so the weights are part old, part new")
                e.add_note(f"edgeadapt: {self._unusable}; this trainer refuses further steps and checkpoints: "
                           "continue from the last checkpoint (Trainer.resume, or edgeadapt train --resume)")
            raise
        return value

    def _forward_backward(self, x, xs: list[torch.Tensor], y: torch.Tensor, scale: float | None, micro: int,
                          micro_count: int) -> float:
        """The forward and backward of one (micro-)batch, and with the last one the update; returns its
        (weighted) loss."""
        outside: list[torch.Tensor] = []
        steps = self._steps
        try:
            steps.begin(micro, micro_count, [*xs, y])

            def pack(t):
                outside.append(t)
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = self._model(*xs) if isinstance(x, (tuple, list)) else self._model(x)
                loss = self.loss_fn(out, y)
                if scale is not None:
                    loss = loss * scale
            steps.charge(outside, nested_tensors(out), loss, [*xs, y])
            self.process_memory.sample()  # the end of the forward: every activation is held
            del out
            value = float(loss.detach())
            if not math.isfinite(value):
                raise FloatingPointError(f"loss became {value} at step {self.step_count + 1}; no update was applied. "
                                         "Lower the learning rate or check the data for extreme values")
            steps.before_backward()
            if self._graph is not None and self.offload is not None:
                # the loss's backward transients (its saved tensors are charged with the activations)
                transient = self._graph.loss_peak_bytes - self._graph.loss_saved_bytes
                self.ledger.reserve(LOSS_KEY, max(0, transient) * int(xs[0].shape[0]))
            loss.backward()
            self.ledger.release(LOSS_KEY)  # a model without streamed blocks: before the root block's update
            self.process_memory.sample()
            del loss
            outside.clear()  # what autograd saved, released with the graph
            steps.after_backward()
        finally:
            self.ledger.release(LOSS_KEY)
            steps.end()
        return value

    @torch.no_grad()
    def predict(self, x) -> torch.Tensor:
        """The model's output for ``x`` with the current weights, streamed block by block (no
        gradient, no update; BatchNorm in eval mode, dropout off). The whole model is never
        gathered, unlike :meth:`model`.

        Raises:
            RuntimeError: the trainer is closed.
        """
        self._check_open("predict")
        xs = [t.to(self.device) for t in nested_tensors(x)]
        self._model.eval()
        self.ledger.reserve("input", sum(t.numel() * t.element_size() for t in xs))
        try:
            self._steps.begin(0, 1, xs)
            return self._model(*xs)
        finally:
            self._steps.end()
            self.ledger.release("input")
            self._model.train()

    # ---- reports ----------------------------------------------------------------------
    @property
    def tracked_peak_bytes(self) -> int:
        """The most bytes the trainer held in the compute tier at once."""
        return self.ledger.peak_bytes

    @property
    def process_peak_bytes(self) -> int | None:
        """The process's resident anonymous memory (RssAnon) at its highest over what it held
        when the trainer had loaded the model's state: sampled at every streamed block's fetch
        and release and at the end of each forward and backward, so a lower bound of the true
        peak (memory freed back to the OS between two samples is missed). Unlike
        :attr:`tracked_peak_bytes` it counts everything in the process: the host tier's state
        written after loading, memory the allocator keeps after a free, other threads' and the
        caller's allocations. ``None`` where the process's memory cannot be read (not Linux)."""
        probe = self.process_memory
        return probe.delta_bytes if probe.available else None

    @property
    def gpu_peak_bytes(self) -> int | None:
        """On a GPU run, the CUDA caching allocator's peak of allocated bytes over what it held when
        the trainer had loaded the model's state (torch.cuda's peak statistics are reset then).
        Unlike :attr:`tracked_peak_bytes` it counts every tensor on the device: library
        workspaces (cuBLAS's), kernels' temporaries, the caller's tensors. ``None`` on the CPU."""
        return self.gpu_memory.delta_bytes

    @property
    def shards_optimizer_state(self) -> bool:
        """Whether this trainer keeps only its own blocks' optimizer state (ZeRO-1)."""
        return self.sharding is not None

    @property
    def optimizer_state_bytes(self) -> int:
        """Bytes of optimizer state (AdamW moments) this process holds, in whatever tier; with
        ``shard_optimizer_state`` about ``1 / world_size`` of the whole."""
        return self._steps.optimizer_state_bytes

    def residency(self) -> dict:
        """Block states, bytes per tier and the optimizer state held by this process.

        Returns:
            ``{"blocks": {block: "resident"|"inflight"|"offloaded"}, "tiers": {"compute": bytes,
            "host": bytes, "disk": bytes}, "optimizer_state_bytes": bytes}`` — compute: what the
            ledger holds now; host/disk: master weights and optimizer state kept there (with
            ``shard_optimizer_state``, only this rank's share of the optimizer state).
        """
        tiers = {"compute": self.ledger.current_bytes, **self._steps.tier_bytes()}
        return {"blocks": self._steps.block_residency(), "tiers": tiers,
                "optimizer_state_bytes": self.optimizer_state_bytes}

    # ---- state ------------------------------------------------------------------------
    def block_state(self, index: int) -> dict[str, dict[str, torch.Tensor]]:
        """``{kind: {param name: CPU tensor}}`` for block ``index`` (kinds: param + optimizer state),
        plus ``"steps": {param name: tensor(int)}``. With ``shard_optimizer_state`` a block another
        rank owns has ``param`` and ``steps`` only."""
        self._check_open("read a block's state")
        return self._steps.block_state(index)

    def set_block_state(self, index: int, state: dict[str, dict[str, torch.Tensor]]) -> None:
        """Inverse of :meth:`block_state` (optimizer state of a block another rank owns is skipped)."""
        self._check_open("set a block's state")
        self._steps.set_block_state(index, state)

    def buffers(self) -> dict[str, torch.Tensor]:
        """The model's buffers as CPU copies."""
        return {n: b.detach().cpu().clone() for n, b in self._model.named_buffers()}

    def model(self) -> nn.Module:
        """A CPU copy of the model with the current weights and buffers (an ordinary module).

        Raises:
            RuntimeError: the trainer is closed (take the copy before :meth:`close`).
        """
        self._check_open("return the model")
        return self._steps.model_copy()

    def signature(self) -> dict:
        """What a checkpoint must match: the model's parameters and the training configuration."""
        return {"model": type(self._model).__name__,
                "params": {n: list(s) for n, s in self.param_shapes.items()},
                "blocks": [b.name for b in self.blocks],
                "buffers": {n: list(b.shape) for n, b in self._model.named_buffers()},
                "optimizer": self.spec.to_dict(), "loss": self.loss_name}

    def state_dict(self) -> dict:
        """The full resumable state (weights, optimizer state, buffers, step, RNG) as CPU tensors.

        Raises:
            ValueError: with ``shard_optimizer_state`` (this process holds part of the optimizer
                state; use :meth:`save_checkpoint`, which writes every rank's share).
            RuntimeError: the trainer is closed.
        """
        self._check_open("return its state")
        if self.sharding is not None:
            raise ValueError("state_dict() holds the whole optimizer state, which a ZeRO-1 rank does not have; "
                             "use save_checkpoint(dir) (every rank calls it; each writes its share)")
        sd = {"signature": self.signature(), "step": self.step_count, "buffers": self.buffers(),
              "rng": _ckpt.rng_state(), "blocks": [self.block_state(i) for i in range(len(self.blocks))],
              "lr": self.lr}
        return sd

    def load_state_dict(self, sd: dict) -> None:
        """Restore :meth:`state_dict` output; refuses another model or configuration (and a closed trainer)."""
        self._check_open("load a state")
        _ckpt.check_signature(sd["signature"], self.signature())
        for i, bs in enumerate(sd["blocks"]):
            self.set_block_state(i, bs)
        self.load_buffers(sd["buffers"])
        self.step_count = int(sd["step"])
        self.lr = float(sd.get("lr", self.lr))
        _ckpt.set_rng_state(sd["rng"])

    def load_buffers(self, buffers: dict[str, torch.Tensor]) -> None:
        """Copy ``buffers`` (:meth:`buffers` output) into the model's buffers."""
        with torch.no_grad():
            for n, b in self._model.named_buffers():
                b.copy_(buffers[n])

    def save_checkpoint(self, directory: str | os.PathLike, *, extra: dict | None = None, keep: int = 2) -> Path:
        """Write a resumable checkpoint under ``directory`` atomically (see
        :mod:`edgeadapt.server.checkpoint`); ``extra`` (JSON) is restored as
        :attr:`checkpoint_extra` (e.g. the data position). Returns the checkpoint's folder.

        With ``shard_optimizer_state`` this is a collective: every rank calls it, each writes its
        blocks with torch.distributed.checkpoint, rank 0 publishes (rank 0's ``extra`` is kept).

        Raises:
            RuntimeError: the trainer is closed, or a step failed after updating some blocks (its
                state is part old, part new and is not written).
        """
        self._check_usable()
        if self.sharding is not None:
            return _ckpt.save_sharded(self, Path(directory), extra=extra or {}, keep=keep)
        return _ckpt.save(self, Path(directory), extra=extra or {}, keep=keep)

    @classmethod
    def resume(cls, directory: str | os.PathLike, model: nn.Module, **kwargs) -> Trainer:
        """A trainer built with ``kwargs`` from the latest checkpoint in ``directory``.

        Raises:
            CheckpointMismatch: the checkpoint is of another model or configuration (named).
            FileNotFoundError: no checkpoint in ``directory``.
        """
        t = cls(model, **kwargs)
        _ckpt.load(t, Path(directory))
        return t

    def _check_usable(self) -> None:
        """Refuse a step or a checkpoint: the trainer is closed, or a step failed half-applied."""
        if self._unusable:
            raise RuntimeError(f"this trainer cannot run: {self._unusable}; build a new one (Trainer.resume "
                               "continues from a checkpoint)")

    def _check_open(self, what: str) -> None:
        """Refuse what reads or writes the trainer's state (weights, optimizer state) once it is closed."""
        if self._closed:
            raise RuntimeError(f"this trainer cannot {what}: it was closed (Trainer.close(), or the end of its "
                               "'with' block) and released its state; take what you need (Trainer.model(), "
                               "Trainer.predict(), save_checkpoint) before closing it, or build a new one "
                               "(Trainer.resume continues from a checkpoint)")

    def close(self) -> None:
        """Stop the prefetch thread and remove the disk tier's files; the trainer runs no more steps,
        and :meth:`model`, :meth:`predict` and the state accessors raise ``RuntimeError`` (so does a
        call of the taken-over model with offload: its weights are gone). A second call does nothing."""
        if self._unusable is None:
            self._unusable = "it was closed"
        if self._closed:
            return
        self._closed = True
        try:
            self._steps.close()
        finally:
            self.process_memory.close()

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
