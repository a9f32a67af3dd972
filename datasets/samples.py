"""The rule for the sample values of a data file (``X`` or ``signal``): real numbers, held as float32.

* float32 (either byte order) is kept as it is.
* Other real floats (float16, float64, longdouble) are converted to float32, each value rounded to
  24 significant bits; a finite value beyond float32's range (3.4e38), which would become inf,
  is refused.
* Integers (signed or unsigned) are converted to float32: exact up to 2^24 in magnitude, rounded
  above (then the note is a warning).
* Anything else is refused: complex (whether the real part, the imaginary part or the magnitude
  is the signal is the user's choice), booleans, strings, objects, dates.

A conversion is noted once per array (logging: INFO, WARNING where integers are rounded).
"""

from __future__ import annotations

import logging

import numpy as np

__all__ = ["float32_samples", "FLOAT32_EXACT_INTEGER"]

logger = logging.getLogger(__name__)

#: Largest integer magnitude float32 holds exactly (24 significant bits).
FLOAT32_EXACT_INTEGER = 1 << 24
_FLOAT32_MAX = float(np.finfo(np.float32).max)


def float32_samples(values: np.ndarray, what: str) -> np.ndarray:
    """``values`` as float32 by the rule above (``values`` itself when it is float32 already).

    Args:
        values: the samples.
        what: names them in messages, e.g. ``"data.npz: 'X'"``.

    Raises:
        TypeError: not real numbers (complex, bool, strings, objects, ...).
        ValueError: a finite float beyond float32's range.
    """
    dtype = values.dtype
    if dtype.kind == "c":
        raise TypeError(f"{what} holds complex numbers ({dtype}); samples must be real: save the real part, the "
                        "imaginary part or the magnitude explicitly (np.real, np.imag, np.abs)")
    if dtype.kind not in "fiu":
        raise TypeError(f"{what} must hold real numbers (float or integer), got dtype {dtype}")
    if dtype.kind == "f" and dtype.itemsize == 4:
        return values
    if dtype.kind == "f":
        finite = values[np.isfinite(values)]
        peak = float(np.abs(finite).max()) if finite.size else 0.0
        if peak > _FLOAT32_MAX:
            raise ValueError(f"{what} holds a value of magnitude {peak:.3g}, beyond float32's range "
                             f"({_FLOAT32_MAX:.3g}); rescale the data (the runner computes in float32)")
        logger.info("%s: converting %s samples to float32 (the runner computes in float32)", what, dtype)
    elif values.size and (peak := max(abs(int(values.min())), abs(int(values.max())))) > FLOAT32_EXACT_INTEGER:
        logger.warning("%s: converting %s samples to float32 rounds those above 2^24 = %d in magnitude (up to %d "
                       "here); the runner computes in float32", what, dtype, FLOAT32_EXACT_INTEGER, peak)
    else:
        logger.info("%s: converting %s samples to float32 (exact)", what, dtype)
    return values.astype(np.float32)
