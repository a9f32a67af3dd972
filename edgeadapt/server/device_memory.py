"""The GPU's own account of a run: the CUDA caching allocator's peak beside the trainer's ledger.

The ledger (:class:`~edgeadapt.server.residency.MemoryLedger`) counts what the plan reserves;
the allocator sees every tensor on the GPU, also what no plan counts (library workspaces such as
cuBLAS's, kernels' temporaries, the caller's own tensors). Both are reported, so a run shows
when the two part.
"""

from __future__ import annotations

import torch

__all__ = ["CudaAllocatedPeak"]


class CudaAllocatedPeak:
    """``torch.cuda.max_memory_allocated`` over what was allocated at :meth:`open`.

    :meth:`open` resets torch.cuda's peak statistics of the device (once, when the trainer's
    baseline is taken); on any other device it does nothing and :attr:`delta_bytes` is ``None``.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self._base: int | None = None

    def open(self) -> None:
        if self.device.type != "cuda":
            return
        torch.cuda.synchronize(self.device)
        self._base = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    @property
    def delta_bytes(self) -> int | None:
        """The most bytes the allocator held since :meth:`open`, above what it held then."""
        if self._base is None:
            return None
        return max(0, torch.cuda.max_memory_allocated(self.device) - self._base)
