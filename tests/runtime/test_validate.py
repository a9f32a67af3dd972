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
    expected = (r"has shape \[4, 256, 8\], the bundle expects \['batch', 8, 256\] \(batch, 8 channels, 256 time "
                r"steps\); its last two axes are swapped: transpose them")
    with pytest.raises(InputError, match=expected):
        validate.check_inputs(_Manifest(), np.zeros((4, 256, 8), dtype=np.float32))
    with pytest.raises(InputError, match=r"window and transpose the data to match"):
        validate.check_inputs(_Manifest(), np.zeros((4, 8, 100), dtype=np.float32))


@pytest.mark.parametrize("value, minimum, message", [
    (0, 1, "n must be a positive int, got 0"), (-1, 0, "n must be an int >= 0, got -1"),
    (1.5, 1, r"n must be a positive int, got 1\.5 \(float\)"), (2.0, 1, r"got 2\.0 \(float\)"),
    (True, 1, r"got True \(bool\)"), ("3", 1, r"got '3' \(str\)"), (None, 1, r"got None \(NoneType\)"),
])
def test_check_int_refuses_what_is_not_a_whole_number_in_range(value, minimum, message):
    with pytest.raises(InputError, match=message):
        validate.check_int(value, "n", minimum)


def test_check_int_accepts_python_and_numpy_ints():
    assert validate.check_int(3, "n") == 3 and validate.check_int(np.int64(0), "n", 0) == 0
    assert type(validate.check_int(np.int32(7), "n")) is int
