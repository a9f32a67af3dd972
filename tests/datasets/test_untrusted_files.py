"""A data file is untrusted input: every check is linear in the file and bounded before it
allocates, and every problem is a ValueError naming the file (never csv's, zipfile's or numpy's
own exceptions, and never a MemoryError)."""

from __future__ import annotations

import io
import zipfile

import numpy as np
import pytest

import edgeadapt.datasets.io as dataset_io
from edgeadapt.datasets import WindowDataset, load_csv, load_dataset, load_npz_file
from edgeadapt.npz import read_arrays


def _npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def _windows(n: int = 4) -> dict[str, np.ndarray]:
    return {"X": np.zeros((n, 5, 2), np.float32), "y": np.arange(n) % 2, "subject": np.ones(n, np.int64)}


def _zip(path, members: dict[str, bytes]) -> None:
    with zipfile.ZipFile(path, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)


# ---- .npz --------------------------------------------------------------------------------
def test_a_member_that_is_not_npy_is_refused(tmp_path):
    path = tmp_path / "data.npz"
    _zip(path, {**{f"{k}.npy": _npy_bytes(v) for k, v in _windows().items()}, "notes.txt": b"hello"})
    with pytest.raises(ValueError, match=r"data\.npz: member 'notes\.txt' is not a \.npy array"):
        load_dataset(path)


def test_a_header_claiming_more_than_the_member_holds_is_refused_before_allocating(tmp_path):
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<f4", "fortran_order": False, "shape": (1 << 40,)})
    path = tmp_path / "data.npz"
    members = {f"{k}.npy": _npy_bytes(v) for k, v in _windows().items()}
    _zip(path, {**members, "X.npy": header.getvalue() + b"\0" * 64})
    with pytest.raises(ValueError, match=r"data\.npz: member 'X\.npy' claims shape \[1099511627776\] of float32 "
                                         r"\(4398046511104 bytes\) but holds \d+ bytes"):
        load_npz_file(path)


def test_read_arrays_bounds_the_unpacked_size(tmp_path):
    np.savez(tmp_path / "a.npz", big=np.zeros(1000))
    with pytest.raises(ValueError, match=r"a\.npz: unpacks to \d+ bytes, more than 100; not read"):
        read_arrays(tmp_path / "a.npz", max_unpacked_bytes=100)
    assert read_arrays(tmp_path / "a.npz")["big"].shape == (1000,)


@pytest.mark.parametrize("label", [100_000, 1 << 62])
def test_a_huge_label_is_refused_before_any_class_name_is_made(tmp_path, label):
    arrays = _windows()
    arrays["y"] = np.array([0, 1, label, 0])
    np.savez(tmp_path / "data.npz", **arrays)
    with pytest.raises(ValueError, match=rf"data\.npz: label {label} is not a class id of a biosignal dataset"):
        load_npz_file(tmp_path / "data.npz")


def test_many_classes_and_channels_are_checked_in_linear_time():
    """Unique-name checks count once (the former per-name tuple.count took ~100 s for 10^5 names)."""
    n = 200_000
    ds = WindowDataset(X=np.zeros((1, n, 1), np.float32), y=np.zeros(1, np.int64), subject=np.zeros(1, np.int64),
                       class_names=[f"c{i}" for i in range(n)], channel_names=[f"ch{i}" for i in range(n)],
                       sample_rate_hz=None)
    assert ds.n_channels == n and ds.n_classes == n
    with pytest.raises(ValueError, match=r"channel_names must be unique, \['ch7'\] appear more than once"):
        WindowDataset(X=np.zeros((1, 3, 1), np.float32), y=np.zeros(1, np.int64), subject=np.zeros(1, np.int64),
                      class_names=["a"], channel_names=["ch7", "x", "ch7"], sample_rate_hz=None)


# ---- CSV ----------------------------------------------------------------------------------
def test_a_csv_of_many_columns_loads(tmp_path):
    n = 100_000
    path = tmp_path / "wide.csv"
    path.write_text("subject,label," + ",".join(f"c{i}" for i in range(n)) + "\n"
                    + "".join(f"1,0,{','.join(['1.5'] * n)}\n" for _ in range(2)))
    ds = load_csv(path, window_length_samples=2)
    assert ds.X.shape == (1, n, 2)


def test_a_csv_field_over_the_csv_limit_is_a_value_error(tmp_path):
    path = tmp_path / "long.csv"
    path.write_text("subject,label,a\n1,0,1\n1,0,\"" + "9" * 200_000 + "\"\n")
    with pytest.raises(ValueError,
                       match=r"long\.csv, line 3: not a CSV row of numbers \(field larger than field limit"):
        load_csv(path, window_length_samples=1)


def test_a_csv_line_over_the_bound_is_refused_before_it_is_read_whole(tmp_path, monkeypatch):
    monkeypatch.setattr(dataset_io, "MAX_CSV_LINE_CHARS", 1000)
    path = tmp_path / "line.csv"
    path.write_text("subject,label,a\n1,0,1\n1,0," + "9" * 5000)  # one long line without a newline
    with pytest.raises(ValueError, match=r"line\.csv, line 3: longer than 1000 characters"):
        load_csv(path, window_length_samples=1)
