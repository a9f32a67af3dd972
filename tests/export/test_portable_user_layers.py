"""Layers users put in their own nets, trained whole through portable bundles (the export's
self-check compares each step graph with torch autograd): LeakyReLU, PReLU, a LayerNorm whose
exported node names its optional outputs, global pooling, windowed average
pooling (exported as a depthwise convolution), an Unflatten into a Conv2d (its reshape's shape
arithmetic: Mod, a reshaped shape vector; a cut tensor of unknown rank is not cached), and a
Flatten whose reshape takes the batch size (which symbolic tracing may take from the loss
weights, an input the cut eval graph does not have)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from edgeadapt.export import UpdatePolicy, export_bundle
from edgeadapt.runtime import Runner

class OverChannels(nn.Module):
    """A LayerNorm over the channels of (batch, channels, time): transposed around it."""

    def __init__(self, channels: int):
        super().__init__()
        self.norm = nn.LayerNorm(channels)

    def forward(self, x):
        return self.norm(x.transpose(1, 2)).transpose(1, 2)


def _head(*body):
    return nn.Sequential(nn.Conv1d(3, 4, 3, padding=1), *body, nn.AdaptiveAvgPool1d(1), nn.Flatten(), nn.Linear(4, 2))


NETS = {
    "leaky-prelu-layernorm": lambda: _head(nn.LeakyReLU(0.1), OverChannels(4), nn.PReLU()),
    "flatten": lambda: nn.Sequential(nn.Conv1d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6, 2)),
    "adaptive-avg": lambda: nn.Sequential(nn.Conv1d(3, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool1d(1), nn.Flatten(),
                                          nn.Linear(4, 2)),
    "adaptive-max": lambda: nn.Sequential(nn.Conv1d(3, 4, 3), nn.ReLU(), nn.AdaptiveMaxPool1d(1), nn.Flatten(),
                                          nn.Linear(4, 2)),
    "unflatten-conv2d": lambda: nn.Sequential(nn.Unflatten(1, (1, 3)), nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(),
                                              nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2)),
    "avg-pool": lambda: nn.Sequential(nn.Conv1d(3, 4, 3, padding=1), nn.ReLU(), nn.AvgPool1d(2, padding=1),
                                      nn.Flatten(), nn.Linear(4 * 5, 2)),
}


@pytest.mark.parametrize("name", NETS)
def test_a_user_layer_trains_whole_on_the_portable_engine(tmp_path, name):
    torch.manual_seed(0)
    manifest = export_bundle(NETS[name]().eval(), torch.randn(4, 3, 8), tmp_path / "b", policy=UpdatePolicy.full(),
                             backend="portable")
    assert manifest.backends == ("portable",) and manifest.trainable_numel == manifest.total_numel
    rng = np.random.default_rng(0)
    X, y = rng.standard_normal((12, 3, 8)).astype(np.float32), rng.integers(0, 2, 12)
    runner = Runner.load(tmp_path / "b", device="cpu")
    before = runner.evaluate(X, y).loss
    result = runner.adapt(X, y, epochs=5, batch_size=5, lr=0.01, progress=False)  # 5, 5, 2: a short last batch
    assert result.steps == 15 and np.isfinite(result.epoch_losses).all()
    assert runner.evaluate(X, y).loss < before
