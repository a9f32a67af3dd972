"""Explicit residency of each block and a ledger of the bytes held in the compute tier.

Every block is in one of three states (as DeepSpeed's parameter status):

* ``OFFLOADED``: only the master copy exists, in host memory or on disk;
* ``INFLIGHT``: a copy into the compute tier has been started (prefetch) and holds its bytes;
* ``RESIDENT``: the compute copy is ready for use.

The :class:`MemoryLedger` is the single account of compute-tier bytes: weights of resident and
in-flight blocks, gradients, staged optimizer state and activations. A reservation that would
take the total over the budget raises :class:`~edgeadapt.sched.offload.BudgetExceeded` *before*
the memory is allocated, so the tracked peak never exceeds the budget.
"""

from __future__ import annotations

import threading
from enum import Enum

from ..sched.errors import BudgetExceeded
from ..units import format_bytes

__all__ = ["Residency", "MemoryLedger", "LOSS_KEY"]


class Residency(str, Enum):
    """Where a block's working copy stands."""

    RESIDENT = "resident"
    INFLIGHT = "inflight"
    OFFLOADED = "offloaded"


LOSS_KEY = "loss"
"""The ledger's key for the loss's backward transients (reserved by the trainer before the
backward, released when the first block's backward starts)."""


class MemoryLedger:
    """Thread-safe account of compute-tier bytes under a budget.

    Args:
        budget_bytes: the most the executor may hold at once; ``None`` tracks without a limit.
    """

    def __init__(self, budget_bytes: int | None):
        self.budget_bytes = budget_bytes
        self._held: dict[str, int] = {}
        self._lock = threading.Lock()
        self.current_bytes = 0
        self.peak_bytes = 0
        self.peak_where = ""

    def reserve(self, key: str, nbytes: int) -> None:
        """Account ``nbytes`` under ``key`` (added to what ``key`` already holds).

        Raises:
            BudgetExceeded: the total would exceed the budget; nothing is reserved.
        """
        nbytes = int(nbytes)
        with self._lock:
            total = self.current_bytes + nbytes
            if self.budget_bytes is not None and total > self.budget_bytes:
                raise BudgetExceeded(
                    total, self.budget_bytes, f"holding {format_bytes(nbytes)} for {key}",
                    detail=f"held now: {self._summary()}; the batch is larger than the plan allows: lower it, "
                           "raise the budget or enable recompute")
            self._held[key] = self._held.get(key, 0) + nbytes
            self.current_bytes = total
            if total > self.peak_bytes:
                self.peak_bytes, self.peak_where = total, key

    def release(self, key: str) -> int:
        """Drop everything held under ``key``; returns the bytes freed (0 if none)."""
        with self._lock:
            n = self._held.pop(key, 0)
            self.current_bytes -= n
            return n

    def held(self, prefix: str = "") -> int:
        """Bytes held under keys starting with ``prefix``."""
        with self._lock:
            return sum(v for k, v in self._held.items() if k.startswith(prefix))

    def _summary(self) -> str:
        top = sorted(self._held.items(), key=lambda kv: -kv[1])[:4]
        return ", ".join(f"{k} {format_bytes(v)}" for k, v in top) or "nothing"
