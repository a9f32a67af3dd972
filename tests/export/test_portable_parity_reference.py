"""Portable step graphs on every reference model (cnn, mobilenet, transformer) x policy (full,
last layer, channel subset, biases + norms): 10 AdamW steps of the graphs driven with numpy on
plain onnxruntime sessions against torch eager (synced per step: gradients, losses, optimizer
steps; criteria in tests/portable_parity.py), frozen tensors bit-identical; then the portable and
ort-training backends through Runner, free-running for 10 steps: losses within 2e-4 relative
(TRAJECTORY_RTOL of test_parity_reference.py).

8 channels x 256 samples, batch 8, lr 1e-3: a weight gradient sums at most 8 x 256 terms, so the
gradient tolerance is ``max(2e-5, 2048 * eps32 / 4) = 6.1e-5`` of its norm (plus the zero level
and torch's own float32 spread). Slow: 12 exports with both backends.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from portable_parity import PortableGraphs, synced_steps

from edgeadapt.export import OptimizerConfig, Rule, UpdatePolicy, export_bundle
from edgeadapt.models import build_model
from edgeadapt.runtime import Runner

STEPS, BATCH, LR, N_CHANNELS, LENGTH, N_CLASSES = 10, 8, 1e-3, 8, 256, 5
CHANNELS = {
    "cnn": UpdatePolicy(rules=(Rule("blocks.0.conv", "channels", ratio=0.5),
                               Rule("blocks.3.conv", "channels", ratio=0.25),
                               Rule("head", "full"))),
    "mobilenet": UpdatePolicy(rules=(Rule("stem.conv", "channels", ratio=0.5),
                                     Rule("blocks.*.project.conv", "channels", ratio=0.25), Rule("head", "full"))),
    "transformer": UpdatePolicy(rules=(Rule("patch_embed", "channels", ratio=0.5),
                                       Rule("layers.*.attn.q", "channels", ratio=0.25), Rule("head", "full"))),
}
POLICIES = {"full": lambda name: UpdatePolicy.full(), "last-layer": lambda name: UpdatePolicy.last_layer(),
            "channels": CHANNELS.__getitem__, "bias-norm": lambda name: UpdatePolicy.bias_and_norm()}

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]


def _model(name: str):
    torch.manual_seed(0)
    model = build_model(name, N_CHANNELS, N_CLASSES, LENGTH)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # norms and statistics as after training (fresh ones are merged by the exporter)
        for m in model.modules():
            if isinstance(m, (torch.nn.BatchNorm1d, torch.nn.LayerNorm)):
                m.weight.copy_(0.5 + torch.rand(m.weight.shape, generator=gen))
                m.bias.copy_(0.2 * torch.randn(m.bias.shape, generator=gen))
            if isinstance(m, torch.nn.BatchNorm1d):
                m.running_mean.copy_(0.2 * torch.randn(m.running_mean.shape, generator=gen))
                m.running_var.copy_(0.5 + torch.rand(m.running_var.shape, generator=gen))
    return model.eval()


def _data(n: int, seed: int):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n, N_CHANNELS, LENGTH)).astype(np.float32),
            rng.integers(0, N_CLASSES, n).astype(np.int64))


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("name", ["cnn", "mobilenet", "transformer"])
def test_reference_model_matches_torch_and_ort_training(tmp_path, name, policy):
    model = _model(name)
    x, _ = _data(BATCH, seed=0)
    bundle = tmp_path / "b"
    # No feature cache: the step graphs hold the whole model, so the torch reference (which reads
    # every parameter from the portable state) sees all of it; cached prefixes are covered by
    # tests/runtime/test_portable_features.py.
    export_bundle(model, torch.from_numpy(x), bundle, policy=POLICIES[policy](name), backend="both",
                  optimizer=OptimizerConfig("adamw", lr=LR, weight_decay=0.01), cache_features=False)
    worst, params = synced_steps(bundle, model, _data(STEPS * BATCH, seed=2), BATCH, LR, n_terms=BATCH * LENGTH)
    assert worst["grad"] <= 1 and worst["loss"] <= 1 and worst["step"] <= 1, worst
    graphs = PortableGraphs(bundle)
    for n, before in graphs.params.items():
        if n not in graphs.trained:
            assert np.array_equal(params[n], before), n

    X, Y = _data(STEPS * BATCH, seed=3)
    losses = {}
    for backend in ("portable", "ort-training"):
        runner = Runner.load(bundle, device="cpu", threads=1, backend=backend)
        losses[backend] = [runner.train_step(X[s * BATCH:(s + 1) * BATCH], Y[s * BATCH:(s + 1) * BATCH])
                           for s in range(STEPS)]
    np.testing.assert_allclose(losses["portable"], losses["ort-training"], rtol=2e-4)
