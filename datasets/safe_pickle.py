"""Read pickled numpy object arrays without running arbitrary code.

``np.load(..., allow_pickle=True)`` hands the file to :mod:`pickle`, which calls whatever global a
file names (``os.system`` included). :class:`NumpyOnlyUnpickler` resolves only the handful of
globals that ``np.save`` writes for an object array of numbers, strings, lists, dicts and
ndarrays, and refuses every other one with :class:`pickle.UnpicklingError` naming it. Plain
containers (``dict``, ``list``, ``tuple``, ``str``, numbers) are built by pickle opcodes, not by
globals, so no builtin is admitted.

This exists for one file: the smartwatch recordings shipped as a pickled ``.npy`` in ``seglearn``
(:mod:`edgeadapt.datasets.watch`). User data never goes through pickle.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["NumpyOnlyUnpickler", "load_object_npy"]


def _latin1_encode(text: str, encoding: str) -> bytes:
    """Stand-in for ``_codecs.encode``, which protocol-2 pickles use to rebuild ``bytes``."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise pickle.UnpicklingError(
            f"refused _codecs.encode({type(text).__name__}, {encoding!r}): only latin1-encoded text is admitted"
        )
    return text.encode("latin-1")


# The reconstructors are taken from numpy's own reducers so that both module spellings
# (numpy.core before numpy 2, numpy._core after) resolve without importing a deprecated module.
_RECONSTRUCT = np.ndarray.__reduce__(np.zeros(1))[0]
_SCALAR = np.float64(0).__reduce__()[0]

_ALLOWED: dict[tuple[str, str], Any] = {
    ("numpy.core.multiarray", "_reconstruct"): _RECONSTRUCT,
    ("numpy._core.multiarray", "_reconstruct"): _RECONSTRUCT,
    ("numpy.core.multiarray", "scalar"): _SCALAR,
    ("numpy._core.multiarray", "scalar"): _SCALAR,
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
    ("_codecs", "encode"): _latin1_encode,
}


class NumpyOnlyUnpickler(pickle.Unpickler):
    """An unpickler that admits only numpy array reconstruction.

    Raises:
        pickle.UnpicklingError: on any global outside the allow-list, naming it
            (``"refused global os.system ..."``), before the global is imported or called.
    """

    def find_class(self, module: str, name: str) -> Any:
        try:
            return _ALLOWED[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(
                f"refused global {module}.{name}: this reader only rebuilds numpy arrays and plain containers"
            ) from None


def load_object_npy(path: str | os.PathLike[str]) -> Any:
    """The object stored in a pickled ``.npy`` file (``np.save`` of an object array), read safely.

    Args:
        path: an ``.npy`` file whose array has ``dtype=object``.

    Returns:
        The array's single element when it is 0-d (``np.save(path, some_dict)``), else the array.

    Raises:
        ValueError: the file is not an ``.npy`` of dtype object.
        pickle.UnpicklingError: the pickle names a global outside the allow-list.
    """
    path = Path(path)
    with open(path, "rb") as f:
        try:
            version = np.lib.format.read_magic(f)
        except ValueError as e:
            raise ValueError(f"{path}: not an .npy file ({e})") from e
        if version == (1, 0):
            _, _, dtype = np.lib.format.read_array_header_1_0(f)
        elif version == (2, 0):
            _, _, dtype = np.lib.format.read_array_header_2_0(f)
        else:
            raise ValueError(f"{path}: .npy format version {version} is not 1.0 or 2.0")
        if dtype != np.dtype(object):
            raise ValueError(f"{path}: expected a pickled object array, found dtype {dtype}; use np.load")
        payload = f.read()
    array = NumpyOnlyUnpickler(io.BytesIO(payload), encoding="ASCII").load()
    if not isinstance(array, np.ndarray):
        raise ValueError(f"{path}: the pickle holds a {type(array).__name__}, not a numpy array")
    return array.item() if array.ndim == 0 else array
