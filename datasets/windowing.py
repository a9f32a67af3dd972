"""Cut continuous multichannel recordings into fixed-length, possibly overlapping windows.

A window of length ``L`` with ``overlap_fraction`` ``o`` advances by ``hop = L - round(L * o)``
samples; only whole windows are kept (a recording's tail shorter than a hop is dropped). A window
never spans two recordings: :func:`windows_from_continuous` first splits the stream into runs of
constant subject (and session) and windows each run on its own.

Per-sample labels become one label per window by :class:`LabelRule`: the most frequent label in
the window (ties go to the smaller class id) or the label of its last sample (what a causal,
streaming classifier would be asked to predict).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from enum import Enum

import numpy as np

from .samples import float32_samples
from .window_dataset import WindowDataset

__all__ = [
    "LabelRule",
    "hop_samples",
    "window_starts",
    "window_signal",
    "window_labels",
    "contiguous_runs",
    "windows_from_continuous",
]

logger = logging.getLogger(__name__)


class LabelRule(str, Enum):
    """How per-sample labels become the label of a window."""

    MAJORITY = "majority"
    LAST = "last"


def hop_samples(window_length_samples: int, overlap_fraction: float) -> int:
    """Samples between the starts of consecutive windows.

    Args:
        window_length_samples: samples per window, >= 1.
        overlap_fraction: fraction of a window shared with the next one, in ``[0, 1)``.

    Returns:
        ``window_length_samples - round(window_length_samples * overlap_fraction)``, at least 1.
    """
    if int(window_length_samples) != window_length_samples or window_length_samples < 1:
        raise ValueError(f"window_length_samples must be a positive integer, got {window_length_samples}")
    if not 0.0 <= overlap_fraction < 1.0:
        raise ValueError(f"overlap_fraction must be in [0, 1), got {overlap_fraction}")
    return max(1, int(window_length_samples) - int(round(window_length_samples * overlap_fraction)))


def window_starts(n_samples: int, window_length_samples: int, hop: int) -> np.ndarray:
    """First-sample indices (``int64``) of every whole window in a recording of ``n_samples``."""
    if n_samples < window_length_samples:
        return np.zeros(0, dtype=np.int64)
    return np.arange(0, n_samples - window_length_samples + 1, hop, dtype=np.int64)


def window_signal(signal: np.ndarray, window_length_samples: int, hop: int) -> tuple[np.ndarray, np.ndarray]:
    """Windows of a ``(time, channels)`` recording, channels-first.

    Args:
        signal: array ``(time, channels)``.
        window_length_samples: samples per window.
        hop: samples between window starts.

    Returns:
        ``(X, starts)``: ``float32`` windows ``(windows, channels, window_length_samples)`` and
        their ``int64`` first-sample indices.
    """
    if signal.ndim != 2:
        raise ValueError(f"signal must be 2-D (time, channels), got shape {signal.shape}")
    starts = window_starts(signal.shape[0], window_length_samples, hop)
    if starts.size == 0:
        return np.zeros((0, signal.shape[1], window_length_samples), dtype=np.float32), starts
    # sliding_window_view over time gives (time - L + 1, channels, L): already channels-first.
    view = np.lib.stride_tricks.sliding_window_view(signal, window_length_samples, axis=0)
    return view[starts].astype(np.float32, order="C"), starts  # C order: the view's gather is not


def window_labels(
    labels: np.ndarray, starts: np.ndarray, window_length_samples: int, rule: LabelRule | str
) -> np.ndarray:
    """One ``int64`` label per window from per-sample labels.

    Args:
        labels: non-negative ``int`` array ``(time,)``.
        starts: window first-sample indices, as from :func:`window_starts`.
        window_length_samples: samples per window.
        rule: :class:`LabelRule` or its value.
    """
    rule = LabelRule(rule)
    labels = np.asarray(labels, dtype=np.int64)
    if starts.size == 0:
        return np.zeros(0, dtype=np.int64)
    if rule is LabelRule.LAST:
        return labels[starts + window_length_samples - 1]
    # Per-class counts in every window from cumulative one-hot sums: O(time * classes) memory
    # instead of O(windows * window_length).
    n_classes = int(labels.max()) + 1
    one_hot = np.zeros((labels.size + 1, n_classes), dtype=np.int64)
    one_hot[np.arange(1, labels.size + 1), labels] = 1
    cumulative = np.cumsum(one_hot, axis=0)
    counts = cumulative[starts + window_length_samples] - cumulative[starts]
    return np.argmax(counts, axis=1).astype(np.int64)


def contiguous_runs(*keys: np.ndarray) -> list[tuple[int, int]]:
    """``[start, stop)`` sample ranges over which every key array stays constant."""
    n = keys[0].shape[0]
    if n == 0:
        return []
    change = np.zeros(n - 1, dtype=bool)
    for key in keys:
        change |= key[1:] != key[:-1]
    bounds = np.concatenate([[0], np.flatnonzero(change) + 1, [n]])
    return [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]


def windows_from_continuous(
    signal: np.ndarray,
    labels: np.ndarray,
    subject: np.ndarray,
    session: np.ndarray | None = None,
    *,
    sample_rate_hz: float,
    window_length_samples: int,
    overlap_fraction: float = 0.5,
    label_rule: LabelRule | str = LabelRule.MAJORITY,
    class_names: Sequence[str] | None = None,
    channel_names: Sequence[str] | None = None,
) -> WindowDataset:
    """Window a continuous stream of samples into a :class:`WindowDataset`.

    The stream is split into runs of constant ``subject`` (and ``session``); each run is one
    recording (``recording`` = run index, ``start_sample`` = index in the stream) and is windowed
    on its own, so no window mixes two subjects or sessions. Runs shorter than a window give none.

    Args:
        signal: ``(time, channels)`` samples, finite.
        labels: ``(time,)`` non-negative integer class id per sample.
        subject: ``(time,)`` integer subject id per sample.
        session: optional ``(time,)`` integer session id per sample.
        sample_rate_hz: sampling rate.
        window_length_samples: samples per window.
        overlap_fraction: overlap of consecutive windows, in ``[0, 1)``.
        label_rule: how per-sample labels become a window label (:class:`LabelRule`).
        class_names: names of class ids; default ``"0" .. str(max label)``.
        channel_names: names of the channels; default ``"ch0", "ch1", ...``.
    """
    signal = np.asarray(signal)
    if signal.ndim != 2 or signal.shape[0] == 0:
        raise ValueError(f"signal must be 2-D (time, channels) with samples, got shape {signal.shape}")
    signal = float32_samples(signal, "signal")
    n = signal.shape[0]
    per_sample = {"labels": labels, "subject": subject} | ({} if session is None else {"session": session})
    arrays = {}
    for name, values in per_sample.items():
        values = np.asarray(values)
        if values.shape != (n,):
            raise ValueError(f"{name} must have one entry per sample, shape ({n},), got {values.shape}")
        if not np.issubdtype(values.dtype, np.integer):
            raise TypeError(f"{name} must be integers, got dtype {values.dtype}")
        arrays[name] = values.astype(np.int64)
    if arrays["labels"].min() < 0:
        raise ValueError(f"labels must be class ids >= 0, got {arrays['labels'].min()}")
    finite = np.isfinite(signal)
    if not finite.all():
        first = int(np.flatnonzero(~finite.all(axis=1))[0])
        raise ValueError(
            f"signal holds {int((~finite).sum())} NaN/inf values (first at sample {first}); "
            "drop or interpolate them before windowing"
        )
    hop = hop_samples(window_length_samples, overlap_fraction)
    keys = [arrays["subject"]] + ([arrays["session"]] if session is not None else [])
    X_parts, y_parts, start_parts, run_ids = [], [], [], []
    for run_id, (a, b) in enumerate(contiguous_runs(*keys)):
        X_run, starts = window_signal(signal[a:b], window_length_samples, hop)
        if starts.size == 0:
            logger.info("run of %d samples at sample %d is shorter than a window (%d samples): no windows",
                        b - a, a, window_length_samples)
        X_parts.append(X_run)
        y_parts.append(window_labels(arrays["labels"][a:b], starts, window_length_samples, label_rule))
        start_parts.append(starts + a)
        run_ids.append(np.full(starts.size, run_id, dtype=np.int64))
    start_sample = np.concatenate(start_parts)
    n_classes = int(arrays["labels"].max()) + 1
    return WindowDataset(
        X=np.concatenate(X_parts),
        y=np.concatenate(y_parts),
        subject=arrays["subject"][start_sample],
        session=None if session is None else arrays["session"][start_sample],
        recording=np.concatenate(run_ids),
        start_sample=start_sample,
        class_names=tuple(class_names) if class_names is not None else tuple(str(i) for i in range(n_classes)),
        channel_names=(
            tuple(channel_names) if channel_names is not None else tuple(f"ch{i}" for i in range(signal.shape[1]))
        ),
        sample_rate_hz=sample_rate_hz,
    )
