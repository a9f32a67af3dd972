"""The input check counts NaN/inf slice by slice: the count must be exact across slice boundaries."""

from __future__ import annotations

import numpy as np
import pytest

from edgeadapt.runtime import InputError
from edgeadapt.runtime import validate


class _Spec:
    shape = (None, 8, 256)
    dtype = "float32"


class _Manifest:
    input = _Spec()


def test_nonfinite_count_is_exact_across_slices(monkeypatch):
    monkeypatch.setattr(validate, "_CHECK_CHUNK_BYTES", 3 * 8 * 256 * 4)  # 3 windows per slice
    x = np.zeros((10, 8, 256), dtype=np.float32)
    x[0, 0, 0] = np.nan
    x[2, 7, 255] = np.inf  # last entry of the first slice
    x[3, 0, 0] = -np.inf   # first entry of the second slice
    x[9, 4, 100:110] = np.nan  # the last, shorter slice
    with pytest.raises(InputError, match=r"contains 13 NaN or infinite values"):
        validate.check_inputs(_Manifest(), x)
    validate.check_inputs(_Manifest(), np.ones((10, 8, 256), dtype=np.float32))  # finite: accepted


def test_swapped_channel_and_time_axes_get_the_transpose_as_the_fix():
    with pytest.raises(InputError, match=r"last two axes are swapped: transpose them"):
        validate.check_inputs(_Manifest(), np.zeros((4, 256, 8), dtype=np.float32))
    with pytest.raises(InputError, match=r"window and transpose the data to match"):
        validate.check_inputs(_Manifest(), np.zeros((4, 8, 100), dtype=np.float32))
