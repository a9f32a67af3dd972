"""The empirical-Bayes weight of target normalisation statistics (edgeadapt.runtime.stats_shrinkage).

Groups of windows are simulated directly: each window's per-channel mean is the subject's true
mean plus between-window spread (activities, stretches of time), and the target's pooled
statistics are the window-weighted means of the groups' - exactly how the adapter feeds them.
"""

from __future__ import annotations

import numpy as np
import pytest

from edgeadapt.runtime.stats_shrinkage import GroupedStatistics, shrinkage_weight

CHANNELS = 16


def _subject(rng, shift: float, n_windows: int, group: int, spread: float = 1.0, var_shift: float = 0.0):
    """Pooled mean/var and grouped statistics of ``n_windows`` windows of a subject whose true
    channel means sit ``shift`` source standard deviations from the source (random direction),
    its log-variances ``var_shift`` away; window means spread by ``spread`` around the truth."""
    true_mean = shift * rng.standard_normal(CHANNELS) / np.sqrt(1.0)
    true_log_var = var_shift * rng.standard_normal(CHANNELS)
    window_means = true_mean + spread * rng.standard_normal((n_windows, CHANNELS))
    within_var = np.exp(true_log_var)  # within-window variance (source: mean 0, total variance ~1)
    groups = GroupedStatistics((CHANNELS,))
    for start in range(0, n_windows, group):
        m = window_means[start:start + group]
        # a group's variance: within-window variance plus the spread of its windows' means
        groups.add(m.mean(0), within_var + m.var(0), len(m))
    pooled_mean = window_means.mean(0)
    pooled_var = within_var + window_means.var(0)
    return pooled_mean, pooled_var, groups


def _weight(rng, shift, n_windows=40, group=4, **kw):
    source_mean, source_var = np.zeros(CHANNELS), np.full(CHANNELS, 1.0 + 1.0)  # within 1 + spread 1
    mean, var, groups = _subject(rng, shift, n_windows, group, **kw)
    return shrinkage_weight(source_mean, source_var, mean, var, groups, min_groups=3)


def test_cluster_noise_matches_the_direct_formula():
    rng = np.random.default_rng(0)
    g = GroupedStatistics((3,))
    sizes = [4, 4, 2, 4, 3]
    means = [rng.standard_normal(3) for _ in sizes]
    for m, b in zip(means, sizes):
        g.add(m, np.ones(3), b)
    n, G = sum(sizes), len(sizes)
    pooled = sum(b * m for m, b in zip(means, sizes)) / n
    direct = G / (G - 1) * sum(b * b * (m - pooled) ** 2 for m, b in zip(means, sizes)) / n**2
    mean_noise, log_var_noise = g.noise()
    np.testing.assert_allclose(mean_noise, direct, rtol=1e-12)
    np.testing.assert_allclose(log_var_noise, 0.0, atol=1e-15)  # every group's variance is 1


def test_a_subject_like_the_source_keeps_mostly_source_statistics():
    """No shift: over 200 random subjects the weight is 0 in most and small on average (the
    positive part of an estimate centred near 0)."""
    rng = np.random.default_rng(1)
    w = np.array([_weight(rng, 0.0) for _ in range(200)])
    assert np.median(w) < 0.15 and w.mean() < 0.25


def test_a_subject_far_from_the_source_takes_its_own_statistics():
    rng = np.random.default_rng(2)
    w = np.array([_weight(rng, 3.0) for _ in range(200)])
    assert w.min() > 0.9


def test_weight_grows_with_the_shift_and_with_the_evidence():
    """Mean weight over random subjects rises with the shift; at a moderate shift, more windows
    (less noise) give more weight."""
    rng = np.random.default_rng(3)
    shifts = (0.0, 0.2, 0.4, 0.8, 1.6)
    means = [np.mean([_weight(rng, s) for _ in range(100)]) for s in shifts]
    assert all(a < b for a, b in zip(means, means[1:])), means
    few = np.mean([_weight(rng, 0.3, n_windows=16) for _ in range(200)])
    many = np.mean([_weight(rng, 0.3, n_windows=400) for _ in range(200)])
    assert many > few + 0.2


def test_variance_shift_alone_counts():
    rng = np.random.default_rng(4)
    w = np.array([_weight(rng, 0.0, var_shift=1.5) for _ in range(100)])
    assert np.median(w) > 0.8


@pytest.mark.parametrize("n_windows, group", [(8, 4), (2, 4)])
def test_too_few_groups_keep_the_source(n_windows, group):
    """Fewer than min_groups groups: the noise is not measurable, the weight is 0 however large the shift."""
    assert _weight(np.random.default_rng(5), 5.0, n_windows=n_windows, group=group) == 0.0
