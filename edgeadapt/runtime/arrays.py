"""Numpy arrays as ONNX Runtime reads them: native byte order, C-contiguous, held by the caller.

``OrtValue.ortvalue_from_numpy`` (and a session fed with such values) keeps only a pointer to the
array's buffer, reads it as C-ordered elements of the platform's byte order, and does not keep
the array alive. So every buffer handed to ONNX Runtime is first made :func:`native_contiguous`
(a copy only when the array is not so already) and the caller holds that exact array in a local
name until the run that reads it has returned.
"""

from __future__ import annotations

import numpy as np

__all__ = ["native_contiguous", "Rows"]


def native_contiguous(a: np.ndarray) -> np.ndarray:
    """``a`` in native byte order and C order: ``a`` itself when it already is, else a copy
    (transposed, sliced, Fortran-order or non-native byte-order arrays)."""
    return np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("="))


class Rows:
    """The windows ``rows`` of ``data`` (a shuffled batch, the windows left after some are held
    back), gathered only when sliced: a pass copies its windows at a time instead of them all."""

    def __init__(self, data: np.ndarray, rows: np.ndarray):
        self.data, self.rows = data, rows

    @classmethod
    def of(cls, data: np.ndarray | None, rows: np.ndarray) -> Rows | None:
        return None if data is None else cls(data, rows)

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self.rows), *self.data.shape[1:])

    def __getitem__(self, part: slice | np.ndarray) -> np.ndarray:
        return self.data[self.rows[part]]

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        out = self.data[self.rows]
        return out if dtype is None else out.astype(dtype)
