"""Leave-one-subject-out folds and few-shot adaptation splits."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from edgeadapt.datasets import (
    SyntheticConfig, few_shot_split, label_shift_split, loso_splits, make_synthetic, unlabeled_split,
    windows_from_continuous,
)


@pytest.fixture(scope="module")
def dataset():
    return make_synthetic(SyntheticConfig(n_subjects=4, windows_per_subject=60, n_time_steps=32, seed=7))


def test_loso_covers_every_subject_once(dataset):
    folds = list(loso_splits(dataset))
    assert [f.target_subject for f in folds] == [0, 1, 2, 3]
    for fold in folds:
        assert np.intersect1d(fold.source_idx, fold.target_idx).size == 0
        np.testing.assert_array_equal(np.union1d(fold.source_idx, fold.target_idx), np.arange(len(dataset)))
        assert np.all(dataset.subject[fold.target_idx] == fold.target_subject)
        assert not np.any(dataset.subject[fold.source_idx] == fold.target_subject)


def test_loso_needs_two_subjects_and_says_so_at_the_call(dataset):
    one = dataset.subset(dataset.subject == 2)
    with pytest.raises(ValueError, match=r"at least 2 subjects, dataset has \[2\]"):
        loso_splits(one)


def test_few_shot_counts_disjointness_and_determinism(dataset):
    split = few_shot_split(dataset, subject=1, k_per_class=3, seed=0)
    assert np.bincount(dataset.y[split.adapt_idx], minlength=6).tolist() == [3] * 6
    assert np.intersect1d(split.adapt_idx, split.eval_idx).size == 0
    own = np.flatnonzero(dataset.subject == 1)
    np.testing.assert_array_equal(np.union1d(split.adapt_idx, split.eval_idx), own)  # no overlap info: all kept
    assert np.all(np.diff(split.adapt_idx) > 0) and np.all(np.diff(split.eval_idx) > 0)
    again = few_shot_split(dataset, subject=1, k_per_class=3, seed=0)
    np.testing.assert_array_equal(again.adapt_idx, split.adapt_idx)
    other = few_shot_split(dataset, subject=1, k_per_class=3, seed=1)
    assert not np.array_equal(other.adapt_idx, split.adapt_idx)


def test_few_shot_drops_evaluation_windows_that_share_samples():
    # One subject, 2 classes, two recordings of 400 samples; windows of 20 with 75 % overlap (hop 5).
    n = 800
    signal = np.arange(n, dtype=np.float64)[:, None]
    labels = np.repeat([0, 1, 0, 1], n // 4)
    session = np.repeat([0, 1], n // 2)  # session change = new recording
    ds = windows_from_continuous(signal, labels, np.zeros(n, np.int64), session, sample_rate_hz=1.0,
                                 window_length_samples=20, overlap_fraction=0.75)
    split = few_shot_split(ds, subject=0, k_per_class=4, seed=3)
    adapt_samples = {(ds.recording[i], ds.start_sample[i]) for i in split.adapt_idx}
    for i in split.eval_idx:
        for r, t in adapt_samples:
            assert ds.recording[i] != r or abs(ds.start_sample[i] - t) >= 20
    # X holds the sample index, so sharing samples would also show as equal values.
    adapt_values = set(ds.X[split.adapt_idx].ravel().tolist())
    assert adapt_values.isdisjoint(ds.X[split.eval_idx].ravel().tolist())
    assert len(split.eval_idx) < (ds.subject == 0).sum() - len(split.adapt_idx)  # something was dropped


def test_too_few_windows_says_how_many_and_what_k_needs(dataset):
    y = dataset.y.copy()
    own = np.flatnonzero(dataset.subject == 2)
    y[own] = np.where(y[own] == 4, 0, y[own])  # subject 2 loses class 4 ...
    y[own[:2]] = 4  # ... except for two windows
    scarce = dataclasses.replace(dataset, y=y)
    with pytest.raises(
        ValueError,
        match=r"subject 2 has too few windows for k_per_class=5: it needs at least 6 windows of every class "
        r"\(5 to adapt, at least 1 to evaluate\) but has 'gesture4': 2; k_per_class <= 1 would fit",
    ):
        few_shot_split(scarce, subject=2, k_per_class=5, seed=0)
    y[own[:2]] = 0
    with pytest.raises(ValueError, match=r"but has 'gesture4': 0$"):
        few_shot_split(dataclasses.replace(dataset, y=y), subject=2, k_per_class=1, seed=0)


def test_few_shot_argument_errors(dataset):
    with pytest.raises(ValueError, match=r"subject 9 is not in the dataset \(subjects: \[0, 1, 2, 3\]\)"):
        few_shot_split(dataset, subject=9, k_per_class=1, seed=0)
    with pytest.raises(ValueError, match="k_per_class must be a positive integer, got 0"):
        few_shot_split(dataset, subject=0, k_per_class=0, seed=0)


@pytest.mark.parametrize("n_classes", [1, 2])
def test_label_shift_split_adapts_on_some_classes_and_evaluates_on_all(dataset, n_classes):
    split = label_shift_split(dataset, subject=1, n_windows=4, n_classes=n_classes, seed=0)
    own = np.flatnonzero(dataset.subject == 1)
    assert len(split.adapt_idx) == 4 and np.all(np.isin(split.adapt_idx, own))
    assert np.unique(dataset.y[split.adapt_idx]).size <= n_classes
    # the first windows of the chosen classes, in dataset order
    chosen = np.isin(dataset.y[own], np.unique(dataset.y[split.adapt_idx]))
    if np.unique(dataset.y[split.adapt_idx]).size == n_classes:
        np.testing.assert_array_equal(split.adapt_idx, own[chosen][:4])
    np.testing.assert_array_equal(np.union1d(split.adapt_idx, split.eval_idx), own)
    assert np.intersect1d(split.adapt_idx, split.eval_idx).size == 0
    assert np.unique(dataset.y[split.eval_idx]).size == 6  # every class still evaluated
    again = label_shift_split(dataset, subject=1, n_windows=4, n_classes=n_classes, seed=0)
    np.testing.assert_array_equal(again.adapt_idx, split.adapt_idx)


def test_label_shift_split_argument_errors(dataset):
    with pytest.raises(ValueError, match=r"n_classes must be an integer in 1..5 \(subject 0 has 6 classes\), got 6"):
        label_shift_split(dataset, subject=0, n_windows=8, n_classes=6, seed=0)
    with pytest.raises(ValueError, match="n_windows must be a positive integer, got 0"):
        label_shift_split(dataset, subject=0, n_windows=0, n_classes=1, seed=0)
    with pytest.raises(ValueError, match=r"subject 9 is not in the dataset"):
        label_shift_split(dataset, subject=9, n_windows=8, n_classes=1, seed=0)


def test_unlabeled_split_takes_the_start_of_every_recording_and_evaluates_on_the_rest():
    # One subject, two recordings (sessions) of four activity bouts; windows of 20, hop 5.
    n = 800
    signal = np.arange(n, dtype=np.float64)[:, None]
    labels = np.repeat([0, 1, 0, 1], n // 4)
    session = np.repeat([0, 1], n // 2)
    ds = windows_from_continuous(signal, labels, np.zeros(n, np.int64), session, sample_rate_hz=1.0,
                                 window_length_samples=20, overlap_fraction=0.75)
    split = unlabeled_split(ds, subject=0, fraction=0.5)
    for rec in np.unique(ds.recording):
        members = np.flatnonzero(ds.recording == rec)
        adapt = np.intersect1d(members, split.adapt_idx)
        np.testing.assert_array_equal(adapt, members[:members.size // 2])  # the first half, in order
        evaluated = np.intersect1d(members, split.eval_idx)
        # every evaluated window starts at least a window after the last adaptation window starts
        assert ds.start_sample[evaluated].min() >= ds.start_sample[adapt].max() + 20
    adapt_values = set(ds.X[split.adapt_idx].ravel().tolist())
    assert adapt_values.isdisjoint(ds.X[split.eval_idx].ravel().tolist())  # no shared sample


def test_unlabeled_split_without_recordings_takes_the_start_of_every_class(dataset):
    split = unlabeled_split(dataset, subject=2, fraction=0.25)
    own = np.flatnonzero(dataset.subject == 2)
    for c in range(dataset.n_classes):
        of_class = own[dataset.y[own] == c]
        np.testing.assert_array_equal(np.intersect1d(of_class, split.adapt_idx), of_class[:of_class.size // 4])
    np.testing.assert_array_equal(np.union1d(split.adapt_idx, split.eval_idx), own)
    assert np.intersect1d(split.adapt_idx, split.eval_idx).size == 0


@pytest.mark.parametrize("fraction", [0, 1, 1.5, -0.1, "half"])
def test_unlabeled_split_refuses_a_fraction_outside_0_1(dataset, fraction):
    with pytest.raises(ValueError, match=r"fraction must be a number in \(0, 1\)"):
        unlabeled_split(dataset, subject=0, fraction=fraction)


def test_unlabeled_split_errors_name_the_subject_and_the_fix(dataset):
    with pytest.raises(ValueError, match=r"subject 9 is not in the dataset"):
        unlabeled_split(dataset, subject=9, fraction=0.5)
    with pytest.raises(ValueError, match=r"is no window; a fraction of at least 0\.\d+ would give its longest one"):
        unlabeled_split(dataset, subject=0, fraction=0.01)  # fewer than 100 windows per class
    unlabeled_split(dataset, subject=0, fraction=np.float32(0.5))  # any real number type


def _one_subject_recordings(n_samples: int, window: int, hop_fraction: float):
    signal = np.arange(n_samples, dtype=np.float64)[:, None]
    labels = np.repeat([0, 1], n_samples // 2)
    session = np.repeat([0, 1], n_samples // 2)
    return windows_from_continuous(signal, labels, np.zeros(n_samples, np.int64), session, sample_rate_hz=1.0,
                                   window_length_samples=window, overlap_fraction=hop_fraction)


def test_unlabeled_split_takes_the_earliest_windows_whatever_the_file_order():
    ds = _one_subject_recordings(400, 20, 0.5)
    order = np.random.default_rng(0).permutation(len(ds))  # a file that stores windows out of time order
    shuffled = ds.subset(order)
    split = unlabeled_split(shuffled, subject=0, fraction=0.5)
    for rec in np.unique(shuffled.recording):
        members = np.flatnonzero(shuffled.recording == rec)
        starts = np.sort(shuffled.start_sample[members])
        adapted = np.sort(shuffled.start_sample[np.intersect1d(members, split.adapt_idx)])
        np.testing.assert_array_equal(adapted, starts[:members.size // 2])
        evaluated = shuffled.start_sample[np.intersect1d(members, split.eval_idx)]
        assert evaluated.min() >= adapted.max() + 20  # later, and no sample shared


def test_unlabeled_split_of_one_window_recordings_says_no_fraction_can_help():
    ds = _one_subject_recordings(40, 20, 0.0)  # two recordings of one window each
    with pytest.raises(ValueError, match="every recording holds one window, so no fraction below 1 can"):
        unlabeled_split(ds, subject=0, fraction=0.9)
