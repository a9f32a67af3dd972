"""Data parallelism on torch.distributed: process-group setup, per-block gradient averaging.

Every rank runs its own trainer (and offload executor) on its shard of the global batch; just
before a block's optimizer update the trainer hands that block's gradients to
:func:`allreduce_gradients`, which averages them over the ranks in one collective per block
(the block's gradients flattened into one bucket). Ranks that start from the same parameters
and apply the same averaged gradients stay identical, so no parameter ever has to be sent
after the start (:func:`broadcast_parameters`). Every byte that moves between processes goes
through torch.distributed collectives — gloo on CPU, NCCL on CUDA — launched by ``torchrun``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "DistContext",
    "allreduce_gradients",
    "broadcast_parameters",
    "gather_rng_states",
    "gradient_bucket",
    "init_from_env",
    "shutdown",
    "unpack_bucket",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistContext:
    """Where this process stands in a (possibly single-process) data-parallel job.

    Attributes:
        rank: This process's rank in the job (0 when not distributed).
        world_size: Number of processes (1 when not distributed).
        local_rank: Rank on this machine (selects the GPU).
        backend: ``"gloo"``, ``"nccl"``, or ``None`` when not distributed.
        initialised_here: Whether :func:`init_from_env` created the process group (and
            :func:`shutdown` should destroy it).
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: str | None = None
    initialised_here: bool = False

    @property
    def is_distributed(self) -> bool:
        """More than one process takes part."""
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """Rank 0: the process that prints and writes shared files."""
        return self.rank == 0


def init_from_env(device_type: str = "cpu") -> DistContext:
    """Joins the process group described by torchrun's environment, if there is one.

    Reads ``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK`` (and torchrun's rendezvous variables); with
    no ``WORLD_SIZE`` or ``WORLD_SIZE=1`` nothing is initialised. An already-initialised
    default group is reused.

    Args:
        device_type: ``"cuda"`` selects NCCL, anything else gloo.

    Returns:
        The rank, world size and backend of this process.
    """
    if dist.is_available() and dist.is_initialized():
        return DistContext(dist.get_rank(), dist.get_world_size(),
                           int(os.environ.get("LOCAL_RANK", dist.get_rank())), dist.get_backend())
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return DistContext()
    if not dist.is_available():
        raise RuntimeError("WORLD_SIZE > 1 but this torch build has no torch.distributed; "
                           "install a torch build with distributed support or run a single process")
    backend = "nccl" if device_type == "cuda" else "gloo"
    dist.init_process_group(backend=backend)
    ctx = DistContext(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")),
                      backend, initialised_here=True)
    logger.info("joined a %s process group: rank %d of %d", backend, ctx.rank, ctx.world_size)
    return ctx


def shutdown(ctx: DistContext) -> None:
    """Destroys the default process group if :func:`init_from_env` created it.

    Every rank first waits at a barrier: a rank that tears its connections down while a peer
    is still working (rank 0 writing a checkpoint, say) can leave the peer's gloo threads
    failing on a closed socket, which aborts that process as it exits.
    """
    if ctx.initialised_here and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _tensors(grads: Mapping[str, torch.Tensor | None] | Iterable[torch.Tensor | None]) -> list[torch.Tensor]:
    values = grads.values() if isinstance(grads, Mapping) else grads
    return [g for g in values if g is not None]


def allreduce_gradients(block_name: str,
                        grads: Mapping[str, torch.Tensor | None] | Iterable[torch.Tensor | None],
                        group: dist.ProcessGroup | None = None) -> None:
    """Averages one block's gradients over the ranks of ``group``, in place.

    The block's gradients are flattened into one bucket, summed with a single
    ``all_reduce`` and divided by the world size, then copied back into the given tensors.
    With every rank's loss a mean over its equal shard of the global batch, the result is the
    gradient of the mean loss over the global batch. Every rank must call this for the same
    blocks in the same order (a collective). ``None`` entries (parameters without a
    gradient) are skipped; all ranks must agree on which those are.

    Args:
        block_name: The block the gradients belong to (named in errors and logs).
        grads: The block's gradients, as a ``{name: tensor}`` mapping or a sequence; all on
            one device and of one dtype.
        group: The process group to average over; ``None`` is the default group. Without
            an initialised group (or with one rank) this is a no-op.

    Raises:
        ValueError: If the gradients mix devices or dtypes.
    """
    tensors = _tensors(grads)
    if not tensors or not (dist.is_available() and dist.is_initialized()):
        return
    world_size = dist.get_world_size(group)
    if world_size == 1:
        return
    bucket = gradient_bucket(block_name, tensors)
    dist.all_reduce(bucket, op=dist.ReduceOp.SUM, group=group)
    bucket.div_(world_size)
    unpack_bucket(bucket, tensors)
    logger.debug("block %s: averaged %d gradient elements over %d ranks", block_name, bucket.numel(), world_size)


def gradient_bucket(block_name: str, tensors: list[torch.Tensor]) -> torch.Tensor:
    """One block's gradients as one flat tensor (a copy), so a collective moves them at once.

    Raises:
        ValueError: the gradients mix devices or dtypes.
    """
    kinds = {(t.device, t.dtype) for t in tensors}
    if len(kinds) > 1:
        raise ValueError(f"block {block_name!r}: gradients on several devices/dtypes {sorted(map(str, kinds))}; "
                         f"move them to one device and dtype before reducing")
    return torch.cat([t.reshape(-1) for t in tensors]) if len(tensors) > 1 else tensors[0].reshape(-1).clone()


def unpack_bucket(bucket: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Copy a flat bucket made by :func:`gradient_bucket` back into ``tensors``, in order."""
    offset = 0
    with torch.no_grad():
        for t in tensors:
            n = t.numel()
            t.copy_(bucket[offset:offset + n].view_as(t))
            offset += n


def broadcast_parameters(model: nn.Module, src: int = 0, group: dist.ProcessGroup | None = None) -> None:
    """Copies rank ``src``'s parameters and buffers to every rank (start every replica equal).

    One broadcast per tensor, in ``state_dict`` order; a no-op without an initialised group.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return
    with torch.no_grad():
        for tensor in model.state_dict().values():
            dist.broadcast(tensor, src=src, group=group)


def gather_rng_states(group: dist.ProcessGroup | None = None) -> list[torch.Tensor]:
    """Every rank's CPU torch RNG state, gathered on every rank (rank order).

    Lets one rank write a checkpoint that restores each rank's random stream (dropout).
    Without a process group it returns this process's state alone.
    """
    state = torch.get_rng_state()
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return [state]
    out = [torch.empty_like(state) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, state, group=group)
    return out
