"""The documented minimal files work without a sampling rate, and files that are not what their
name says fail with an error naming the file (never numpy's advice to unpickle)."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from edgeadapt.datasets import WindowDataset, load_csv, load_dataset, load_npz_file


def _minimal(path, n=6, time=5, channels=3):
    rng = np.random.default_rng(0)
    X = rng.normal(size=(n, time, channels)).astype(np.float32)
    np.savez(path, X=X, y=np.arange(n) % 3, subject=np.repeat([1, 2], n // 2))
    return X


def test_npz_with_only_x_y_subject_loads_without_a_rate(tmp_path):
    X = _minimal(tmp_path / "w.npz")
    for ds in (load_npz_file(tmp_path / "w.npz"), load_dataset(tmp_path / "w.npz")):
        assert ds.sample_rate_hz is None
        np.testing.assert_array_equal(ds.X, X.transpose(0, 2, 1))
        assert ds.y.tolist() == [0, 1, 2, 0, 1, 2]


def test_dataset_without_rate_round_trips(tmp_path):
    _minimal(tmp_path / "w.npz")
    ds = load_npz_file(tmp_path / "w.npz")
    back = WindowDataset.load_npz(ds.save_npz(tmp_path / "saved.npz"))
    assert back.sample_rate_hz is None
    np.testing.assert_array_equal(back.X, ds.X)


def test_csv_without_rate_is_windowed_by_samples(tmp_path):
    rows = ["subject,label,a,b"] + [f"{s},{(i // 4) % 2},{i},{-i}" for s in (1, 2) for i in range(16)]
    (tmp_path / "c.csv").write_text("\n".join(rows) + "\n")
    ds = load_csv(tmp_path / "c.csv", window_length_samples=4, overlap_fraction=0.0)
    assert ds.sample_rate_hz is None and ds.X.shape == (8, 2, 4)
    assert load_dataset(tmp_path / "c.csv", window_length_samples=4).X.shape[2] == 4


def test_directory_named_npz_is_reported_as_a_directory(tmp_path):
    (tmp_path / "x.npz").mkdir()
    with pytest.raises(ValueError, match=r"x\.npz: is a directory, not a \.npz file"):
        load_dataset(tmp_path / "x.npz")
    with pytest.raises(ValueError, match=r"x\.npz: is a directory"):
        load_npz_file(tmp_path / "x.npz")


@pytest.mark.parametrize("content", [pickle.dumps({"X": [1, 2]}), b"not an archive", b""],
                         ids=["pickle", "text", "empty"])
def test_non_zip_npz_names_the_file_without_pickle_advice(tmp_path, content):
    path = tmp_path / "data.npz"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=r"data\.npz: not a readable \.npz file") as raised:
        load_dataset(path)
    assert "pickle" not in str(raised.value)
