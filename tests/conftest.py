"""Shared fixtures."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import make_cnn


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(0)


@pytest.fixture
def one_torch_thread():
    """One intra-op thread: on a shared, busy machine torch's spinning pool is ~20x slower."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def cnn_bundle(tmp_path_factory):
    """A CNN bundle training the head fully and half of conv2's output channels (AdamW)."""
    import torch

    from edgeadapt.export import Rule, UpdatePolicy, export_bundle

    out = tmp_path_factory.mktemp("bundles") / "cnn"
    policy = UpdatePolicy(rules=(Rule("head", "full"), Rule("conv2", "channels", ratio=0.5)))
    export_bundle(make_cnn(), torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(0)), out, policy=policy)
    return out


def pytest_collection_modifyitems(config, items):
    """Skip `gpu` tests where the ONNX Runtime build has no CUDA provider (a test still skips
    itself if the provider is built in but cannot create a session)."""
    from edgeadapt.runtime.device import cuda_listed

    if cuda_listed():
        return
    skip = pytest.mark.skip(reason="needs an ONNX Runtime build with a working CUDA provider")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
