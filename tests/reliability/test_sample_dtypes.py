"""The dtype rule for sample values in data files (edgeadapt.datasets.samples): float32 kept, other
real floats and integers converted to float32 and noted once, anything else refused - from Python
and on the command line."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from edgeadapt.cli import main
from edgeadapt.datasets import load_dataset

N, TIME, CHANNELS = 12, 16, 4


def _npz(path, X=None, signal=None):
    if signal is not None:
        n = len(signal)
        np.savez(path, signal=signal, y=(np.arange(n) // 20) % 3, subject=np.ones(n, np.int64))
    else:
        np.savez(path, X=X, y=np.arange(N) % 3, subject=np.ones(N, np.int64))
    return path


def _values(dtype):
    return (np.random.default_rng(0).standard_normal((N, TIME, CHANNELS)) * 100).astype(dtype)


@pytest.mark.parametrize("X, match", [
    (_values(np.float32) + 1j, r"'X' holds complex numbers \(complex64\); samples must be real.*np\.abs"),
    (_values(np.float32) > 0, r"'X' must hold real numbers \(float or integer\), got dtype bool"),
    (_values(np.float32).astype(str), r"'X' must hold real numbers \(float or integer\), got dtype <U"),
    (np.full((N, TIME, CHANNELS), 1e39), r"'X' holds a value of magnitude 1e\+39, beyond float32's range"),
], ids=["complex", "bool", "text", "beyond float32"])
def test_samples_that_cannot_be_right_are_refused(cnn_bundle, tmp_path, capsys, X, match):
    path = _npz(tmp_path / "d.npz", X=X)
    with pytest.raises(ValueError, match=match):
        load_dataset(path)
    code = main(["adapt", str(cnn_bundle), "--data", str(path), "--out", str(tmp_path / "o"), "--no-progress",
                 "--device", "cpu"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"error: {path}: 'X'") and "Traceback" not in err
    assert not (tmp_path / "o").exists()


def test_a_complex_continuous_signal_is_refused(tmp_path):
    path = _npz(tmp_path / "s.npz", signal=np.ones((100, CHANNELS), np.complex128))
    with pytest.raises(ValueError, match=r"'signal' holds complex numbers \(complex128\)"):
        load_dataset(path, window_length_samples=TIME)


@pytest.mark.parametrize("dtype, level, note", [
    (np.float64, logging.INFO, "converting float64 samples to float32"),
    (np.float16, logging.INFO, "converting float16 samples to float32"),
    (np.int16, logging.INFO, "converting int16 samples to float32 (exact)"),
    (np.uint8, logging.INFO, "converting uint8 samples to float32 (exact)"),
])
def test_conversions_are_noted_once(tmp_path, caplog, dtype, level, note):
    X = _values(dtype) if np.dtype(dtype).kind == "f" else np.abs(_values(np.float32)).astype(dtype)
    path = _npz(tmp_path / "d.npz", X=X)
    with caplog.at_level(logging.INFO, logger="edgeadapt.datasets"):
        ds = load_dataset(path)
    notes = [r for r in caplog.records if "samples to float32" in r.getMessage()]
    assert len(notes) == 1 and notes[0].levelno == level and note in notes[0].getMessage()
    assert ds.X.dtype == np.float32 and np.array_equal(ds.X, X.transpose(0, 2, 1).astype(np.float32))


def test_integers_that_float32_rounds_are_a_warning(tmp_path, caplog):
    X = np.full((N, TIME, CHANNELS), (1 << 24) + 1, np.int64)  # float32 holds 2^24 + 1 as 2^24
    path = _npz(tmp_path / "d.npz", X=X)
    with caplog.at_level(logging.INFO, logger="edgeadapt.datasets"):
        load_dataset(path)
    notes = [r for r in caplog.records if "samples to float32" in r.getMessage()]
    assert len(notes) == 1 and notes[0].levelno == logging.WARNING
    assert "rounds those above 2^24 = 16777216 in magnitude (up to 16777217 here)" in notes[0].getMessage()


def test_float32_is_kept_without_a_note(tmp_path, caplog):
    X = _values(">f4")
    with caplog.at_level(logging.INFO, logger="edgeadapt.datasets"):
        ds = load_dataset(_npz(tmp_path / "d.npz", X=X))
    assert not [r for r in caplog.records if "samples to float32" in r.getMessage()]
    assert np.array_equal(ds.X, X.transpose(0, 2, 1))
