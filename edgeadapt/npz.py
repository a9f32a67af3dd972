"""Reading plain ``.npz`` archives from elsewhere: no pickle, every header checked before allocation.

``np.load`` trusts an array's header: a member whose header claims a shape of 2^40 elements
allocates (or fails with ``MemoryError``) before it finds the data missing, and a member that is
not ``.npy`` at all comes back as raw bytes. :func:`read_arrays` reads each member's header first
and refuses anything but a ``.npy`` array of plain dtype whose claimed size fits in the bytes the
member holds. Torch-free (numpy and the standard library only): the device side uses it too.
"""

from __future__ import annotations

import math
import os
import zipfile
from pathlib import Path

import numpy as np

__all__ = ["read_arrays"]

_NPY_SUFFIX = ".npy"


def _member_header(z: zipfile.ZipFile, info: zipfile.ZipInfo) -> tuple[tuple[int, ...], np.dtype]:
    """(shape, dtype) from a member's ``.npy`` header; ``ValueError`` when there is none."""
    with z.open(info) as f:
        version = np.lib.format.read_magic(f)
        read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, _, dtype = read(f)
    return shape, dtype


def read_arrays(path: str | os.PathLike, *, max_unpacked_bytes: int | None = None) -> dict[str, np.ndarray]:
    """All named arrays of the ``.npz`` at ``path``, read with ``allow_pickle=False``.

    Before any array is read: every member must be a ``.npy`` file (``np.savez`` writes nothing
    else), its header readable, its dtype free of Python objects, and the bytes its shape claims
    no more than the member holds; with ``max_unpacked_bytes`` the members together must not
    unpack to more.

    Raises:
        ValueError: starting with ``path``, naming the member and what is wrong.
    """
    path = Path(path)
    try:
        with zipfile.ZipFile(path) as z:
            infos = z.infolist()
            unpacked = sum(i.file_size for i in infos)
            if max_unpacked_bytes is not None and unpacked > max_unpacked_bytes:
                raise ValueError(f"{path}: unpacks to {unpacked} bytes, more than {max_unpacked_bytes}; not read")
            for info in infos:
                name = info.filename
                if not name.endswith(_NPY_SUFFIX) or info.is_dir():
                    raise ValueError(f"{path}: member {name[:80]!r} is not a .npy array (an .npz holds only "
                                     "arrays saved with np.savez)")
                try:
                    shape, dtype = _member_header(z, info)
                except Exception as e:  # numpy raises ValueError / EOFError / SyntaxError on a bad header
                    raise ValueError(f"{path}: member {name[:80]!r} has no readable .npy header "
                                     f"({type(e).__name__}: {str(e)[:120]})") from None
                if dtype.hasobject:
                    raise ValueError(f"{path}: Object arrays cannot be loaded without pickle (member {name[:80]!r}); "
                                     "store strings as str arrays, never as objects")
                claimed = math.prod(shape) * dtype.itemsize
                if claimed > info.file_size:
                    raise ValueError(f"{path}: member {name[:80]!r} claims shape {list(shape)} of {dtype} "
                                     f"({claimed} bytes) but holds {info.file_size} bytes; the file is damaged")
    except ValueError:
        raise
    except Exception as e:  # zipfile raises BadZipFile, OSError, NotImplementedError, ...
        raise ValueError(f"{path}: not a readable .npz file ({type(e).__name__}: {str(e)[:200]})") from None
    try:
        with np.load(path, allow_pickle=False) as loaded:
            return {key: loaded[key] for key in loaded.files}
    except Exception as e:  # numpy raises ValueError/OSError/EOFError/zip errors for damaged members
        raise ValueError(f"{path}: not a readable .npz file ({type(e).__name__}: {str(e)[:200]})") from None
