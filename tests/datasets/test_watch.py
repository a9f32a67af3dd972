"""The shipped smartwatch recordings: located without importing seglearn, read safely, windowed."""

from __future__ import annotations

import importlib.util
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest

import edgeadapt.datasets.watch as watch_module
from edgeadapt.datasets import WATCH_INSTALL_HINT, find_watch_file, load_dataset, load_watch, read_watch_file


@pytest.fixture(scope="module")
def watch_file():
    try:
        return find_watch_file()
    except FileNotFoundError as e:
        pytest.skip(f"watch dataset not installed ({e})")


@pytest.fixture(scope="module")
def watch(watch_file):
    return load_watch(path=watch_file)


def test_raw_file_facts(watch_file):
    data = read_watch_file(watch_file)
    assert len(data["X"]) == 140
    assert data["X_labels"] == ["ax", "ay", "az", "wx", "wy", "wz"]
    assert data["y_labels"] == ["PEN", "ABD", "FEL", "IR", "ER", "TRAP", "ROW"]
    assert sorted(set(data["subject"].tolist())) == list(range(1, 11))
    assert {rec.shape[1] for rec in data["X"]} == {6}
    assert min(len(rec) for rec in data["X"]) == 947 and max(len(rec) for rec in data["X"]) == 2618


def test_default_windows(watch, watch_file):
    assert watch.X.shape == (4677, 6, 100) and watch.X.dtype == np.float32
    assert watch.sample_rate_hz == 50.0
    assert watch.subjects.tolist() == list(range(1, 11))
    assert watch.class_names == ("PEN", "ABD", "FEL", "IR", "ER", "TRAP", "ROW")
    assert watch.channel_names == ("ax", "ay", "az", "wx", "wy", "wz")
    # Every subject did every exercise with both arms.
    for s in watch.subjects:
        mine = watch.subject == s
        for arm in (0, 1):
            assert np.unique(watch.y[mine & (watch.session == arm)]).tolist() == list(range(7))
    # Windows are the recordings, transposed to channels-first, every 50 samples.
    data = read_watch_file(watch_file)
    first = np.flatnonzero(watch.recording == 5)
    np.testing.assert_array_equal(watch.start_sample[first][:3], [0, 50, 100])
    np.testing.assert_array_equal(watch.X[first[1]], data["X"][5][50:150].T.astype(np.float32))
    assert watch.y[first[0]] == data["y"][5] and watch.subject[first[0]] == data["subject"][5]
    expected = sum((len(rec) - 100) // 50 + 1 for rec in data["X"])
    assert len(watch) == expected


def test_window_arguments(watch_file):
    ds = load_watch(window_length_samples=200, overlap_fraction=0.0, path=watch_file)
    assert ds.X.shape == (1149, 6, 200)
    assert np.all(np.diff(ds.start_sample[ds.recording == 0]) == 200)


def test_load_dataset_by_name(watch, watch_file):
    ds = load_dataset("watch", window_length_samples=100)
    np.testing.assert_array_equal(ds.X, watch.X)


def test_locating_the_file_does_not_import_seglearn_or_torch(watch_file):
    code = (
        "import sys, edgeadapt.datasets as d; ds = d.load_watch(); "
        "assert 'seglearn' not in sys.modules and 'torch' not in sys.modules, sorted(sys.modules); print(len(ds))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "4677"


def test_missing_seglearn_gives_the_install_command(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps seglearn==1\.2\.5"):
        load_watch()
    assert WATCH_INSTALL_HINT == "pip install --no-deps seglearn==1.2.5"


def test_seglearn_without_the_file_gives_the_install_command(monkeypatch, tmp_path):
    spec = importlib.util.spec_from_loader("seglearn", loader=None, is_package=True)
    spec.submodule_search_locations = [str(tmp_path)]
    monkeypatch.setattr(watch_module.importlib.util, "find_spec", lambda name: spec)
    with pytest.raises(FileNotFoundError, match=r"has no data/watch_dataset.npy.*seglearn==1\.2\.5"):
        find_watch_file()


def test_a_malicious_watch_file_is_refused(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(os, "system", lambda command: calls.append(command) or 0)
    path = tmp_path / "watch_dataset.npy"
    with open(path, "wb") as f:
        np.lib.format.write_array_header_1_0(f, {"descr": "|O", "fortran_order": False, "shape": ()})
        f.write(b"cos\nsystem\n(S'echo pwned'\ntR.")
    with pytest.raises(pickle.UnpicklingError, match=r"refused global os\.system"):
        load_watch(path=path)
    assert calls == []


def _save_object(path, value):
    array = np.empty((), dtype=object)
    array[()] = value
    np.save(path, array, allow_pickle=True)


def test_a_watch_file_with_another_structure_is_named(tmp_path):
    path = tmp_path / "watch_dataset.npy"
    _save_object(path, {"X": [np.zeros((200, 6))], "y": np.array([0])})
    missing = r"watch_dataset.npy: missing keys \['subject', 'side', 'X_labels', 'y_labels'\]"
    with pytest.raises(ValueError, match=missing):
        read_watch_file(path)
    good = {"X": [np.zeros((200, 6))], "y": np.array([0]), "subject": np.array([1]), "side": np.array([1.0]),
            "X_labels": list("abcdef"), "y_labels": ["only"]}
    _save_object(path, {**good, "subject": np.array([1, 2])})
    with pytest.raises(ValueError, match=r"'subject' has 2 entries for 1 recordings"):
        read_watch_file(path)
    _save_object(path, {**good, "X": [np.zeros((200, 5))]})
    with pytest.raises(ValueError, match=r"recording 0 is not a \(time, 6\) array: \(200, 5\)"):
        read_watch_file(path)
    _save_object(path, good)
    assert len(load_watch(path=path)) == 3
    with pytest.raises(ValueError, match="no recording is as long as a window of 300 samples"):
        load_watch(path=path, window_length_samples=300)
