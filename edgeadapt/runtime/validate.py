"""Checks of data against a bundle's input and label specifications, before any step runs."""

from __future__ import annotations

import math

import numpy as np

from ..bundle import Manifest
from .arrays import native_contiguous
from .errors import InputError
from .finite import SQUARE_SAFE_LIMIT

__all__ = ["check_inputs", "check_labels", "check_class_ids", "check_learning_rate", "check_int",
           "describe_axes", "fits_shape"]


def check_learning_rate(lr: object, what: str = "lr") -> float:
    """The learning rate as a float; :class:`InputError` unless it is a finite number > 0.

    (A rate stored in a bundle is also bounded by ``MAX_LR``, checked with the manifest; one
    given to :meth:`Runner.adapt` may be larger, e.g. to provoke divergence on purpose.)
    """
    if isinstance(lr, bool):
        raise InputError(f"{what} must be a number, got {lr!r}")
    try:
        value = float(lr)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise InputError(f"{what} must be a number, got {lr!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise InputError(f"{what} must be a finite number > 0, got {value}")
    return value


def check_int(value: object, what: str, minimum: int = 1) -> int:
    """``value`` as an int; :class:`InputError` unless it is a whole number (a Python or numpy
    integer: not a float, not a bool) of at least ``minimum``."""
    wanted = "a positive int" if minimum == 1 else f"an int >= {minimum}"
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise InputError(f"{what} must be {wanted}, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise InputError(f"{what} must be {wanted}, got {value!r}")
    return int(value)


def check_inputs(manifest: Manifest, x: np.ndarray, what: str = "X") -> np.ndarray:
    """``x`` as the runner feeds it (:func:`~.arrays.native_contiguous`: ``x`` itself when it is
    native-order and C-contiguous already, else one copy); :class:`InputError` unless ``x`` is a
    float32 batch (any byte order or memory layout) of the bundle's input shape whose values are
    finite and at most :data:`~.finite.SQUARE_SAFE_LIMIT` (1.8e19) in magnitude (see
    :mod:`.finite`); the message names the first offending window and channel."""
    spec = manifest.input
    if not isinstance(x, np.ndarray):
        raise InputError(f"{what} must be a numpy array, got {type(x).__name__}")
    if x.ndim == 0:
        raise InputError(f"{what} is a scalar; it must be a batch of windows {list(spec.shape)}")
    if x.dtype.newbyteorder("=") != np.dtype(spec.dtype):
        raise InputError(f"{what} has dtype {x.dtype}, the bundle expects {spec.dtype}; "
                         f"convert with {what}.astype(np.{spec.dtype})")
    want = spec.shape
    if not fits_shape(want, x.shape):
        shown = ["batch" if w is None else w for w in want]
        swapped = len(want) >= 3 and fits_shape(want, (*x.shape[:-2], x.shape[-1], x.shape[-2]))
        fix = ("its last two axes are swapped: transpose them (x.transpose(0, 2, 1)); a .npz file stores X as "
               "(windows, time steps, channels)") if swapped else "window and transpose the data to match"
        raise InputError(f"{what} has shape {list(x.shape)}, the bundle expects {shown} {describe_axes(want)}; {fix}")
    if x.shape[0] == 0:
        raise InputError(f"{what} is empty")
    nonfinite, extreme = _count_out_of_range(x)
    if nonfinite[0]:
        raise InputError(f"{what} contains {nonfinite[0]} NaN or infinite values (first at {_where(x, nonfinite[1])}); "
                         "clean or impute them first")
    if extreme[0]:
        raise InputError(
            f"{what} holds {extreme[0]} values above {SQUARE_SAFE_LIMIT:.3g} in magnitude (first at "
            f"{_where(x, extreme[1])}: {float(x[extreme[1]]):.3g}), whose squares overflow float32 in batch "
            "statistics, the loss and the optimizer state; drop or clip those windows (a sensor glitch?) or "
            "normalise the data as the source model was trained")
    return native_contiguous(x)


def fits_shape(want, shape) -> bool:
    """Whether ``shape`` is the bundle's input shape ``want`` (``None``: any size on that axis)."""
    return len(shape) == len(want) and all(w is None or w == g for w, g in zip(want, shape))


def describe_axes(shape) -> str:
    """A bundle's input ``shape`` in words: ``(batch, 4 channels, 16 time steps)`` for windows of
    a 1-D signal, else ``(batch first, as exported)``."""
    if len(shape) != 3:
        return "(batch first, as exported)"
    channels, steps = ("any number of" if n is None else n for n in shape[1:])
    return f"(batch, {channels} channels, {steps} time steps)"


_CHECK_CHUNK_BYTES = 64 * 1024


def _where(x: np.ndarray, index: tuple[int, ...]) -> str:
    """An element's place in words: window, and channel when ``x`` is (windows, channels, ...)."""
    return f"window {index[0]}" + (f", channel {index[1]}" if x.ndim >= 3 else "")


def _count_out_of_range(x: np.ndarray) -> tuple[tuple[int, tuple | None], tuple[int, tuple | None]]:
    """(count, first index) of the NaN/inf entries of ``x`` and of the finite ones above
    ``SQUARE_SAFE_LIMIT`` in magnitude, checked window by window in slices of at most ~64 KiB of
    input so the check's temporaries stay small (they fall inside a measured ``adapt`` call)."""
    per_window = max(1, x[0].nbytes)
    step = max(1, _CHECK_CHUNK_BYTES // per_window)
    counts, firsts = [0, 0], [None, None]
    for s in range(0, x.shape[0], step):
        part = x[s:s + step]
        if np.abs(part).max() <= SQUARE_SAFE_LIMIT:  # False for a NaN
            continue
        for i, bad in enumerate((~np.isfinite(part), np.isfinite(part) & (np.abs(part) > SQUARE_SAFE_LIMIT))):
            if (k := int(np.count_nonzero(bad))) and firsts[i] is None:
                first = np.unravel_index(int(np.argmax(bad)), part.shape)
                firsts[i] = (s + int(first[0]), *map(int, first[1:]))
            counts[i] += k
    return (counts[0], firsts[0]), (counts[1], firsts[1])


def _one_per_window(y, n_windows: int, what: str) -> None:
    if not isinstance(y, np.ndarray):
        raise InputError(f"{what} must be a numpy array, got {type(y).__name__}")
    if y.ndim == 0:
        raise InputError(f"{what} is a scalar; it must hold one entry per window of X ({n_windows})")
    if y.shape[0] != n_windows:
        raise InputError(f"{what} has {y.shape[0]} entries but X has {n_windows} windows; they must match")


def _class_ids(y: np.ndarray, n_classes: int, what: str, purpose: str) -> np.ndarray:
    if not np.issubdtype(y.dtype, np.integer):
        raise InputError(f"{what} must hold integer class indices {purpose}, got dtype {y.dtype}")
    if y.ndim != 1:
        raise InputError(f"{what} must have shape (windows,), got {list(y.shape)}")
    lo, hi = int(y.min()), int(y.max())
    if lo < 0 or hi >= n_classes:
        raise InputError(
            f"{what} has labels in [{lo}, {hi}] but the model has {n_classes} classes (0..{n_classes - 1}); "
            "map the labels to the classes the source model was trained on"
        )
    return native_contiguous(y)


def check_class_ids(y: np.ndarray, n_windows: int, n_classes: int, what: str = "y",
                    purpose: str = "for the accuracy") -> np.ndarray:
    """``y`` as integer class ids, one per window, in ``0..n_classes-1`` (native-order,
    C-contiguous); :class:`InputError` naming what is wrong otherwise."""
    _one_per_window(y, n_windows, what)
    return _class_ids(y, n_classes, what, purpose)


def check_labels(manifest: Manifest, y: np.ndarray | None, n_windows: int, what: str = "y") -> np.ndarray | None:
    """``y`` as the runner feeds it (native-order, C-contiguous, see :func:`check_inputs`), or
    ``None`` for a label-free loss; :class:`InputError` unless ``y`` suits the bundle's loss (or
    is absent for a label-free one)."""
    spec = manifest.label
    if spec is None:
        if y is not None:
            raise InputError(f"the bundle's loss {manifest.loss!r} is label-free; do not pass {what}")
        return None
    if y is None:
        raise InputError(f"the bundle's loss {manifest.loss!r} needs labels; pass {what}")
    _one_per_window(y, n_windows, what)
    if manifest.loss == "cross_entropy":
        if np.issubdtype(y.dtype, np.integer) and y.dtype.newbyteorder("=") != np.dtype(spec["dtype"]):
            raise InputError(
                f"{what} has dtype {y.dtype}, the bundle expects {spec['dtype']} class indices; "
                f"convert with {what}.astype(np.{spec['dtype']})"
            )
        n = spec["n_classes"] if spec["n_classes"] is not None else manifest.output.shape[-1]
        return _class_ids(y, n, what, "for cross_entropy")
    want = spec["shape"]
    if y.ndim != len(want) or any(w is not None and w != g for w, g in zip(want, y.shape)):
        raise InputError(f"{what} has shape {list(y.shape)}, "
                         f"the bundle expects {['batch' if w is None else w for w in want]}")
    if not np.issubdtype(y.dtype, np.floating):
        raise InputError(f"{what} must be float targets for {manifest.loss}, got dtype {y.dtype}")
    if y.dtype.newbyteorder("=") != np.dtype(spec["dtype"]):
        raise InputError(f"{what} has dtype {y.dtype}, the bundle expects {spec['dtype']}; "
                         f"convert with {what}.astype(np.{spec['dtype']})")
    if not np.isfinite(y).all():
        raise InputError(f"{what} contains NaN or infinite values")
    if manifest.loss == "bce_with_logits" and (y.min() < 0 or y.max() > 1):
        raise InputError(f"{what} must lie in [0, 1] for bce_with_logits, got [{y.min()}, {y.max()}]")
    return native_contiguous(y)
