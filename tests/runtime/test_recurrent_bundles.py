"""Recurrent layers (torch.nn.GRU / LSTM) export, load past the op allowlist and train."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from edgeadapt.export import Rule, UpdatePolicy, export_bundle
from edgeadapt.runtime import Runner


class _Recurrent(nn.Module):
    def __init__(self, cell: type[nn.Module]):
        super().__init__()
        self.rnn = cell(3, 5, batch_first=True)
        self.head = nn.Linear(5, 2)

    def forward(self, x):
        out, _ = self.rnn(x.transpose(1, 2))
        return self.head(out[:, -1])


@pytest.mark.parametrize("cell", [nn.GRU, nn.LSTM])
def test_a_trained_recurrent_layer_loads_and_trains(cell, tmp_path, one_torch_thread):
    torch.manual_seed(0)
    model = _Recurrent(cell)
    export_bundle(model, torch.randn(4, 3, 6), tmp_path / "b", backend="ort-training",
                  policy=UpdatePolicy(rules=(Rule("rnn", "full"), Rule("head", "full"))))
    runner = Runner.load(tmp_path / "b", device="cpu", threads=1)
    rng = np.random.default_rng(0)
    X, y = rng.standard_normal((8, 3, 6)).astype(np.float32), rng.integers(0, 2, 8)
    before = runner.parameters(trainable_only=True)
    runner.adapt(X, y, epochs=2, batch_size=4, progress=False)
    after = runner.parameters(trainable_only=True)
    assert any(k.startswith("rnn.") for k in after)
    assert all(not np.array_equal(before[k], after[k]) for k in after)
