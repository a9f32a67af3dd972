"""The user's own data: ``.npz`` and ``.csv`` files, and :func:`load_dataset`, the one entry point.

Accepted ``.npz`` layouts (read with ``allow_pickle=False``), told apart by their keys:

* **saved dataset** — written by :meth:`WindowDataset.save_npz` (has the ``edgeadapt_format`` key).
* **windows** — ``X``: ``(windows, time, channels)`` real numbers, **time before channels** (the layout
  most recording tools and Keras use; it is transposed to channels-first on loading),
  ``y``: ``(windows,)`` integer class ids >= 0, optional ``subject`` and ``session``:
  ``(windows,)`` integers.
* **continuous** — ``signal``: ``(time, channels)`` numbers, ``y``, ``subject`` and optional
  ``session``: one integer per sample; windowed with ``window_length_samples`` and
  ``overlap_fraction`` (see :func:`~edgeadapt.datasets.windows_from_continuous`).

Sample values (``X``, ``signal``) follow :mod:`~edgeadapt.datasets.samples`: float32 is kept,
other real floats and integers are converted to float32 (noted once in the log), complex,
boolean and non-numeric arrays are refused.

Either of the last two may also hold ``class_names`` and ``channel_names`` (string arrays) and
``sample_rate_hz`` (a number); keyword arguments given to the loader take precedence. No layout
needs ``sample_rate_hz``: windows are cut by ``window_length_samples``, and a dataset whose rate
is not known has ``sample_rate_hz=None``.

A ``.csv`` file holds continuous samples, one per row, with a header
``[subject,][session,]label,<channel>,<channel>,...``: integer subject (and session) ids, a label
that is either an integer class id or a class name, and one number per channel. It is windowed
like the continuous ``.npz`` layout.

``subject`` is optional in every layout (without it the file is one subject's, id 0). Labels
(``y``, the ``label`` column) are required unless the loader is given ``require_labels=False``
(unlabeled data, for label-free adaptation: every window is then of class 0).

Every problem with a file is a ``ValueError`` that starts with the file's path.
"""

from __future__ import annotations

import csv
import itertools
import logging
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .samples import float32_samples
from .synthetic import SyntheticConfig, make_synthetic
from .watch import load_watch
from .window_dataset import FORMAT_KEY, WindowDataset, read_npz
from .windowing import LabelRule, windows_from_continuous

__all__ = ["load_npz_file", "load_csv", "load_dataset"]

logger = logging.getLogger(__name__)

_USER_KEYS = ("y", "subject", "session", "sample_rate_hz", "class_names", "channel_names")
#: Most classes a file's integer labels may imply (labels are ids 0..n_classes-1, one name each).
MAX_CLASSES = 1 << 16
#: Longest CSV line read, in characters (a row of 10^5 channels of 20-digit numbers fits); longer
#: lines are refused before they are held in memory.
MAX_CSV_LINE_CHARS = 1 << 24


def _integers(path: Path, name: str, values: np.ndarray, length: int, what: str) -> np.ndarray:
    if values.shape != (length,):
        raise ValueError(f"{path}: {name!r} must have shape ({length},) (one per {what}), got {values.shape}")
    if not np.issubdtype(values.dtype, np.integer):
        raise ValueError(f"{path}: {name!r} must hold integers, got dtype {values.dtype}")
    return values.astype(np.int64)


def _class_names(path: Path, given: Sequence[str] | None, y: np.ndarray) -> tuple[str, ...]:
    """Names for the (non-empty) labels ``y``; ids are range-checked before any name is made."""
    if y.min() < 0:
        raise ValueError(f"{path}: labels must be class ids >= 0, found {y.min()}")
    if given is None and y.max() >= MAX_CLASSES:
        raise ValueError(f"{path}: label {y.max()} is not a class id of a biosignal dataset (at most {MAX_CLASSES} "
                         "classes, ids 0..n_classes-1); renumber the labels, or pass class_names")
    if given is None:
        return tuple(str(i) for i in range(int(y.max()) + 1))
    names = tuple(given)
    if y.max() >= len(names):
        raise ValueError(f"{path}: label {y.max()} has no name; {len(names)} class_names cover 0..{len(names) - 1}")
    return names


def _check_subject_windows(path: Path, dataset: WindowDataset, input_subjects: np.ndarray, minimum: int) -> None:
    counts = {int(s): int((dataset.subject == s).sum()) for s in np.unique(input_subjects)}
    short = {s: n for s, n in counts.items() if n < minimum}
    if short:
        raise ValueError(
            f"{path}: subjects with fewer than min_windows_per_subject={minimum} windows (subject: windows) "
            f"{short}; record more, shorten window_length_samples, or drop those subjects"
        )


def _defaults(path: Path, stored, n: int, require_labels: bool) -> dict[str, np.ndarray]:
    """The arrays of a file, with the optional ones filled in: no ``subject``: one subject (0);
    no ``y`` where labels are not required: class 0 throughout (unlabeled data)."""
    if "y" not in stored and require_labels:
        raise ValueError(f"{path}: missing key 'y' (integer class ids; found {sorted(stored)}); "
                         "unlabeled data is read by label-free adaptation (edgeadapt adapt --unlabeled)")
    stored = dict(stored)
    if "subject" not in stored:
        stored["subject"] = np.zeros(n, dtype=np.int64)
    if "y" not in stored:
        logger.info("%s: no labels ('y'); read as unlabeled data", path)
        stored["y"] = np.zeros(n, dtype=np.int64)
    return stored


def _metadata(stored: dict[str, np.ndarray], key: str, given: Any) -> Any:
    """The keyword argument if given, else the file's value (a list or a scalar), else None."""
    if given is not None:
        return given
    if key not in stored:
        return None
    value = stored[key]
    return value.tolist() if value.ndim else value.item()


def load_npz_file(
    path: str | os.PathLike[str],
    *,
    sample_rate_hz: float | None = None,
    window_length_samples: int | None = None,
    overlap_fraction: float = 0.5,
    label_rule: LabelRule | str = LabelRule.MAJORITY,
    class_names: Sequence[str] | None = None,
    channel_names: Sequence[str] | None = None,
    min_windows_per_subject: int = 1,
    require_labels: bool = True,
) -> WindowDataset:
    """Load a ``.npz`` in any of the layouts in this module's docstring.

    Args:
        path: the file.
        sample_rate_hz: sampling rate, if known (else the file's ``sample_rate_hz``, else ``None``).
        window_length_samples: samples per window; required for the continuous layout and
            refused for the others (they are windowed already).
        overlap_fraction: continuous layout: overlap of consecutive windows, in ``[0, 1)``.
        label_rule: continuous layout: window label from per-sample labels (``"majority"``/``"last"``).
        class_names: names of class ids 0.., default from the file or ``"0", "1", ...``.
        channel_names: channel names, default from the file or ``"ch0", "ch1", ...``.
        min_windows_per_subject: fail if any subject of the file ends up with fewer windows.
        require_labels: ``False``: a file without ``y`` loads too (unlabeled data, for
            label-free adaptation), every window of class 0.

    Raises:
        ValueError: starting with ``path``: unknown layout, missing keys, wrong shapes or
            dtypes, mismatched lengths, NaN/inf, a subject with too few windows.
    """
    path = Path(path)
    stored = read_npz(path)
    if FORMAT_KEY in stored:
        overrides = {"sample_rate_hz": sample_rate_hz, "window_length_samples": window_length_samples,
                     "class_names": class_names, "channel_names": channel_names}
        given = sorted(k for k, v in overrides.items() if v is not None)
        if given:
            raise ValueError(f"{path}: a saved WindowDataset carries its own metadata; do not pass {given}")
        dataset = WindowDataset.from_saved_arrays(stored, source=str(path))
        _check_subject_windows(path, dataset, dataset.subject, min_windows_per_subject)
        return dataset
    if ("X" in stored) == ("signal" in stored):
        raise ValueError(
            f"{path}: expected either 'X' (windows, time, channels) or 'signal' (time, channels), "
            f"found keys {sorted(stored)}"
        )
    data_key = "X" if "X" in stored else "signal"
    stored = _defaults(path, stored, len(stored[data_key]), require_labels)
    unknown = sorted(set(stored) - {data_key, *_USER_KEYS})
    if unknown:
        logger.warning("%s: ignoring unknown keys %s (known: %s)", path, unknown, sorted({data_key, *_USER_KEYS}))
    arrays = {k: stored[k] for k in (data_key, "y", "subject", "session") if k in stored}
    sample_rate_hz = _metadata(stored, "sample_rate_hz", sample_rate_hz)
    class_names = _metadata(stored, "class_names", class_names)
    channel_names = _metadata(stored, "channel_names", channel_names)
    try:  # the rule for sample values (float32; other reals and integers converted, noted once)
        arrays[data_key] = float32_samples(arrays[data_key], f"{path}: {data_key!r}")
    except TypeError as e:
        raise ValueError(str(e)) from None
    if data_key == "signal":
        if window_length_samples is None:
            raise ValueError(f"{path}: continuous 'signal' needs window_length_samples= (and overlap_fraction=)")
        windowing = {"window_length_samples": window_length_samples, "overlap_fraction": overlap_fraction,
                     "label_rule": label_rule}
        dataset = _from_continuous(path, arrays, sample_rate_hz, class_names, channel_names, windowing)
    else:
        if window_length_samples is not None:
            raise ValueError(f"{path}: 'X' is windowed already; window_length_samples applies to 'signal' only")
        dataset = _from_windows(path, arrays, sample_rate_hz, class_names, channel_names)
    _check_subject_windows(path, dataset, arrays["subject"], min_windows_per_subject)
    return dataset


def _from_continuous(
    path: Path,
    arrays: dict[str, np.ndarray],
    sample_rate_hz: float | None,
    class_names: Sequence[str] | None,
    channel_names: Sequence[str] | None,
    windowing: dict[str, Any],
) -> WindowDataset:
    signal = arrays["signal"]
    if signal.ndim != 2:
        raise ValueError(f"{path}: 'signal' must be 2-D (time, channels), got shape {signal.shape}")
    n = signal.shape[0]
    if n == 0:
        raise ValueError(f"{path}: 'signal' holds no samples")
    per_sample = {k: _integers(path, k, v, n, "sample") for k, v in arrays.items() if k != "signal"}
    names = _class_names(path, class_names, per_sample["y"])
    try:
        return windows_from_continuous(
            signal, per_sample["y"], per_sample["subject"], per_sample.get("session"),
            sample_rate_hz=sample_rate_hz, class_names=names, channel_names=channel_names, **windowing,
        )
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: {e}") from e


def _from_windows(
    path: Path,
    arrays: dict[str, np.ndarray],
    sample_rate_hz: float | None,
    class_names: Sequence[str] | None,
    channel_names: Sequence[str] | None,
) -> WindowDataset:
    X = arrays["X"]
    if X.ndim != 3:
        raise ValueError(
            f"{path}: 'X' must be 3-D (windows, time, channels), got shape {X.shape}; a (time, channels) "
            "recording goes under the key 'signal' with one y and subject per sample"
        )
    n = X.shape[0]
    if n == 0:
        raise ValueError(f"{path}: 'X' holds no windows")
    if X.shape[1] < X.shape[2]:
        logger.warning(
            "%s: X has %d time steps and %d channels; the layout is (windows, time, channels) - if yours is "
            "channels-first, save X.transpose(0, 2, 1)", path, X.shape[1], X.shape[2],
        )
    per_window = {k: _integers(path, k, v, n, "window") for k, v in arrays.items() if k != "X"}
    names = _class_names(path, class_names, per_window["y"])
    try:
        return WindowDataset(
            X=np.ascontiguousarray(X.transpose(0, 2, 1), dtype=np.float32),
            y=per_window["y"],
            subject=per_window["subject"],
            session=per_window.get("session"),
            class_names=names,
            channel_names=channel_names if channel_names is not None else tuple(f"ch{i}" for i in range(X.shape[2])),
            sample_rate_hz=sample_rate_hz,
        )
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: {e}") from e


def _parse_column(path: Path, cells: list[str], lines: list[int], name: str, dtype: type) -> np.ndarray:
    try:
        return np.array(cells, dtype=dtype)
    except ValueError as e:
        for cell, line in zip(cells, lines):
            try:
                dtype(cell)
            except ValueError:
                raise ValueError(f"{path}, line {line}, column {name!r}: {cell!r} is not {dtype.__name__}") from None
        raise ValueError(f"{path}, column {name!r}: {e}") from e


def _bounded_lines(path: Path, f) -> Iterator[str]:
    """The lines of ``f``, each refused past :data:`MAX_CSV_LINE_CHARS` before it is read whole."""
    for number in itertools.count(1):
        line = f.readline(MAX_CSV_LINE_CHARS + 1)
        if not line:
            return
        if len(line) > MAX_CSV_LINE_CHARS:
            raise ValueError(f"{path}, line {number}: longer than {MAX_CSV_LINE_CHARS} characters; a CSV row holds "
                             "one sample (subject, label and one number per channel)")
        yield line


_CSV_META = ("subject", "session", "label")


def _meta_columns(header: list[str]) -> list[str]:
    """The leading columns of a CSV header that are ``subject``, ``session``, ``label`` (each
    optional, in that order); the rest are channels."""
    meta: list[str] = []
    for name in _CSV_META:
        if header[len(meta):len(meta) + 1] == [name]:
            meta.append(name)
    return meta


def _read_csv(path: Path) -> tuple[list[str], list[list[str]], list[int]]:
    """Header, columns of stripped cells, and the file line of each data row; blank lines skipped."""
    # utf-8-sig: spreadsheet exports often start with a byte-order mark.
    with open(path, newline="", encoding="utf-8-sig") as f:
        reader = csv.reader(_bounded_lines(path, f))
        try:
            return _read_rows(path, reader)
        except csv.Error as e:  # e.g. a field over the csv module's limit (131072 characters)
            raise ValueError(f"{path}, line {reader.line_num}: not a CSV row of numbers ({e})") from None


def _read_rows(path: Path, reader) -> tuple[list[str], list[list[str]], list[int]]:
    """:func:`_read_csv` on a csv reader."""
    header = [h.strip() for h in next(reader, [])]
    meta = _meta_columns(header)
    misplaced = sorted(set(header[len(meta):]) & set(_CSV_META))
    if len(header) <= len(meta) or misplaced:
        raise ValueError(
            f"{path}: the header must be '[subject,][session,][label,]<channel>,...' with at least one "
            f"channel, got {header[:8]}{'...' if len(header) > 8 else ''}"
        )
    columns: list[list[str]] = [[] for _ in header]
    lines: list[int] = []
    for row in reader:
        if not row:
            continue
        if len(row) != len(header):
            raise ValueError(f"{path}, line {reader.line_num}: {len(row)} fields, the header has {len(header)}")
        lines.append(reader.line_num)
        for column, cell in zip(columns, row):
            column.append(cell.strip())
    if not lines:
        raise ValueError(f"{path}: no data rows below the header")
    return header, columns, lines


def load_csv(
    path: str | os.PathLike[str],
    *,
    window_length_samples: int,
    sample_rate_hz: float | None = None,
    overlap_fraction: float = 0.5,
    label_rule: LabelRule | str = LabelRule.MAJORITY,
    class_names: Sequence[str] | None = None,
    min_windows_per_subject: int = 1,
    require_labels: bool = True,
) -> WindowDataset:
    """Load continuous samples from a CSV file and window them.

    Header: ``[subject,][session,][label,]<channel>,...``; channel names come from the header.
    Without ``subject`` every row is one subject's (0). Labels that are all integers are class
    ids; otherwise they are class names, numbered in the order of ``class_names`` if given, else
    alphabetically. Without ``label`` (allowed with ``require_labels=False``: unlabeled data)
    every row is of class 0.

    Args:
        path: the file.
        window_length_samples: samples (rows) per window.
        sample_rate_hz: sampling rate of the rows, if known (``None``: not recorded).
        overlap_fraction: overlap of consecutive windows, in ``[0, 1)``.
        label_rule: window label from per-row labels (``"majority"`` or ``"last"``).
        class_names: names of the classes (see above).
        min_windows_per_subject: fail if any subject of the file ends up with fewer windows.
        require_labels: ``False``: a file without a ``label`` column loads too.

    Raises:
        ValueError: starting with ``path`` (and the line where it applies): bad header, wrong
            number of fields, a cell that is not a number, NaN/inf, a subject with too few windows.
    """
    path = Path(path)
    try:
        header, columns, lines = _read_csv(path)
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e})") from e
    meta = _meta_columns(header)
    n_meta = len(meta)
    if "label" not in meta and require_labels:
        raise ValueError(f"{path}: no 'label' column (the header must be '[subject,][session,]label,<channel>,...', "
                         f"got {header[:8]}); unlabeled data is read by label-free adaptation "
                         "(edgeadapt adapt --unlabeled)")
    column = {name: columns[i] for i, name in enumerate(meta)}
    subject = (_parse_column(path, column["subject"], lines, "subject", int) if "subject" in column
               else np.zeros(len(lines), dtype=np.int64))
    session = _parse_column(path, column["session"], lines, "session", int) if "session" in column else None
    channels = zip(columns[n_meta:], header[n_meta:])
    signal = np.stack([_parse_column(path, cells, lines, name, float) for cells, name in channels], axis=1)
    bad_rows = np.flatnonzero(~np.isfinite(signal).all(axis=1))
    if bad_rows.size:
        raise ValueError(f"{path}, line {lines[bad_rows[0]]}: NaN/inf in a channel ({bad_rows.size} such rows)")
    if "label" in column:
        labels, class_names = _csv_labels(path, column["label"], class_names)
    else:
        labels = np.zeros(len(lines), dtype=np.int64)
        class_names = _class_names(path, class_names, labels)
    try:
        dataset = windows_from_continuous(
            signal, labels, subject, session, sample_rate_hz=sample_rate_hz,
            window_length_samples=window_length_samples, overlap_fraction=overlap_fraction, label_rule=label_rule,
            class_names=class_names, channel_names=header[n_meta:],
        )
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: {e}") from e
    _check_subject_windows(path, dataset, subject, min_windows_per_subject)
    return dataset


def _whole_numbers(cells: list[str]) -> np.ndarray | None:
    """``cells`` as int64 class ids where every one is a number (``"2.0"``); ``None`` where any is
    not a number (they are class names).

    Raises:
        ValueError: they are numbers but not all whole ones (no class ids).
    """
    try:
        values = np.array(cells, dtype=np.float64)
    except ValueError:
        return None
    if not np.all(np.isfinite(values) & (values == np.round(values))):
        bad = sorted({c for c, v in zip(cells, values) if not (np.isfinite(v) and v == round(v))})
        raise ValueError(f"labels {bad[:10]} are numbers but not whole class ids; write class ids (0, 1, ...) "
                         "or class names")
    return values.astype(np.int64)


def _csv_labels(path: Path, cells: list[str], class_names: Sequence[str] | None) -> tuple[np.ndarray, tuple[str, ...]]:
    try:
        labels = np.array(cells, dtype=np.int64)
    except ValueError:
        numeric = _whole_numbers(cells) if class_names is None else None
        if numeric is not None:  # "1.0", "2.0": class ids a float column wrote, not names
            return numeric, _class_names(path, class_names, numeric)
        names = tuple(class_names) if class_names is not None else tuple(sorted(set(cells)))
        unknown = sorted(set(cells) - set(names))
        if unknown:
            raise ValueError(f"{path}: labels {unknown[:10]} are not in class_names {list(names)}") from None
        index = {name: i for i, name in enumerate(names)}
        return np.array([index[c] for c in cells], dtype=np.int64), names
    return labels, _class_names(path, class_names, labels)


def load_dataset(name_or_path: str | os.PathLike[str], **kwargs: Any) -> WindowDataset:
    """Load a dataset by name or from a file.

    Args:
        name_or_path: ``"synthetic"`` (keyword arguments are :class:`SyntheticConfig` fields),
            ``"watch"`` (keyword arguments of :func:`~edgeadapt.datasets.load_watch`), or a path
            ending in ``.npz`` (:func:`load_npz_file`) or ``.csv`` (:func:`load_csv`).
        **kwargs: passed on as described.

    Raises:
        FileNotFoundError: a ``.npz``/``.csv`` path that does not exist.
        ValueError: anything else.
    """
    if name_or_path == "synthetic":
        return make_synthetic(SyntheticConfig(**kwargs))
    if name_or_path == "watch":
        return load_watch(**kwargs)
    path = Path(name_or_path)
    loaders = {".npz": load_npz_file, ".csv": load_csv}
    loader = loaders.get(path.suffix.lower())
    if loader is None:
        raise ValueError(f"unknown dataset {str(name_or_path)!r}: use 'synthetic', 'watch', or a .npz or .csv file")
    if path.is_dir():
        raise ValueError(f"{path}: is a directory, not a {path.suffix.lower()} file")
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    return loader(path, **kwargs)
