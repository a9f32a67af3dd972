"""How large a value a training step may take in or produce, and the check that applies it.

float32 overflows above ``F = 3.4e38``, and a magnitude above ``sqrt(F) = 1.8e19`` overflows as soon
as it is squared. Squares are everywhere in training: batch statistics (variance), the MSE loss,
and AdamW's second moment ``v = beta2 * v + (1 - beta2) * g * g``. Hence:

* :data:`SQUARE_SAFE_LIMIT` (``sqrt(F)``) bounds the **input** values (checked before any step,
  :func:`~.validate.check_inputs`): a larger sample (a sensor glitch such as 3e38) cannot be
  normalised or squared, and the first layer's gradient, proportional to it, would overflow the
  optimizer state.
* It also bounds every **gradient**, checked before the update: AdamW's moments are convex
  combinations of their previous value and ``g`` (first) or ``g * g`` (second), so with
  ``|g| <= sqrt(F)`` and a finite state the new state is finite again; with a larger ``g`` the
  second moment becomes inf and that element never moves again (``m / sqrt(inf) = 0``) or turns
  NaN. ONNX Runtime exposes no optimizer state to read, so this bound is what keeps it finite
  (SGD keeps none).
* :data:`~edgeadapt.onnx_guard.MAX_ABS_VALUE` bounds every **trained value** after each update
  and before every save: it is what loading accepts, so no saved checkpoint fails to load.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import numpy as np

__all__ = ["SQUARE_SAFE_LIMIT", "first_out_of_range"]

#: Largest magnitude whose square is a finite float32 (1.84e19).
SQUARE_SAFE_LIMIT = float(np.sqrt(np.finfo(np.float32).max))


def first_out_of_range(get: Callable[[str], np.ndarray], names: Iterable[str],
                       limit: float) -> tuple[str, float] | None:
    """The first of ``names`` whose value (``get(name)``, a float array) holds a NaN, an inf or a
    magnitude above ``limit``, with its largest magnitude (NaN when it holds a NaN); ``None`` when
    all are within. Uses min/max only: no temporaries beyond the array ``get`` returns."""
    for name in names:
        value = get(name)
        if not value.size or not np.issubdtype(value.dtype, np.floating):
            continue
        lo, hi = float(value.min()), float(value.max())
        if not (lo >= -limit and hi <= limit):  # False for NaN as well
            return name, math.nan if math.isnan(lo) or math.isnan(hi) else max(-lo, hi)
    return None
