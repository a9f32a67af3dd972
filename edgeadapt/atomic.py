"""Crash-safe writes: a temp file or directory in the same folder, then an atomic rename.

A reader never sees a half-written file: either the previous version or the new one. Data are
fsynced before the rename, so a power loss cannot leave a renamed but empty file behind.
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

__all__ = ["atomic_path", "atomic_write_bytes", "atomic_write_json", "staged_directory"]


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success it replaces ``path`` atomically.

    The body writes the temporary file by any means (an engine that only takes a path, such
    as ONNX Runtime's checkpoint writer, included). If the body raises, the temporary file is
    removed and ``path`` is untouched.
    """
    path = Path(path)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        _fsync_path(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_path(path.parent)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` so that ``path`` holds either the old or the new bytes."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def atomic_write_json(path: str | os.PathLike, value: Any) -> None:
    """Write ``value`` as indented, key-sorted JSON, atomically."""
    atomic_write_bytes(path, (json.dumps(value, indent=2, sort_keys=True) + "\n").encode())


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
    _fsync_path(target.parent)
