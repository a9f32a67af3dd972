"""Real data that works offline: smartwatch IMU recordings of shoulder exercises.

The recordings ship inside the PyPI package ``seglearn==1.2.5`` as
``seglearn/data/watch_dataset.npy`` (BSD-3-Clause; Burns et al. 2018, "Shoulder physiotherapy
exercise recognition: machine learning the inertial signals from a smartwatch",
https://arxiv.org/abs/1802.01489). Only that data file is used: seglearn is located with
:func:`importlib.util.find_spec` (which, for a top-level package, does not import it) and the
file, a pickled object array, is read by :class:`~edgeadapt.datasets.safe_pickle.NumpyOnlyUnpickler`.

What the file holds (checked on seglearn 1.2.5): 140 continuous recordings, each one set of
exercise repetitions by one subject with the watch on one arm; 10 subjects (ids 1..10), 7
exercises (``PEN ABD FEL IR ER TRAP ROW``), both arms per subject and exercise (14 recordings
per subject), 6 axes (``ax ay az``: accelerometer, ``wx wy wz``: gyroscope) at 50 Hz, 947 to
2618 samples (19 to 52 s) per recording.

:func:`load_watch` windows every recording on its own (a window never spans two recordings)
and keeps the arm as ``session`` (0 = left, 1 = right).
"""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path

import numpy as np

from .safe_pickle import load_object_npy
from .window_dataset import WindowDataset
from .windowing import hop_samples, window_signal

__all__ = ["WATCH_SAMPLE_RATE_HZ", "WATCH_INSTALL_HINT", "find_watch_file", "read_watch_file", "load_watch"]

logger = logging.getLogger(__name__)

WATCH_SAMPLE_RATE_HZ = 50.0
WATCH_INSTALL_HINT = "pip install --no-deps seglearn==1.2.5"
_RELATIVE_PATH = Path("data") / "watch_dataset.npy"
_KEYS = ("X", "y", "subject", "side", "X_labels", "y_labels")


def find_watch_file() -> Path:
    """Path of ``seglearn/data/watch_dataset.npy`` in the installed seglearn, without importing it.

    Raises:
        FileNotFoundError: seglearn is not installed or lacks the file; the message gives the
            install command.
    """
    spec = importlib.util.find_spec("seglearn")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the watch dataset comes with seglearn, which is not installed: {WATCH_INSTALL_HINT}")
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / _RELATIVE_PATH
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"seglearn at {list(spec.submodule_search_locations)} has no {_RELATIVE_PATH}; "
        f"reinstall the version that ships it: {WATCH_INSTALL_HINT}"
    )


def read_watch_file(path: str | os.PathLike[str]) -> dict[str, object]:
    """The raw recordings of the watch file, read without executing pickled code.

    Args:
        path: the ``watch_dataset.npy`` file.

    Returns:
        ``{"X": list of (time, 6) float arrays, "y", "subject", "side": arrays (recordings,),
        "X_labels": 6 axis names, "y_labels": 7 exercise names}``.

    Raises:
        ValueError: naming the file, when its content does not have that structure.
        pickle.UnpicklingError: the file names a global outside numpy array reconstruction.
    """
    data = load_object_npy(path)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a dict of recordings, found {type(data).__name__}")
    missing = [k for k in _KEYS if k not in data]
    if missing:
        raise ValueError(f"{path}: missing keys {missing} (has {sorted(data)})")
    n = len(data["X"])
    for key in ("y", "subject", "side"):
        if len(data[key]) != n:
            raise ValueError(f"{path}: {key!r} has {len(data[key])} entries for {n} recordings")
    for i, recording in enumerate(data["X"]):
        if not isinstance(recording, np.ndarray) or recording.ndim != 2 or recording.shape[1] != len(data["X_labels"]):
            raise ValueError(
                f"{path}: recording {i} is not a (time, {len(data['X_labels'])}) array: "
                f"{getattr(recording, 'shape', type(recording).__name__)}"
            )
    return data


def load_watch(
    *,
    window_length_samples: int = 100,
    overlap_fraction: float = 0.5,
    path: str | os.PathLike[str] | None = None,
) -> WindowDataset:
    """The smartwatch exercise recordings as labelled windows.

    Defaults give 2 s windows (100 samples at 50 Hz) with 50 % overlap: 4,677 windows of shape
    ``(6, 100)`` from 10 subjects, 7 classes. ``recording`` and ``start_sample`` are filled, so
    :func:`~edgeadapt.datasets.few_shot_split` keeps overlapping windows apart.

    Args:
        window_length_samples: samples per window (50 per second).
        overlap_fraction: overlap of consecutive windows of a recording, in ``[0, 1)``.
        path: the ``watch_dataset.npy`` file; default: the one in the installed seglearn.

    Returns:
        Windows with ``subject`` = the study's subject ids (1..10), ``session`` = arm
        (0 left, 1 right), ``class_names`` = exercise codes, ``channel_names`` = axis names.
    """
    path = find_watch_file() if path is None else Path(path)
    data = read_watch_file(path)
    hop = hop_samples(window_length_samples, overlap_fraction)
    X_parts, start_parts, recording_ids = [], [], []
    for i, recording in enumerate(data["X"]):
        X_rec, starts = window_signal(recording, window_length_samples, hop)
        X_parts.append(X_rec)
        start_parts.append(starts)
        recording_ids.append(np.full(starts.size, i, dtype=np.int64))
    recording = np.concatenate(recording_ids)
    if recording.size == 0:
        raise ValueError(f"{path}: no recording is as long as a window of {window_length_samples} samples")
    too_short = len(data["X"]) - np.unique(recording).size
    if too_short:
        logger.info("%d recordings are shorter than a window of %d samples and give no windows", too_short,
                    window_length_samples)

    def per_window(values: object) -> np.ndarray:
        return np.asarray(values).astype(np.int64)[recording]

    dataset = WindowDataset(
        X=np.concatenate(X_parts),
        y=per_window(data["y"]),
        subject=per_window(data["subject"]),
        session=per_window(data["side"]),
        recording=recording,
        start_sample=np.concatenate(start_parts),
        class_names=tuple(data["y_labels"]),
        channel_names=tuple(data["X_labels"]),
        sample_rate_hz=WATCH_SAMPLE_RATE_HZ,
    )
    logger.info("watch dataset: %d windows of %s from %d subjects, %d classes (%s)", len(dataset),
                dataset.X.shape[1:], dataset.subjects.size, dataset.n_classes, path)
    return dataset
