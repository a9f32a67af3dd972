"""The one data value of the package: labelled, channels-first windows of biosignals.

Every loader returns a :class:`WindowDataset`; every split and normaliser consumes one. Its
``X`` is ``float32`` of shape ``(windows, channels, time_steps)`` (channels-first, what
``torch.nn.Conv1d`` takes), labels are ``int64`` class ids ``0 .. n_classes - 1``.

Windows cut from the same continuous recording may overlap in time. When a loader knows where a
window came from it fills ``recording`` (an id per continuous recording) and ``start_sample``
(the window's first sample in that recording), so that splits can keep adaptation and evaluation
windows from sharing samples (:func:`edgeadapt.datasets.few_shot_split`).

On disk (:meth:`WindowDataset.save_npz`) a dataset is a plain ``.npz`` without pickled objects:
strings are stored as fixed-width unicode arrays and the file carries a format marker so that
:func:`edgeadapt.datasets.load_npz_file` can tell it from a user's own layout.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..atomic import atomic_path
from ..npz import read_arrays

__all__ = ["WindowDataset", "read_npz", "FORMAT_KEY", "FORMAT_VALUE"]

# Key and value that mark an .npz written by WindowDataset.save_npz (channels-first X).
FORMAT_KEY = "edgeadapt_format"
FORMAT_VALUE = "window_dataset/1"

_REQUIRED_KEYS = ("X", "y", "subject", "class_names", "channel_names")
_OPTIONAL_ARRAYS = ("session", "recording", "start_sample")


def _check_int64_vector(name: str, values: np.ndarray, n_windows: int) -> None:
    if not isinstance(values, np.ndarray):
        raise TypeError(f"{name} must be a numpy array, got {type(values).__name__}; pass np.asarray({name}, np.int64)")
    if values.dtype != np.int64:
        raise TypeError(f"{name} must be int64, got {values.dtype}; pass {name}.astype(np.int64)")
    if values.shape != (n_windows,):
        raise ValueError(f"{name} must have shape ({n_windows},) (one entry per window of X), got {values.shape}")


def _names(kind: str, names: Sequence[str]) -> tuple[str, ...]:
    if isinstance(names, str):
        raise TypeError(f"{kind} must be a sequence of strings, not one string {names!r}")
    out = tuple(str(n) for n in names)
    duplicates = sorted(n for n, count in collections.Counter(out).items() if count > 1)
    if duplicates:
        raise ValueError(f"{kind} must be unique, {duplicates} appear more than once")
    return out


@dataclass(frozen=True, eq=False)
class WindowDataset:
    """Labelled windows of multichannel biosignals, channels-first.

    The arrays are held, not copied; treat them as read-only. ``eq=False``: two datasets compare
    by identity (compare arrays explicitly with ``np.array_equal``).

    Attributes:
        X: ``float32`` array ``(windows, channels, time_steps)``, finite.
        y: ``int64`` array ``(windows,)`` of class ids in ``0 .. len(class_names) - 1``.
        subject: ``int64`` array ``(windows,)``, the subject (person) of each window.
        class_names: one name per class id.
        channel_names: one name per channel (axis 1 of ``X``).
        sample_rate_hz: sampling rate of the time axis, > 0, or ``None`` when not known (windows
            cut elsewhere need none; only windowing a continuous recording by time does).
        session: optional ``int64`` array ``(windows,)``, e.g. recording day or body side.
        recording: optional ``int64`` array ``(windows,)``, the continuous recording a window was
            cut from; given together with ``start_sample``.
        start_sample: optional ``int64`` array ``(windows,)``, the window's first sample index in
            its recording; windows of one recording overlap when their starts differ by less
            than ``time_steps``.
    """

    X: np.ndarray
    y: np.ndarray
    subject: np.ndarray
    class_names: tuple[str, ...]
    channel_names: tuple[str, ...]
    sample_rate_hz: float | None
    session: np.ndarray | None = None
    recording: np.ndarray | None = None
    start_sample: np.ndarray | None = None

    def __post_init__(self) -> None:
        X = self.X
        if not isinstance(X, np.ndarray):
            raise TypeError(f"X must be a numpy array, got {type(X).__name__}")
        if X.ndim != 3:
            raise ValueError(
                f"X must be 3-D (windows, channels, time_steps), got shape {X.shape}; "
                "window continuous recordings first (edgeadapt.datasets.windows_from_continuous)"
            )
        if X.dtype != np.float32:
            raise TypeError(f"X must be float32, got {X.dtype}; pass X.astype(np.float32)")
        n_windows = X.shape[0]
        _check_int64_vector("y", self.y, n_windows)
        _check_int64_vector("subject", self.subject, n_windows)
        for name in _OPTIONAL_ARRAYS:
            values = getattr(self, name)
            if values is not None:
                _check_int64_vector(name, values, n_windows)
        if (self.recording is None) != (self.start_sample is None):
            raise ValueError("recording and start_sample must be given together (or neither)")
        object.__setattr__(self, "class_names", _names("class_names", self.class_names))
        object.__setattr__(self, "channel_names", _names("channel_names", self.channel_names))
        if self.sample_rate_hz is not None:
            object.__setattr__(self, "sample_rate_hz", float(self.sample_rate_hz))
        if not self.class_names:
            raise ValueError("class_names must name at least one class")
        if len(self.channel_names) != X.shape[1]:
            raise ValueError(
                f"channel_names has {len(self.channel_names)} names but X has {X.shape[1]} channels "
                "(axis 1); X must be channels-first (windows, channels, time_steps)"
            )
        if self.sample_rate_hz is not None and not (np.isfinite(self.sample_rate_hz) and self.sample_rate_hz > 0):
            raise ValueError(f"sample_rate_hz must be a positive number, got {self.sample_rate_hz}")
        bad = ~np.isfinite(X)
        if bad.any():
            w, c, t = np.argwhere(bad)[0]
            raise ValueError(
                f"X holds {int(bad.sum())} NaN/inf values (first at window {w}, channel {c}, step {t}); "
                "drop or interpolate those samples before building windows"
            )
        if n_windows and (self.y.min() < 0 or self.y.max() >= len(self.class_names)):
            outside = np.unique(self.y[(self.y < 0) | (self.y >= len(self.class_names))])
            raise ValueError(
                f"y holds labels {outside[:10].tolist()} outside 0..{len(self.class_names) - 1} "
                f"({len(self.class_names)} class_names); labels must be class ids 0..n_classes-1"
            )

    def __len__(self) -> int:
        return int(self.X.shape[0])

    @property
    def n_classes(self) -> int:
        """Number of classes (``len(class_names)``), whether or not every class has windows."""
        return len(self.class_names)

    @property
    def n_channels(self) -> int:
        """Number of channels (axis 1 of ``X``)."""
        return int(self.X.shape[1])

    @property
    def n_time_steps(self) -> int:
        """Samples per window (axis 2 of ``X``)."""
        return int(self.X.shape[2])

    @property
    def subjects(self) -> np.ndarray:
        """Sorted unique subject ids, ``int64``."""
        return np.unique(self.subject)

    def recording_order(self) -> np.ndarray:
        """Window indices in recording order (by ``recording``, then ``start_sample``) when the
        dataset knows where its windows came from; otherwise ``0 .. len - 1`` (as stored).
        Label-free adaptation wants its windows so: it measures its statistics' noise on groups of
        neighbouring windows (``ds.subset(ds.recording_order())``)."""
        if self.recording is None or self.start_sample is None:
            return np.arange(len(self), dtype=np.int64)
        return np.lexsort((self.start_sample, self.recording)).astype(np.int64)

    def subset(self, mask_or_indices: np.ndarray | Sequence[int] | Sequence[bool]) -> WindowDataset:
        """The windows selected by a boolean mask or by integer indices, as a new dataset.

        Args:
            mask_or_indices: a boolean array of length ``len(self)``, or non-negative integer
                indices (any order, repeats allowed).

        Returns:
            A dataset whose arrays are copies of the selected windows.
        """
        idx = np.asarray(mask_or_indices)
        if idx.dtype == bool:
            if idx.shape != (len(self),):
                raise ValueError(f"boolean mask must have shape ({len(self)},), got {idx.shape}")
            idx = np.flatnonzero(idx)
        elif idx.size == 0:
            idx = np.zeros(0, dtype=np.int64)
        elif not np.issubdtype(idx.dtype, np.integer):
            raise TypeError(f"subset takes a boolean mask or integer indices, got dtype {idx.dtype}")
        if idx.ndim != 1:
            raise ValueError(f"indices must be 1-D, got shape {idx.shape}")
        if idx.size and (idx.min() < 0 or idx.max() >= len(self)):
            raise IndexError(f"indices must lie in 0..{len(self) - 1}, got min {idx.min()} max {idx.max()}")
        optional = {}
        for name in _OPTIONAL_ARRAYS:
            values = getattr(self, name)
            optional[name] = None if values is None else values[idx]
        return dataclasses.replace(self, X=self.X[idx], y=self.y[idx], subject=self.subject[idx], **optional)

    def save_npz(self, path: str | os.PathLike[str]) -> Path:
        """Write the dataset to ``path`` atomically (temporary file in the same folder, then rename).

        The file holds no pickled objects and loads with :meth:`load_npz`.

        Args:
            path: destination; written exactly there (no ``.npz`` is appended).

        Returns:
            The destination path.
        """
        path = Path(path)
        arrays: dict[str, np.ndarray] = {
            FORMAT_KEY: np.array(FORMAT_VALUE),
            "X": self.X,
            "y": self.y,
            "subject": self.subject,
            "class_names": np.array(self.class_names, dtype=np.str_),
            "channel_names": np.array(self.channel_names, dtype=np.str_),
        }
        if self.sample_rate_hz is not None:
            arrays["sample_rate_hz"] = np.array(self.sample_rate_hz, dtype=np.float64)
        for name in _OPTIONAL_ARRAYS:
            if getattr(self, name) is not None:
                arrays[name] = getattr(self, name)
        with atomic_path(path) as tmp, open(tmp, "wb") as f:
            np.savez(f, **arrays)  # a file object: np.savez appends no ".npz"
        return path

    @classmethod
    def load_npz(cls, path: str | os.PathLike[str]) -> WindowDataset:
        """Read a dataset written by :meth:`save_npz` (``allow_pickle=False``).

        Raises:
            ValueError: naming the file, when it is not a dataset file or fails validation.
        """
        return cls.from_saved_arrays(read_npz(path), source=str(path))

    @classmethod
    def from_saved_arrays(cls, arrays: Mapping[str, np.ndarray], source: str = "arrays") -> WindowDataset:
        """Rebuild a dataset from the named arrays of a :meth:`save_npz` file.

        Args:
            arrays: the file's arrays, e.g. from :func:`read_npz`.
            source: what to name in error messages (the file path).

        Raises:
            ValueError: starting with ``source``: no format marker, missing keys, invalid content.
        """
        if FORMAT_KEY not in arrays:
            raise ValueError(
                f"{source}: not written by WindowDataset.save_npz (no {FORMAT_KEY!r} key); "
                "for your own arrays use edgeadapt.datasets.load_npz_file"
            )
        if str(arrays[FORMAT_KEY]) != FORMAT_VALUE:
            raise ValueError(f"{source}: format {str(arrays[FORMAT_KEY])!r} is not {FORMAT_VALUE!r}")
        missing = [k for k in _REQUIRED_KEYS if k not in arrays]
        if missing:
            raise ValueError(f"{source}: missing keys {missing}")
        fields = {k: arrays[k] for k in (*_REQUIRED_KEYS, *_OPTIONAL_ARRAYS, "sample_rate_hz") if k in arrays}
        fields["class_names"] = tuple(fields["class_names"].tolist())
        fields["channel_names"] = tuple(fields["channel_names"].tolist())
        try:
            fields["sample_rate_hz"] = float(fields["sample_rate_hz"]) if "sample_rate_hz" in fields else None
            return cls(**fields)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{source}: {e}") from e


def read_npz(path: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    """All named arrays of an ``.npz`` file, read with ``allow_pickle=False``.

    Every member's header is checked before it is read (:func:`edgeadapt.npz.read_arrays`).

    Raises:
        FileNotFoundError: there is no such file.
        ValueError: naming the file, when it is not a readable ``.npz``, holds a member that is not
            a ``.npy`` array, pickled objects, or a header claiming more data than the member holds.
    """
    if Path(path).is_dir():
        raise ValueError(f"{path}: is a directory, not a .npz file")
    if Path(path).is_file() and not zipfile.is_zipfile(path):
        with open(path, "rb") as f:
            if f.read(6) == b"\x93NUMPY":
                raise ValueError(f"{path}: holds one array, not named arrays; "
                                 "save with np.savez(path, X=..., y=..., ...)")
        raise ValueError(
            f"{path}: not a readable .npz file (not a zip of .npy arrays, as np.savez writes); "
            "save the arrays with np.savez(path, X=..., y=..., subject=...)"
        )
    if not Path(path).exists():
        raise FileNotFoundError(f"{path}: no such file")
    return read_arrays(path)
