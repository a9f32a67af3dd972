"""Where master weights and optimizer state live between uses: host memory or files on disk.

A block's state is a few flat float32 vectors (``param``; ``exp_avg`` and ``exp_avg_sq`` for
AdamW), one per *kind*. :class:`HostStore` keeps them as tensors in RAM (page-locked when the
compute device is a GPU, so copies to it can run asynchronously). :class:`DiskStore` keeps one
file per block and kind and reads and writes them explicitly; after each whole read and write,
and after each block's chunked update, it advises the kernel to drop the files' pages
(``posix_fadvise(DONTNEED)`` where available), so what keeps the state out of RAM is the design,
not the page cache (at most one block's vectors are cached between two drops).

With optimizer-state sharding (ZeRO-1, :mod:`edgeadapt.server.zero`) a store holds ``param``
for every block but the optimizer's kinds only for ``state_blocks``, the blocks this rank owns.

A step split into micro-batches sums each block's gradients over them in the kind
:data:`ACCUMULATOR`, added by :meth:`StateStore.add_accumulators` the first time a plan needs
it: beside the master weights, in the same tier (host memory or a file), never in the compute
tier.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import shutil
from pathlib import Path

import torch

from ..units import format_bytes

__all__ = ["StateStore", "HostStore", "DiskStore", "OffloadDirError", "KINDS", "ACCUMULATOR"]

log = logging.getLogger(__name__)

KINDS = ("param", "exp_avg", "exp_avg_sq")

ACCUMULATOR = "grad_acc"
"""The kind holding a block's gradients summed over the micro-batches of a step."""


class OffloadDirError(OSError):
    """The disk tier's folder cannot hold the state (read-only, not a folder, or too full)."""


class StateStore:
    """Flat float32 vectors per (block, kind).

    Args:
        numels: element count of each block's flat vector.
        kinds: the kinds stored (``param`` plus the optimizer's state).
        state_blocks: the blocks whose optimizer state (every kind but ``param``) is held here;
            ``None``: every block (no sharding).
    """

    tier = "host"

    def __init__(self, numels: list[int], kinds: tuple[str, ...], state_blocks=None):
        self.numels = list(numels)
        self.kinds = tuple(kinds)
        self.state_blocks = frozenset(range(len(self.numels)) if state_blocks is None else state_blocks)

    def holds(self, block: int, kind: str) -> bool:
        """Whether ``kind`` of ``block`` is kept in this store (``param`` always is)."""
        return kind == "param" or (kind in self.kinds and block in self.state_blocks)

    def _held(self) -> list[tuple[int, str]]:
        return [(b, k) for b in range(len(self.numels)) for k in self.kinds if self.holds(b, k)]

    @property
    def total_bytes(self) -> int:
        """Bytes of master weights and optimizer state held here."""
        return sum(4 * self.numels[b] for b, _ in self._held())

    @property
    def optimizer_state_bytes(self) -> int:
        """Bytes of optimizer state (every kind but ``param`` and the gradient accumulators) held here."""
        return sum(4 * self.numels[b] for b, k in self._held() if k not in ("param", ACCUMULATOR))

    def add_accumulators(self) -> None:
        """Hold the kind :data:`ACCUMULATOR` from now on (no-op when held already)."""
        if ACCUMULATOR in self.kinds:
            return
        self.kinds = (*self.kinds, ACCUMULATOR)
        self._allocate([(b, ACCUMULATOR) for b in range(len(self.numels)) if self.holds(b, ACCUMULATOR)])

    def _allocate(self, keys: list[tuple[int, str]]) -> None:
        """Make room for the vectors ``keys`` (``(block, kind)``)."""
        raise NotImplementedError

    def read(self, block: int, kind: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """The flat vector; ``out`` (float32, right size) receives it when given."""
        raise NotImplementedError

    def write(self, block: int, kind: str, flat: torch.Tensor) -> None:
        """Replace the stored vector with ``flat`` (a CPU float32 vector)."""
        raise NotImplementedError

    def read_range(self, block: int, kind: str, start: int, count: int,
                   out: torch.Tensor | None = None, *, drop: bool = True) -> torch.Tensor:
        """Elements ``start .. start + count`` of the vector, as a new CPU tensor (or into ``out``,
        a contiguous CPU float32 tensor of ``count`` elements). ``drop=False``: the caller drops
        the pages later (:meth:`drop_pages`)."""
        values = self.read(block, kind)[start:start + count]
        return values.clone() if out is None else out.copy_(values)

    def write_range(self, block: int, kind: str, start: int, values: torch.Tensor, *, drop: bool = True) -> None:
        """Overwrite elements from ``start`` with ``values`` (``drop`` as in :meth:`read_range`)."""
        flat = self.read(block, kind).clone()
        flat[start:start + values.numel()] = values
        self.write(block, kind, flat)

    def drop_pages(self, block: int, kinds) -> None:
        """Let the OS drop the cached pages of ``block``'s vectors of ``kinds`` (no-op in memory)."""

    def in_place(self) -> bool:
        """True when :meth:`read` returns the stored tensor itself (updates land without write)."""
        return False

    def close(self) -> None:
        """Release files or memory."""


class HostStore(StateStore):
    """State in host memory.

    Args:
        numels: element count per block.
        kinds: stored kinds.
        pin: page-lock the tensors (for asynchronous copies to a GPU).
        state_blocks: blocks whose optimizer state is held (``None``: all).
    """

    tier = "host"

    def __init__(self, numels: list[int], kinds: tuple[str, ...], *, pin: bool = False, state_blocks=None):
        super().__init__(numels, kinds, state_blocks)
        self._pin = pin
        self._t: dict[tuple[int, str], torch.Tensor] = {}
        self._allocate(self._held())

    def _allocate(self, keys: list[tuple[int, str]]) -> None:
        for b, k in keys:
            self._t[(b, k)] = torch.zeros(self.numels[b], dtype=torch.float32, pin_memory=self._pin)

    def read(self, block: int, kind: str, out: torch.Tensor | None = None) -> torch.Tensor:
        t = self._t[(block, kind)]
        if out is None:
            return t
        return out.copy_(t)

    def write(self, block: int, kind: str, flat: torch.Tensor) -> None:
        t = self._t[(block, kind)]
        if flat.data_ptr() != t.data_ptr():
            t.copy_(flat)

    def in_place(self) -> bool:
        return True

    def close(self) -> None:
        self._t.clear()


def _bytes_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor as a writable memoryview (no numpy: ``Tensor.numpy``
    would make the storage non-resizable, and the executor frees weight storage by resizing)."""
    n = t.numel() * t.element_size()
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


def _drop_cache(fd: int, offset: int = 0, length: int = 0) -> None:
    if hasattr(os, "posix_fadvise"):
        try:
            os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
        except OSError:  # some filesystems do not support the advice; it is only advice
            pass


def check_offload_dir(path: Path, need_bytes: int) -> None:
    """Fail before training when ``path`` cannot hold ``need_bytes`` of state files.

    Raises:
        OffloadDirError: not creatable, not writable, or less free space than needed.
    """
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OffloadDirError(e.errno or errno.EIO, f"the disk tier's folder {str(path)!r} cannot be created "
                              f"({e.strerror or e}); choose a writable offload_dir / --checkpoint-dir") from None
    probe = path / ".edgeadapt-write-probe"
    try:
        with open(probe, "wb") as f:
            f.write(b"\0" * 4096)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise OffloadDirError(e.errno or errno.EIO, f"the disk tier's folder {str(path)!r} is not writable "
                              f"({e.strerror or e}); choose a writable offload_dir") from None
    finally:
        try:
            probe.unlink()
        except OSError:
            pass
    free = shutil.disk_usage(path).free
    if free < need_bytes:
        raise OffloadDirError(errno.ENOSPC, f"the disk tier needs {format_bytes(need_bytes)} in {str(path)!r} but "
                              f"only {format_bytes(free)} is free; free space or choose another offload_dir")


class DiskStore(StateStore):
    """State in files ``<dir>/<block index>.<kind>.f32`` (raw little-endian float32).

    Each file is created at its full size up front (``posix_fallocate`` where available, so a
    full disk fails at the start, not mid-step) and kept open for the run; reads and writes go
    straight between the file and the caller's tensor (``preadv``/``pwrite``, no intermediate
    buffer), and after each the kernel is advised to drop the file's pages.

    Args:
        numels: element count per block.
        kinds: stored kinds.
        directory: the folder; created; checked for room before anything is written.
        state_blocks: blocks whose optimizer state is held (``None``: all).
    """

    tier = "disk"

    def __init__(self, numels: list[int], kinds: tuple[str, ...], directory: str | os.PathLike, *,
                 state_blocks=None):
        super().__init__(numels, kinds, state_blocks)
        self.directory = Path(directory)
        check_offload_dir(self.directory, self.total_bytes)
        self._paths: dict[tuple[int, str], Path] = {}
        self._fds: dict[tuple[int, str], int] = {}
        self._allocate(self._held())

    def _allocate(self, keys: list[tuple[int, str]]) -> None:
        for b, k in keys:
            path = self.directory / f"{b:05d}.{k}.f32"
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            self._paths[(b, k)], self._fds[(b, k)] = path, fd
            nbytes = 4 * self.numels[b]
            try:
                if hasattr(os, "posix_fallocate") and nbytes:
                    os.posix_fallocate(fd, 0, nbytes)
                else:
                    os.ftruncate(fd, nbytes)
            except OSError as e:
                if e.errno in (errno.EINVAL, errno.EOPNOTSUPP):  # a filesystem without fallocate
                    os.ftruncate(fd, nbytes)
                else:
                    raise OffloadDirError(e.errno or errno.EIO, f"cannot allocate {format_bytes(nbytes)} for {path} "
                                          f"({e.strerror or e}); free space or choose another offload_dir") from None

    def read(self, block: int, kind: str, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.read_range(block, kind, 0, self.numels[block], out=out)

    def read_range(self, block: int, kind: str, start: int, count: int,
                   out: torch.Tensor | None = None, *, drop: bool = True) -> torch.Tensor:
        if out is None:
            out = torch.empty(count, dtype=torch.float32)
        fd = self._fds[(block, kind)]
        mv, pos = _bytes_view(out), 4 * start
        while mv:
            got = os.preadv(fd, [mv], pos)
            if got == 0:
                raise OSError(errno.EIO, f"{self._paths[(block, kind)]} is shorter than expected; the offload folder "
                              "was changed while training")
            mv, pos = mv[got:], pos + got
        if drop:
            _drop_cache(fd, 4 * start, 4 * count)
        return out

    def write_range(self, block: int, kind: str, start: int, values: torch.Tensor, *, drop: bool = True) -> None:
        values = values.detach().contiguous()
        fd = self._fds[(block, kind)]
        mv, pos = _bytes_view(values), 4 * start
        while mv:
            n = os.pwrite(fd, mv, pos)
            mv, pos = mv[n:], pos + n
        if drop:
            _drop_cache(fd, 4 * start, 4 * values.numel())

    def drop_pages(self, block: int, kinds) -> None:
        for k in kinds:
            if (block, k) in self._fds:
                _drop_cache(self._fds[(block, k)])

    def write(self, block: int, kind: str, flat: torch.Tensor) -> None:
        self.write_range(block, kind, 0, flat)

    def close(self) -> None:
        for fd in self._fds.values():
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds.clear()
        for p in self._paths.values():
            try:
                p.unlink()
            except OSError:
                pass
        log.debug("removed the disk tier's files in %s", self.directory)
