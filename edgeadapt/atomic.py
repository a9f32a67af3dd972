"""Crash-safe writes: a temp file or directory in the same folder, then an atomic rename.

A reader never sees a half-written file: either the previous version or the new one. Data are
fsynced before the rename, so a power loss cannot leave a renamed but empty file behind.

A staging directory is locked (``flock``) by the process that fills it, so a later writer can
tell an abandoned one (its owner was killed: the lock is gone) from one still being filled, and
removes only the former (:func:`sweep_stale_stages`). Only directories this module made are ever
removed: the name must be exactly ``.<target name>.<random>.partial`` and the directory must hold
the marker file :data:`STAGE_MARKER` (removed from the target right after the rename into place),
or be empty (its writer died between creating it and writing the marker).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = [
    "atomic_path",
    "atomic_write_bytes",
    "atomic_write_json",
    "staged_directory",
    "directory_lock",
    "sweep_stale_stages",
    "STAGE_MARKER",
]

#: File that :func:`staged_directory` writes into every staging directory it makes; a directory
#: without it is never removed, whatever its name.
STAGE_MARKER = ".edgeadapt-staging"


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
def directory_lock(directory: str | os.PathLike, *, exclusive: bool, blocking: bool = True) -> Iterator[bool]:
    """Hold an advisory ``flock`` on a directory (no lock file is created).

    The lock dies with its process, so a killed writer never leaves a directory locked.

    Args:
        directory: an existing directory.
        exclusive: exclusive (writers) or shared (readers).
        blocking: wait for the lock; otherwise yield ``False`` at once when it is taken.

    Yields:
        Whether the lock is held.
    """
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        flags = (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | (0 if blocking else fcntl.LOCK_NB)
        try:
            fcntl.flock(fd, flags)
            held = True
        except OSError as e:
            if blocking or e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                raise
            held = False
        yield held
    finally:
        os.close(fd)  # releases the lock


def _stage_name(target: Path) -> re.Pattern[str]:
    """The names :func:`tempfile.mkdtemp` gives ``target``'s staging directories, matched exactly
    (the target's name is a literal: ``*`` or ``?`` in it match only themselves)."""
    return re.compile(re.escape(f".{target.name}.") + r"[A-Za-z0-9_]+" + re.escape(".partial"))


def sweep_stale_stages(target: str | os.PathLike) -> list[str]:
    """Remove staging directories of ``target`` (:func:`staged_directory`) whose writer is gone.

    A staging directory still locked by a live writer is left alone. Returns the names removed.
    """
    target = Path(target)
    removed = []
    if not target.parent.is_dir():
        return removed
    name = _stage_name(target)
    for stage in target.parent.iterdir():
        if not name.fullmatch(stage.name) or stage.is_symlink() or not stage.is_dir():
            continue
        if not (stage / STAGE_MARKER).is_file() or (stage / STAGE_MARKER).is_symlink():
            # not made by staged_directory, or its writer died right after creating it (then it
            # is empty: rmdir removes nothing else)
            with contextlib.suppress(OSError):
                stage.rmdir()
                removed.append(stage.name)
            continue
        try:
            with directory_lock(stage, exclusive=True, blocking=False) as held:
                if held:
                    shutil.rmtree(stage, ignore_errors=True)
                    removed.append(stage.name)
        except OSError:
            continue  # removed meanwhile
    return removed


@contextlib.contextmanager
def staged_directory(target: str | os.PathLike) -> Iterator[Path]:
    """Build a new directory in a hidden sibling and move it to ``target`` only on success.

    ``target`` must not exist yet (an existing directory is never replaced wholesale: callers
    that update a directory in place write files atomically and switch a pointer file last).
    If the body raises, the staging directory is removed and ``target`` is not created; if the
    process dies, the next call for the same target removes the abandoned staging directory.
    When two processes build the same target at once, the first rename wins and the other
    raises :class:`FileExistsError`.

    Yields:
        The staging directory to fill.
    """
    target = Path(target)
    if target.exists():
        raise FileExistsError(f"{target} already exists; choose a new output directory or remove it")
    target.parent.mkdir(parents=True, exist_ok=True)
    sweep_stale_stages(target)
    stage = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent))
    try:
        (stage / STAGE_MARKER).touch()
        with directory_lock(stage, exclusive=True):
            yield stage
            _fsync_path(stage)
            try:
                os.rename(stage, target)
            except OSError as e:
                if e.errno in (errno.EEXIST, errno.ENOTEMPTY) or target.exists():
                    raise FileExistsError(
                        f"{target} was created by another writer meanwhile; nothing was written"
                    ) from None
                raise
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    # The marker leaves only after the rename: a staging directory killed at any point before it
    # still carries it (or is empty), so the next save of this target removes it. A writer killed
    # between the rename and this unlink leaves the marker in the finished target; the bundle's
    # next save removes it with its other orphans (edgeadapt.bundle.sweep_orphans).
    with contextlib.suppress(FileNotFoundError):
        (target / STAGE_MARKER).unlink()
    _fsync_path(target.parent)
