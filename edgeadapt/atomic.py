"""Crash-safe file writes: temp file or directory in the same folder, then an atomic rename.

A reader never sees a half-written file: either the previous version or the new one. Every
writer here fsyncs the data before the rename so a power loss cannot leave a renamed but empty
file behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["atomic_write_bytes", "atomic_write_json", "atomic_copy", "staged_directory"]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` so that ``path`` holds either the old or the new bytes."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


def atomic_write_json(path: str | os.PathLike, value: Any) -> None:
    """Write ``value`` as indented, key-sorted JSON, atomically."""
    atomic_write_bytes(path, (json.dumps(value, indent=2, sort_keys=True) + "\n").encode())


def atomic_copy(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Copy ``src`` to ``dst`` through a temp file and an atomic rename."""
    dst = Path(dst)
    fd, tmp = tempfile.mkstemp(prefix=f".{dst.name}.", suffix=".tmp", dir=dst.parent)
    os.close(fd)
    try:
        shutil.copyfile(src, tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, dst)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def staged_directory(target: str | os.PathLike) -> Iterator[Path]:
    """Build a new directory in a hidden sibling and move it to ``target`` only on success.

    ``target`` must not exist yet (an existing directory is never replaced wholesale: callers
    that update a directory in place write files atomically and switch a pointer file last).
    If the body raises, the staging directory is removed and ``target`` is not created.

    Yields:
        The staging directory to fill.
    """
    target = Path(target)
    if target.exists():
        raise FileExistsError(f"{target} already exists; choose a new output directory or remove it")
    target.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent))
    try:
        yield stage
        os.rename(stage, target)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    _fsync_dir(target.parent)
