"""Fixtures of the server trainer's tests (models and data: ``server_helpers``)."""

from __future__ import annotations

import pytest


@pytest.fixture
def adamw():
    return {"name": "adamw", "lr": 1e-2, "weight_decay": 0.1}


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    """Tiny models on a shared 2-core machine: one intra-op thread avoids oversubscription."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
