"""WindowDataset: validation, subsets, atomic pickle-free npz round trip."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from edgeadapt.datasets import WindowDataset, read_npz, windows_from_continuous


def test_properties(small_dataset):
    ds = small_dataset
    assert len(ds) == 12
    assert (ds.n_classes, ds.n_channels, ds.n_time_steps) == (3, 2, 5)
    assert ds.subjects.tolist() == [1, 4, 7]
    assert ds.subjects.dtype == np.int64


def _replace(ds, **changes):
    return dataclasses.replace(ds, **changes)


@pytest.mark.parametrize(
    "changes, error, match",
    [
        ({"X": np.zeros((12, 10), np.float32)}, ValueError, r"X must be 3-D \(windows, channels, time_steps\)"),
        ({"X": np.zeros((12, 2, 5), np.float64)}, TypeError, r"X must be float32, got float64.*astype"),
        ({"X": [[[0.0]]]}, TypeError, "X must be a numpy array"),
        ({"y": np.zeros(12, np.int32)}, TypeError, r"y must be int64, got int32.*astype\(np.int64\)"),
        ({"y": np.zeros(11, np.int64)}, ValueError, r"y must have shape \(12,\)"),
        ({"subject": np.zeros(13, np.int64)}, ValueError, r"subject must have shape \(12,\)"),
        ({"session": np.zeros(3, np.int64)}, ValueError, r"session must have shape \(12,\)"),
        ({"y": np.full(12, 3, np.int64)}, ValueError, r"labels \[3\] outside 0..2"),
        ({"y": np.full(12, -1, np.int64)}, ValueError, r"labels \[-1\] outside 0..2"),
        ({"channel_names": ("a",)}, ValueError, "channel_names has 1 names but X has 2 channels"),
        ({"class_names": ("a", "a", "b")}, ValueError, r"class_names must be unique, \['a'\]"),
        ({"class_names": "abc"}, TypeError, "not one string"),
        ({"class_names": ()}, ValueError, "at least one class"),
        ({"sample_rate_hz": 0.0}, ValueError, "sample_rate_hz must be a positive number"),
        ({"sample_rate_hz": float("nan")}, ValueError, "sample_rate_hz must be a positive number"),
        ({"recording": np.zeros(12, np.int64)}, ValueError, "recording and start_sample must be given together"),
    ],
)
def test_validation_names_the_problem(small_dataset, changes, error, match):
    with pytest.raises(error, match=match):
        _replace(small_dataset, **changes)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_values_are_located(small_dataset, bad):
    X = small_dataset.X.copy()
    X[5, 1, 3] = bad
    with pytest.raises(ValueError, match=r"1 NaN/inf values \(first at window 5, channel 1, step 3\)"):
        _replace(small_dataset, X=X)


def test_subset_by_mask_and_indices(small_dataset):
    ds = small_dataset
    by_mask = ds.subset(ds.subject == 1)
    assert by_mask.X[:, 0, 0].tolist() == [4.0, 5.0, 6.0, 7.0]
    assert by_mask.session.tolist() == [0, 0, 1, 1]
    by_index = ds.subset([11, 0, 0])
    assert by_index.X[:, 0, 0].tolist() == [11.0, 0.0, 0.0]
    assert by_index.y.tolist() == [2, 0, 0]
    assert by_index.subject.tolist() == [7, 4, 4]
    assert by_index.class_names == ds.class_names and by_index.sample_rate_hz == ds.sample_rate_hz
    assert len(ds.subset([])) == 0
    # A subset owns its arrays.
    by_index.X[0] = -1
    assert ds.X[11, 0, 0] == 11.0


def test_subset_carries_provenance(small_dataset):
    index = np.arange(12, dtype=np.int64)
    ds = _replace(small_dataset, recording=index, start_sample=index * 7)
    sub = ds.subset([3, 1])
    assert sub.recording.tolist() == [3, 1]
    assert sub.start_sample.tolist() == [21, 7]


@pytest.mark.parametrize(
    "selection, error, match",
    [
        (np.ones(5, bool), ValueError, r"boolean mask must have shape \(12,\)"),
        (np.array([0.0, 1.0]), TypeError, "boolean mask or integer indices"),
        (np.array([0, 12]), IndexError, r"0..11"),
        (np.array([-1]), IndexError, r"0..11"),
        (np.zeros((2, 2), np.int64), ValueError, "1-D"),
    ],
)
def test_subset_rejects_bad_selections(small_dataset, selection, error, match):
    with pytest.raises(error, match=match):
        small_dataset.subset(selection)


@pytest.mark.parametrize("with_optional", [False, True])
def test_npz_round_trip_without_pickle(tmp_path, small_dataset, with_optional):
    ds = small_dataset
    if with_optional:
        ds = _replace(ds, recording=np.arange(12, dtype=np.int64) // 4, start_sample=np.arange(12, dtype=np.int64))
    else:
        ds = _replace(ds, session=None)
    path = ds.save_npz(tmp_path / "data.npz")
    assert path == tmp_path / "data.npz"
    with np.load(path, allow_pickle=False) as npz:
        assert all(npz[k].dtype.kind != "O" for k in npz.files)
    back = WindowDataset.load_npz(path)
    for name in ("X", "y", "subject", "session", "recording", "start_sample"):
        original, loaded = getattr(ds, name), getattr(back, name)
        if original is None:
            assert loaded is None
        else:
            assert loaded.dtype == original.dtype
            np.testing.assert_array_equal(loaded, original)
    assert (back.class_names, back.channel_names, back.sample_rate_hz) == (ds.class_names, ds.channel_names, 100.0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.npz"]  # no temporary file left behind


def test_save_is_atomic(tmp_path, small_dataset, monkeypatch):
    path = small_dataset.save_npz(tmp_path / "data.npz")
    before = path.read_bytes()

    def failing_savez(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(np, "savez", failing_savez)
    with pytest.raises(OSError, match="disk full"):
        _replace(small_dataset, session=None).save_npz(path)
    assert path.read_bytes() == before  # the old file is intact
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.npz"]


def test_load_npz_refuses_other_files(tmp_path):
    path = tmp_path / "user.npz"
    np.savez(path, X=np.zeros((2, 3, 4)))
    with pytest.raises(ValueError, match=r"user.npz: not written by WindowDataset.save_npz.*load_npz_file"):
        WindowDataset.load_npz(path)


def test_load_npz_names_the_file_on_bad_content(tmp_path, small_dataset):
    path = small_dataset.save_npz(tmp_path / "data.npz")
    with np.load(path) as npz:
        arrays = {k: npz[k] for k in npz.files}
    arrays["y"] = arrays["y"][:-1]
    np.savez(path, **arrays)
    with pytest.raises(ValueError, match=r"data.npz: y must have shape \(12,\)"):
        WindowDataset.load_npz(path)
    del arrays["subject"]
    np.savez(path, **arrays)
    with pytest.raises(ValueError, match=r"data.npz: missing keys \['subject'\]"):
        WindowDataset.load_npz(path)



def test_read_npz_names_the_file_and_the_problem(tmp_path):
    text = tmp_path / "notes.npz"
    text.write_text("hello")
    with pytest.raises(ValueError, match=r"notes.npz: not a readable .npz file"):
        read_npz(text)
    single = tmp_path / "single.npz"
    with open(single, "wb") as f:
        np.save(f, np.zeros(3))
    with pytest.raises(ValueError, match=r"single.npz: holds one array, not named arrays"):
        read_npz(single)
    objects = tmp_path / "objects.npz"
    np.savez(objects, names=np.array(["a", None], dtype=object))
    with pytest.raises(ValueError, match=r"objects.npz: Object arrays cannot be loaded.*store strings as str arrays"):
        read_npz(objects)
    with pytest.raises(ValueError, match=r"objects.npz: Object arrays cannot be loaded"):
        WindowDataset.load_npz(objects)


def test_recording_order_sorts_by_recording_then_start_and_keeps_files_that_do_not_say():
    signal = np.arange(300, dtype=np.float64)[:, None]
    ds = windows_from_continuous(signal, np.repeat([0, 1], 150), np.zeros(300, np.int64), np.repeat([0, 1], 150),
                                 sample_rate_hz=1.0, window_length_samples=20, overlap_fraction=0.5)
    np.testing.assert_array_equal(ds.recording_order(), np.arange(len(ds)))  # cut in order already
    shuffled = ds.subset(np.random.default_rng(0).permutation(len(ds)))
    back = shuffled.subset(shuffled.recording_order())
    np.testing.assert_array_equal(back.X, ds.X)
    keys = list(zip(back.recording.tolist(), back.start_sample.tolist()))
    assert keys == sorted(keys)
    bare = dataclasses.replace(shuffled, recording=None, start_sample=None)
    np.testing.assert_array_equal(bare.recording_order(), np.arange(len(bare)))
