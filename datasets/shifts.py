"""Sensor shifts of one subject's windows: the synthetic shift suites of the label-free study.

A new subject's device often differs from the training devices in ways no subject effect
covers: another sensor's gain and offset, channels plugged in another order, a noisier front
end, a different sampling clock. :func:`shift_subject` applies one such shift, drawn once per
subject (a property of the device, the same for all its windows), to that subject's windows of
a :class:`WindowDataset`; the others are untouched. Scales are relative to each channel's
standard deviation over the subject's windows, so ``severity`` means the same on any data.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from .window_dataset import WindowDataset

__all__ = ["SHIFTS", "shift_subject"]

SHIFTS = ("gain-offset", "channel-swap", "noise", "time-warp")


def _warp(X: np.ndarray, factor: float) -> np.ndarray:
    """Each window read at ``factor`` times its speed (linear interpolation, the last sample held)."""
    steps = X.shape[-1]
    src = np.clip(np.arange(steps) * factor, 0, steps - 1)
    lo = np.floor(src).astype(np.int64)
    hi = np.minimum(lo + 1, steps - 1)
    frac = (src - lo).astype(X.dtype)
    return X[..., lo] * (1 - frac) + X[..., hi] * frac


def shift_subject(ds: WindowDataset, subject: int, kind: str, seed: int = 0, severity: float = 1.0) -> WindowDataset:
    """``ds`` with the windows of ``subject`` shifted by ``kind`` (one of :data:`SHIFTS`).

    * ``gain-offset``: per-channel gain ``exp(U(-0.5, 0.5) * severity)`` and offset
      ``N(0, 0.5 * severity)`` channel standard deviations;
    * ``channel-swap``: two random pairs of channels exchanged (one pair with 2 or 3 channels);
    * ``noise``: white noise of ``0.5 * severity`` channel standard deviations;
    * ``time-warp``: every window played ``exp(+-0.2 * severity)`` times faster or slower.

    Raises:
        ValueError: unknown ``kind``, a subject not in ``ds``, or ``severity`` < 0.
    """
    if kind not in SHIFTS:
        raise ValueError(f"shift must be one of {SHIFTS}, got {kind!r}")
    if not severity >= 0:
        raise ValueError(f"severity must be >= 0, got {severity}")
    rows = np.flatnonzero(ds.subject == subject)
    if not rows.size:
        raise ValueError(f"subject {subject} is not in the dataset (subjects: {sorted(set(ds.subject.tolist()))})")
    rng = np.random.default_rng([seed, int(subject), SHIFTS.index(kind)])
    X = ds.X[rows].astype(np.float64)
    n_channels = X.shape[1]
    std = X.std(axis=(0, 2), keepdims=True) + 1e-12
    if kind == "gain-offset":
        gain = np.exp(rng.uniform(-0.5, 0.5, size=(1, n_channels, 1)) * severity)
        X = X * gain + rng.normal(0.0, 0.5 * severity, size=(1, n_channels, 1)) * std
    elif kind == "channel-swap":
        order = np.arange(n_channels)
        pairs = rng.permutation(n_channels)[:4 if n_channels >= 4 else 2]
        for a, b in pairs.reshape(-1, 2):
            order[[a, b]] = order[[b, a]]
        X = X[:, order]
    elif kind == "noise":
        X = X + 0.5 * severity * std * rng.standard_normal(X.shape)
    else:
        X = _warp(X, float(np.exp(rng.choice([-1.0, 1.0]) * 0.2 * severity)))
    out = ds.X.copy()
    out[rows] = X.astype(out.dtype)
    return replace(ds, X=out)
