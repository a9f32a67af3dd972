"""Shared fixtures for the datasets tests."""

from __future__ import annotations

import numpy as np
import pytest

from edgeadapt.datasets import WindowDataset


@pytest.fixture
def small_dataset() -> WindowDataset:
    """12 windows, 3 subjects x 2 sessions, 3 classes, 2 channels x 5 steps; X[i] is filled with i."""
    n = 12
    X = np.repeat(np.arange(n, dtype=np.float32), 2 * 5).reshape(n, 2, 5)
    return WindowDataset(
        X=X,
        y=np.arange(n, dtype=np.int64) % 3,
        subject=np.repeat(np.array([4, 1, 7], dtype=np.int64), 4),
        session=np.tile(np.array([0, 0, 1, 1], dtype=np.int64), 3),
        class_names=("rest", "fist", "pinch"),
        channel_names=("a", "b"),
        sample_rate_hz=100.0,
    )
