"""Shared fixtures."""

from __future__ import annotations

import functools

import numpy as np
import pytest
from helpers import make_cnn


@pytest.fixture(scope="session", autouse=True)
def ort_training_exports_by_default():
    """``export_bundle(backend="auto")`` writes only the onnxruntime-training graphs in tests.

    The product's ``auto`` also writes the portable step graphs where onnxruntime-training is
    installed; tracing and exporting them costs seconds per export (20-60 s for the full-size
    reference models), which the ~150 exports of the default run cannot afford. The portable
    backend has its own tests (tests/export/test_portable_*.py, tests/runtime/test_portable_*.py),
    which ask for ``backend="portable"`` or ``"both"`` explicitly, and the resolution of
    ``auto`` itself is tested by calling :func:`resolve_backends` directly. Exports made in
    subprocesses (CLI, quickstart) are unaffected.
    """
    from edgeadapt.export import exporter

    real = exporter.resolve_backends

    @functools.wraps(real)  # the real resolution stays reachable as __wrapped__
    def tests_auto(backend: str) -> tuple[str, ...]:
        chosen = real(backend)
        return ("ort-training",) if backend == "auto" and "ort-training" in chosen else chosen

    patch = pytest.MonkeyPatch()
    patch.setattr(exporter, "resolve_backends", tests_auto)
    yield
    patch.undo()


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
    """A CNN bundle training the head fully and half of conv2's output channels (AdamW); no frozen
    prefix model (the tests feed the training graph model input)."""
    import torch

    from edgeadapt.export import Rule, UpdatePolicy, export_bundle

    out = tmp_path_factory.mktemp("bundles") / "cnn"
    policy = UpdatePolicy(rules=(Rule("head", "full"), Rule("conv2", "channels", ratio=0.5)))
    export_bundle(make_cnn(), torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(0)), out, policy=policy,
                  cache_features=False)
    return out
