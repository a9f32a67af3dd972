"""Biosignal datasets for edgeadapt: numpy + scipy only, so they run on the device too.

Import as ``edgeadapt.datasets`` (never as a top-level ``datasets``).

* :class:`WindowDataset` — the one data value: ``X`` float32 ``(windows, channels, time_steps)``,
  ``y``, ``subject`` (and optional ``session``, ``recording``, ``start_sample``) int64, names and
  sample rate; ``.npz`` save/load without pickle.
* :func:`make_synthetic` — a seeded multi-subject EMG-like generator with tunable subject shift.
* :func:`load_watch` — real smartwatch IMU exercise recordings shipped with ``seglearn==1.2.5``.
* :func:`load_npz_file`, :func:`load_csv`, :func:`load_dataset` — the user's own data.
* :class:`ChannelNormalizer`, :func:`loso_splits`, :func:`few_shot_split`,
  :func:`label_shift_split`, :func:`unlabeled_split` — evaluation plumbing.
"""

from .io import load_csv, load_dataset, load_npz_file
from .normalize import ChannelNormalizer
from .safe_pickle import NumpyOnlyUnpickler, load_object_npy
from .splits import FewShotSplit, SubjectSplit, few_shot_split, label_shift_split, loso_splits, unlabeled_split
from .synthetic import SyntheticConfig, make_synthetic
from .watch import WATCH_INSTALL_HINT, WATCH_SAMPLE_RATE_HZ, find_watch_file, load_watch, read_watch_file
from .window_dataset import WindowDataset, read_npz
from .windowing import (
    LabelRule,
    contiguous_runs,
    hop_samples,
    window_labels,
    window_signal,
    window_starts,
    windows_from_continuous,
)

__all__ = [
    "WindowDataset",
    "read_npz",
    "SyntheticConfig",
    "make_synthetic",
    "WATCH_INSTALL_HINT",
    "WATCH_SAMPLE_RATE_HZ",
    "find_watch_file",
    "read_watch_file",
    "load_watch",
    "NumpyOnlyUnpickler",
    "load_object_npy",
    "LabelRule",
    "hop_samples",
    "window_starts",
    "window_signal",
    "window_labels",
    "contiguous_runs",
    "windows_from_continuous",
    "ChannelNormalizer",
    "SubjectSplit",
    "FewShotSplit",
    "loso_splits",
    "few_shot_split",
    "label_shift_split",
    "unlabeled_split",
    "load_npz_file",
    "load_csv",
    "load_dataset",
]
