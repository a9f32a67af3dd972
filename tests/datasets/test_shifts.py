"""Sensor shifts of one subject (datasets/shifts.py)."""

import numpy as np
import pytest

from edgeadapt.datasets import SyntheticConfig, make_synthetic
from edgeadapt.datasets.shifts import SHIFTS, shift_subject


@pytest.fixture(scope="module")
def ds():
    return make_synthetic(SyntheticConfig(n_subjects=3, windows_per_subject=12, n_time_steps=32))


@pytest.mark.parametrize("kind", SHIFTS)
def test_only_the_subject_changes_and_seeded(ds, kind):
    out = shift_subject(ds, 1, kind, seed=3)
    mine = ds.subject == 1
    np.testing.assert_array_equal(out.X[~mine], ds.X[~mine])
    assert not np.array_equal(out.X[mine], ds.X[mine])
    np.testing.assert_array_equal(shift_subject(ds, 1, kind, seed=3).X, out.X)
    assert out.X.dtype == ds.X.dtype and np.isfinite(out.X).all()
    np.testing.assert_array_equal(out.y, ds.y)


def test_channel_swap_permutes_channels(ds):
    out = shift_subject(ds, 0, "channel-swap")
    mine = ds.subject == 0
    moved = [c for c in range(ds.X.shape[1]) if not np.array_equal(out.X[mine][:, c], ds.X[mine][:, c])]
    assert len(moved) == 4  # two pairs exchanged
    assert sorted(out.X[mine].sum(axis=(0, 2))) == pytest.approx(sorted(ds.X[mine].sum(axis=(0, 2))))


def test_severity_zero_changes_nothing_but_the_swap(ds):
    for kind in ("gain-offset", "noise", "time-warp"):
        np.testing.assert_allclose(shift_subject(ds, 2, kind, severity=0.0).X, ds.X, atol=1e-6)


def test_bad_arguments(ds):
    with pytest.raises(ValueError, match="shift must be one of"):
        shift_subject(ds, 0, "rotate")
    with pytest.raises(ValueError, match="subject 9 is not in the dataset"):
        shift_subject(ds, 9, "noise")
    with pytest.raises(ValueError, match="severity"):
        shift_subject(ds, 0, "noise", severity=-1)
