"""Make freed tensor memory go back to the operating system, so the process peak follows the ledger.

torch's CPU tensors come from the C library's ``malloc``. glibc serves large requests with
``mmap`` and returns them on ``free`` -- until the first such free, after which its *dynamic*
mmap threshold rises to that size and later requests of up to it (a block's weights, a chunk of
optimizer state) come from heap arenas that keep freed memory. With several threads (prefetch,
update, I/O) each using its own arena, a streamed step then leaves the process holding several
times the budget although the executor holds no more than the budget at any moment.

:func:`set_mmap_threshold` fixes the threshold (``mallopt(M_MMAP_THRESHOLD)``), which also
turns the dynamic adjustment off: every request at or above it is mapped and unmapped. This is
a process-wide setting; the trainer applies it (:data:`DISK_MMAP_THRESHOLD_BYTES`) on the disk
tier unless told otherwise. On the host tier, whose state is process memory anyway, it leaves
malloc alone: there every mapped activation and gradient is faulted in afresh each step (a
48-block GPT at 8x: 847 k page faults over six steps against 185 k; 25-40 % more CPU time per
step on it and on an MLP) and the process peak was no lower.
"""

from __future__ import annotations

import ctypes
import logging

from ..memory import libc_function

__all__ = ["set_mmap_threshold", "M_MMAP_THRESHOLD", "DISK_MMAP_THRESHOLD_BYTES"]

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3
"""glibc's ``mallopt`` parameter number (malloc.h)."""

DISK_MMAP_THRESHOLD_BYTES = 1 << 18
"""The disk tier's fixed threshold (256 KiB): a block's weights, gradients and update chunks are
mapped and returned; smaller activations come from the heap."""


def set_mmap_threshold(nbytes: int) -> bool:
    """Serve every ``malloc`` of at least ``nbytes`` with its own mapping, returned on ``free``.

    Returns:
        True where glibc accepted it; False elsewhere (another C library, or a value glibc
        refuses: it accepts up to 32 MiB on 64-bit systems).
    """
    mallopt = libc_function("mallopt", (ctypes.c_int, ctypes.c_int), ctypes.c_int)
    if mallopt is None:
        return False
    ok = bool(mallopt(M_MMAP_THRESHOLD, int(nbytes)))
    if ok:
        log.info("malloc: requests of %d bytes or more are mapped and unmapped (fixed mmap threshold)", nbytes)
    return ok
