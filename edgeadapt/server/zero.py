"""ZeRO-1 for the streaming trainer: each rank keeps the optimizer state of its own blocks.

``Trainer(..., process_group=g, shard_optimizer_state=True)`` (``edgeadapt train
--shard-optimizer-state`` under torchrun). Every rank still holds the master weights of every
block in its tier (host memory or disk) and streams all blocks through its compute device;
only the AdamW state (``exp_avg``, ``exp_avg_sq``) and the update are divided:

* **Assignment** (:func:`assign_blocks`): blocks are taken largest first (ties: lower index)
  and each goes to the rank holding the fewest bytes so far (ties: lower rank) — the greedy
  longest-processing-time rule, deterministic, a function of the blocks' sizes and the world
  size only. With ``n`` blocks of sizes ``s_i`` each rank's share is within one block of
  ``sum(s_i) / world_size``.
* **Gradients**: each block's gradients are flattened into one bucket and summed onto the
  owner with one ``torch.distributed.reduce`` (then divided by the world size there): the
  other ranks need no reduced gradient, and a reduce moves about half the bytes of an
  ``all_reduce``. With two ranks the sum is the same floating-point addition as the
  ``all_reduce`` of the unsharded mode, so both modes give bit-identical weights.
* **Update**: only the owner runs the block's CPU AdamW (the executor's update thread); the
  other ranks drop their gradients after the reduce.
* **Weights**: after the backward (every update finished), the owner of each block broadcasts
  its updated master weights with ``torch.distributed.broadcast``, block by block in index
  order. The host tier on gloo broadcasts the stored vectors in place (no copy); the disk
  tier and NCCL go through one staging chunk of at most ``update_chunk_numel`` elements (and
  at most the largest block), reserved in the ledger like every other compute-tier byte.

Every byte that moves between processes goes through those torch.distributed collectives.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from .distributed import gradient_bucket, unpack_bucket

if TYPE_CHECKING:
    from .executor import StreamingExecutor

__all__ = ["assign_blocks", "OptimizerSharding"]


def assign_blocks(sizes: Sequence[int], world_size: int) -> list[int]:
    """The owning rank of each block, balanced by bytes and deterministic.

    Blocks are taken largest first (ties: lower index) and each is given to the rank with the
    fewest bytes assigned so far (ties: lower rank).

    Args:
        sizes: bytes (or elements) of each block, in block order.
        world_size: number of ranks (>= 1).

    Returns:
        ``owners[i]``: the rank that owns block ``i``.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    load = [0] * world_size
    owners = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-int(sizes[i]), i)):
        r = min(range(world_size), key=lambda r: (load[r], r))
        owners[i] = r
        load[r] += int(sizes[i])
    return owners


def _dist_on(group) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


class OptimizerSharding:
    """Which rank owns which block's optimizer state, and the collectives of ZeRO-1.

    Args:
        block_names: the blocks, in block order.
        sizes: bytes of each block's master weights.
        group: the process group (``None``: the default group, or one process when there is
            none).
    """

    def __init__(self, block_names: Sequence[str], sizes: Sequence[int], group=None):
        self.group = group
        self.distributed = _dist_on(group)
        self.rank = dist.get_rank(group) if self.distributed else 0
        self.world_size = dist.get_world_size(group) if self.distributed else 1
        self.backend = dist.get_backend(group) if self.distributed else None
        self.block_names = list(block_names)
        self.owners = assign_blocks(sizes, self.world_size)
        self._index = {n: i for i, n in enumerate(self.block_names)}
        self.owned = frozenset(i for i, r in enumerate(self.owners) if r == self.rank)

    def _global(self, group_rank: int) -> int:
        if self.group is None or self.group is dist.group.WORLD:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    def describe(self) -> dict:
        """For checkpoints: the world size and each block's owner."""
        return {"world_size": self.world_size, "owners": list(self.owners)}

    # ---- gradients ----------------------------------------------------------------------
    def reduce(self, block_name: str, grads: list[torch.Tensor]) -> None:
        """Average one block's gradients onto its owner, in place there (a collective: every
        rank calls it for the same blocks in the same order). On the other ranks ``grads`` are
        left as they were; they are dropped after this call.

        Raises:
            ValueError: the gradients mix devices or dtypes.
        """
        tensors = [g for g in grads if g is not None]
        if not tensors or not self.distributed:
            return
        owner = self.owners[self._index[block_name]]
        bucket = gradient_bucket(block_name, tensors)
        dist.reduce(bucket, dst=self._global(owner), op=dist.ReduceOp.SUM, group=self.group)
        if owner != self.rank:
            return
        bucket.div_(self.world_size)
        unpack_bucket(bucket, tensors)

    # ---- weights ------------------------------------------------------------------------
    def broadcast_weights(self, ex: StreamingExecutor) -> None:
        """Every block's master weights from its owner to every rank, after the step's updates.

        Waits for this rank's updates first. A collective: all ranks call it after the same step.
        """
        ex.wait_updates()
        if not self.distributed:
            return
        store = ex.store
        comm_device = torch.device("cpu") if self.backend == "gloo" else ex.device
        if store.in_place() and comm_device.type == "cpu":
            works = [dist.broadcast(store.read(s.index, "param"), src=self._global(self.owners[s.index]),
                                    group=self.group, async_op=True) for s in ex.slots]
            for w in works:
                w.wait()
            return
        chunk = max(1, min(ex.chunk_numel, max((s.numel for s in ex.slots), default=1)))
        # the staging chunk is in the compute tier when it is on the compute device, or when the
        # compute device is the CPU and the chunk is read from disk (as the disk tier's update)
        charged = comm_device.type != "cpu" or ex.device.type == "cpu"
        if charged:
            ex.ledger.reserve("broadcast", 4 * chunk)
        try:
            buf = torch.empty(chunk, dtype=torch.float32, device=comm_device)
            for s in ex.slots:
                src = self.owners[s.index]
                mine = src == self.rank
                host = store.read(s.index, "param") if store.in_place() else None
                for a in range(0, s.numel, chunk):
                    n = min(chunk, s.numel - a)
                    piece = buf[:n]
                    if mine and host is not None:
                        piece.copy_(host[a:a + n], non_blocking=False)
                    elif mine and comm_device.type == "cpu":
                        store.read_range(s.index, "param", a, n, out=piece)
                    elif mine:
                        piece.copy_(store.read_range(s.index, "param", a, n))  # disk -> host -> device
                    dist.broadcast(piece, src=self._global(src), group=self.group)
                    if not mine:
                        if host is not None:
                            host[a:a + n].copy_(piece)
                        else:
                            store.write_range(s.index, "param", a, piece.cpu())
            del buf
        finally:
            if charged:
                ex.ledger.release("broadcast")
