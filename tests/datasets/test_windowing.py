"""Windowing of continuous recordings: hops, channels-first windows, label rules, no cross-run windows."""

from __future__ import annotations

import numpy as np
import pytest

from edgeadapt.datasets import (
    LabelRule,
    contiguous_runs,
    hop_samples,
    window_labels,
    window_signal,
    window_starts,
    windows_from_continuous,
)


@pytest.mark.parametrize(
    "length, overlap, hop", [(100, 0.5, 50), (100, 0.0, 100), (100, 0.75, 25), (10, 0.99, 1), (5, 0.5, 3)]
)
def test_hop_samples(length, overlap, hop):
    assert hop_samples(length, overlap) == hop


@pytest.mark.parametrize(
    "length, overlap, match",
    [
        (0, 0.5, "positive integer"),
        (10.5, 0.5, "positive integer"),
        (10, 1.0, r"in \[0, 1\)"),
        (10, -0.1, r"in \[0, 1\)"),
    ],
)
def test_hop_samples_rejects_bad_arguments(length, overlap, match):
    with pytest.raises(ValueError, match=match):
        hop_samples(length, overlap)


def test_window_starts_keep_whole_windows_only():
    assert window_starts(10, 4, 3).tolist() == [0, 3, 6]
    assert window_starts(3, 4, 1).tolist() == []


def test_window_signal_is_channels_first():
    signal = np.arange(20, dtype=np.float64).reshape(10, 2)  # (time, channels)
    X, starts = window_signal(signal, 4, 3)
    assert X.shape == (3, 2, 4) and X.dtype == np.float32
    np.testing.assert_array_equal(X[1], signal[3:7].T)
    assert starts.tolist() == [0, 3, 6]
    empty, none = window_signal(signal[:3], 4, 3)
    assert empty.shape == (0, 2, 4) and none.size == 0
    with pytest.raises(ValueError, match=r"2-D \(time, channels\)"):
        window_signal(np.zeros(10), 4, 3)


def test_window_labels_majority_and_last():
    labels = np.array([0, 0, 1, 1, 1, 2, 2, 2, 2, 0])
    starts = np.array([0, 2, 5, 6])
    assert window_labels(labels, starts, 4, "majority").tolist() == [0, 1, 2, 2]
    assert window_labels(labels, starts, 4, LabelRule.LAST).tolist() == [1, 2, 2, 0]
    # A 2-2 tie goes to the smaller class id.
    assert window_labels(np.array([3, 3, 1, 1]), np.array([0]), 4, "majority").tolist() == [1]
    with pytest.raises(ValueError, match="'first' is not a valid LabelRule"):
        window_labels(labels, starts, 4, "first")


def test_contiguous_runs():
    subject = np.array([1, 1, 1, 2, 2, 1])
    session = np.array([0, 1, 1, 1, 1, 1])
    assert contiguous_runs(subject) == [(0, 3), (3, 5), (5, 6)]
    assert contiguous_runs(subject, session) == [(0, 1), (1, 3), (3, 5), (5, 6)]


def test_windows_never_span_subjects_or_sessions():
    n = 30
    signal = np.stack([np.arange(n), -np.arange(n)], axis=1).astype(np.float64)
    subject = np.array([5] * 12 + [6] * 10 + [5] * 8)
    session = np.array([0] * 6 + [1] * 6 + [0] * 18)
    labels = np.arange(n) // 10
    ds = windows_from_continuous(signal, labels, subject, session, sample_rate_hz=10.0, window_length_samples=4,
                                 overlap_fraction=0.5)
    # Runs: [0, 6) subj 5 sess 0, [6, 12) 5/1, [12, 22) 6/0, [22, 30) 5/0 -> starts every 2 samples.
    assert ds.start_sample.tolist() == [0, 2, 6, 8, 12, 14, 16, 18, 22, 24, 26]
    assert ds.recording.tolist() == [0, 0, 1, 1, 2, 2, 2, 2, 3, 3, 3]
    assert ds.subject.tolist() == [5, 5, 5, 5, 6, 6, 6, 6, 5, 5, 5]
    assert ds.session.tolist() == [0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0]
    np.testing.assert_array_equal(ds.X[:, 0, 0], ds.start_sample)  # channel 0 holds the sample index
    np.testing.assert_array_equal(ds.X[4], signal[12:16].T)
    assert ds.y.tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2]
    assert ds.class_names == ("0", "1", "2") and ds.channel_names == ("ch0", "ch1")


def test_short_runs_give_no_windows():
    subject = np.array([1] * 3 + [2] * 8)
    ds = windows_from_continuous(np.zeros((11, 1)), np.zeros(11, np.int64), subject, sample_rate_hz=1.0,
                                 window_length_samples=4, overlap_fraction=0.0)
    assert ds.subject.tolist() == [2, 2]


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"signal": np.zeros(10)}, ValueError, r"2-D \(time, channels\)"),
        ({"signal": np.zeros((0, 2))}, ValueError, r"with samples"),
        ({"signal": np.full((10, 2), "a")}, TypeError, "must hold real numbers"),
        ({"labels": np.zeros(9, np.int64)}, ValueError, r"labels must have one entry per sample, shape \(10,\)"),
        ({"subject": np.zeros(10)}, TypeError, "subject must be integers, got dtype float64"),
        ({"labels": np.full(10, -1)}, ValueError, "class ids >= 0"),
        ({"signal": np.where(np.arange(20).reshape(10, 2) == 7, np.nan, 0.0)}, ValueError,
         r"1 NaN/inf values \(first at sample 3\)"),
    ],
)
def test_windows_from_continuous_rejects_bad_input(kwargs, error, match):
    args = {"signal": np.zeros((10, 2)), "labels": np.zeros(10, np.int64), "subject": np.zeros(10, np.int64)} | kwargs
    with pytest.raises(error, match=match):
        windows_from_continuous(**args, sample_rate_hz=1.0, window_length_samples=4)
