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

The executor is three parts with one job each: the
:class:`~edgeadapt.server.coordinator.ResidencyCoordinator` (fetch, prefetch, release, the
ledger's account of weights and activations), the :class:`~edgeadapt.server.updater.BlockUpdater`
(reduction and the CPU update, chunked on the disk tier) and the
:class:`~edgeadapt.server.block_autograd.BlockWiring` (the blocks' autograd nodes and the root
block's hook). :class:`StreamingExecutor` puts them together.

Every byte the executor holds in the compute tier is reserved in the
:class:`~edgeadapt.server.residency.MemoryLedger` before it is allocated (weights, prefetched
weights, gradients, staged optimizer state) or charged as soon as it exists (activations:
every tensor autograd saves inside a block, the blocks' outputs, and what the ops between
blocks save), released when freed.
"""

from __future__ import annotations

import contextlib

import torch

from ..memory import AnonHighWater
from ..optimizer_config import OptimizerConfig
from ..sched.plan import Plan
from .block_autograd import BlockWiring
from .coordinator import BlockSlot, ResidencyCoordinator
from .residency import MemoryLedger
from .store import StateStore
from .trace import Block
from .updater import BlockUpdater, ReduceFn

__all__ = ["StreamingExecutor", "BlockSlot", "ReduceFn"]


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
        probe: sampled at every block's fetch and release (see :class:`ResidencyCoordinator`).
    """

    def __init__(self, blocks: list[Block], store: StateStore, ledger: MemoryLedger, device: torch.device,
                 plan: Plan, optimizer: OptimizerConfig, reduce: ReduceFn | None = None,
                 owned=None, probe: AnonHighWater | None = None):
        self.store, self.ledger, self.device, self.optimizer = store, ledger, device, optimizer
        self.slots: list[BlockSlot] = [BlockSlot.of(i, b) for i, b in enumerate(blocks)]
        self.residency = ResidencyCoordinator(self.slots, store, ledger, device, probe)
        self.updater = BlockUpdater(store, ledger, device, optimizer, reduce=reduce, owned=owned)
        self.wiring = BlockWiring(self.slots, self.residency, self.updater)
        self.set_plan(plan)

    # ---- setup ------------------------------------------------------------------------
    def set_plan(self, plan: Plan) -> None:
        """Adopt a (re-)plan: order, prefetch depth, keep/recompute per block and the update chunk."""
        self.plan = plan
        self.residency.set_plan(plan)
        self.updater.set_plan(plan)
        self.wiring.set_plan(plan)

    @property
    def chunk_numel(self) -> int:
        """Elements per chunk of a staged (disk-tier) update."""
        return self.updater.chunk_numel

    @property
    def lr(self) -> float:
        return self.updater.lr

    @lr.setter
    def lr(self, value: float) -> None:
        self.updater.lr = float(value)

    def owns(self, index: int) -> bool:
        """Whether this process runs block ``index``'s optimizer update (and keeps its state)."""
        return self.updater.owns(index)

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

    def install(self) -> None:
        """Route each block's calls through the executor (:meth:`BlockWiring.install`)."""
        self.wiring.install()

    @property
    def root_hook_id(self) -> int | None:
        """The id of the model's forward pre-hook (to remove it from a copy of the model)."""
        return self.wiring.root_hook_id

    def uninstalled(self) -> contextlib.AbstractContextManager:
        """The blocks' own forwards for the body (a shape trace of the model), the root hook off."""
        return self.wiring.uninstalled()

    # ---- the step ---------------------------------------------------------------------------
    def begin_step(self, *, micro: int = 0, micro_count: int = 1) -> None:
        """Start a forward/backward: micro-batch ``micro`` of ``micro_count`` in the step. Each block's
        gradients are summed over a step's micro-batches in the store (``ACCUMULATOR``) and the
        block is updated after the last one."""
        self.updater.begin_step(self.slots, micro=micro, micro_count=micro_count)
        self.wiring.begin_step()
        self.residency.begin_step()

    def charge_activations(self, owner: str, tensors: list[torch.Tensor]) -> None:
        """Charge the storages among ``tensors`` not yet charged this step to ``owner``."""
        self.residency.charge_activations(owner, tensors)

    def update_resident(self) -> None:
        """After the backward: update the root block with the gradient accumulated over the step."""
        self.wiring.update_resident()

    def wait_updates(self) -> None:
        """Wait for the step's optimizer updates; re-raises the first failure."""
        self.updater.wait()

    def end_step(self) -> None:
        """Wait for the updates and release whatever the step left behind (prefetches for blocks
        that did not run, graphs of a step that failed)."""
        self.updater.wait()
        self.residency.release_all()
        self.wiring.end_step()

    def close(self) -> None:
        self.updater.wait()
        self.wiring.close()
        self.residency.close()
        self.updater.close()
