"""Shared fixtures."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import make_cnn


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(0)


@pytest.fixture(scope="session")
def cnn_bundle(tmp_path_factory):
    """A CNN bundle training the head fully and half of conv2's output channels (AdamW)."""
    import torch

    from edgeadapt.export import Rule, UpdatePolicy, export_bundle

    out = tmp_path_factory.mktemp("bundles") / "cnn"
    policy = UpdatePolicy(rules=(Rule("head", "full"), Rule("conv2", "channels", ratio=0.5)))
    export_bundle(make_cnn(), torch.randn(2, 4, 16), out, policy=policy)
    return out
