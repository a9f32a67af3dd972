"""ChannelNormalizer: per-channel statistics from source data only, JSON round trip, strict apply."""

from __future__ import annotations

import dataclasses
import json
import logging

import numpy as np
import pytest

from edgeadapt.datasets import ChannelNormalizer, SyntheticConfig, loso_splits, make_synthetic


@pytest.fixture(scope="module")
def dataset():
    return make_synthetic(SyntheticConfig(n_subjects=4, windows_per_subject=24, n_time_steps=64, seed=2))


def test_fitted_data_becomes_zero_mean_unit_std(dataset):
    normalized = ChannelNormalizer.fit(dataset).apply(dataset)
    assert normalized.X.dtype == np.float32
    np.testing.assert_allclose(normalized.X.mean(axis=(0, 2)), 0.0, atol=1e-5)
    np.testing.assert_allclose(normalized.X.std(axis=(0, 2)), 1.0, atol=1e-5)
    np.testing.assert_array_equal(normalized.y, dataset.y)


def test_statistics_come_from_source_windows_only(dataset):
    split = next(loso_splits(dataset))
    fitted = ChannelNormalizer.fit(dataset, split.source_idx)
    # Replace the target subject's data by something wild: the source-fitted statistics must not move.
    X = dataset.X.copy()
    X[split.target_idx] = 1000.0 + 50.0 * X[split.target_idx]
    changed = dataclasses.replace(dataset, X=X)
    assert ChannelNormalizer.fit(changed, split.source_idx) == fitted
    assert ChannelNormalizer.fit(dataset.subset(split.source_idx)) == fitted
    # ...while fitting on everything would have absorbed the target.
    assert ChannelNormalizer.fit(changed) != fitted
    np.testing.assert_allclose(fitted.mean, dataset.X[split.source_idx].mean(axis=(0, 2)), rtol=1e-5, atol=1e-6)


def test_json_round_trip_is_exact(dataset):
    fitted = ChannelNormalizer.fit(dataset)
    assert ChannelNormalizer.from_dict(json.loads(json.dumps(fitted.to_dict()))) == fitted


def test_constant_channel_is_centred_not_scaled(dataset, caplog):
    X = dataset.X.copy()
    X[:, 3, :] = 7.0
    flat = dataclasses.replace(dataset, X=X)
    with caplog.at_level(logging.WARNING):
        fitted = ChannelNormalizer.fit(flat)
    assert "['emg3']" in caplog.text
    assert fitted.mean[3] == pytest.approx(7.0) and fitted.std[3] == 1.0
    assert np.all(fitted.apply(flat).X[:, 3, :] == 0.0)


def test_apply_refuses_other_channels(dataset):
    fitted = ChannelNormalizer.fit(dataset)
    renamed = dataclasses.replace(dataset, channel_names=tuple(f"x{i}" for i in range(8)))
    with pytest.raises(ValueError, match=r"fitted on channels \['emg0'.*dataset has \['x0'"):
        fitted.apply(renamed)


@pytest.mark.parametrize(
    "values, match",
    [
        ({"channel_names": ("a", "b"), "mean": (0.0,), "std": (1.0, 1.0)}, "2 channel_names, 1 means, 2 stds"),
        ({"channel_names": ("a",), "mean": (float("nan"),), "std": (1.0,)}, "mean must be finite"),
        ({"channel_names": ("a",), "mean": (0.0,), "std": (0.0,)}, "std must be finite and > 0"),
        ({"channel_names": (), "mean": (), "std": ()}, "need one mean and one std per channel"),
    ],
)
def test_validation(values, match):
    with pytest.raises(ValueError, match=match):
        ChannelNormalizer(**values)


def test_from_dict_and_fit_errors(dataset):
    with pytest.raises(ValueError, match=r"must have keys \['channel_names', 'mean', 'std'\], got \['mean'\]"):
        ChannelNormalizer.from_dict({"mean": [0.0]})
    with pytest.raises(ValueError, match="zero windows"):
        ChannelNormalizer.fit(dataset, [])
