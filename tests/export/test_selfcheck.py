"""The export self-check sees small wrong gradients and wrong optimizer steps.

Each case injects one defect into an otherwise correct export of a reference model and expects
:class:`SelfCheckError` naming what differs: ONNX Runtime's real Clip-gradient difference (ReLU6
exported without ``onnx_export.py``'s torch-gradient form), an all-zero gradient, and an
optimizer step with a learning rate
0.1% off. Tolerances are in ``export/selfcheck.py``'s docstring, with the noise they were
chosen from.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from torch import nn

from edgeadapt.export import UpdatePolicy, export_bundle
from edgeadapt.export import onnx_export
from edgeadapt.export.reduction_noise import ReductionBounds, reduction_allowance
from edgeadapt.export.selfcheck import (
    GRAD_ATOL,
    REDUCTION_FACTOR,
    SelfCheckError,
    check_batch,
    compare_gradients,
)
from edgeadapt.models import build_model
from edgeadapt.runtime.backend import OrtTrainingBackend

LENGTH = 64


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


def reference_model(name: str) -> nn.Module:
    """A seeded reference model with distinct norm parameters and running statistics, as if trained."""
    torch.manual_seed(0)
    model = build_model(name, 8, 5, LENGTH)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (nn.BatchNorm1d, nn.LayerNorm)):
                n = m.weight.numel()
                m.weight.copy_(0.5 + torch.rand(n, generator=gen))
                m.bias.copy_(torch.rand(n, generator=gen) - 0.5)
            if isinstance(m, nn.BatchNorm1d):
                m.running_mean.copy_(torch.rand(n, generator=gen) - 0.5)
                m.running_var.copy_(0.5 + torch.rand(n, generator=gen))
    return model.eval()


EXAMPLE = torch.randn(2, 8, LENGTH, generator=torch.Generator().manual_seed(0))


def test_mobilenet_exports_with_the_workaround(tmp_path):
    """The baseline for the cases below: the unmodified export passes its own check."""
    export_bundle(reference_model("mobilenet"), EXAMPLE, tmp_path / "b", policy=UpdatePolicy.full())
    assert (tmp_path / "b" / "manifest.json").is_file()


def test_relu6_as_a_plain_clip_is_caught_on_mobilenet(tmp_path, monkeypatch):
    """ReLU6 exported as ONNX Clip: ONNX Runtime 1.19.2's Clip gradient passes ``dy`` at the
    bounds, torch's does not. A MobileNet at initialisation (zero BN bias and mean) has exact zeros
    at its depthwise ReLU6 inputs, so its depthwise BN bias gradients are wrong; the check must
    refuse it."""
    monkeypatch.setattr(onnx_export, "_torch_gradient_symbolics", contextlib.nullcontext)
    torch.manual_seed(0)
    model = build_model("mobilenet", 8, 5, LENGTH).eval()
    with pytest.raises(SelfCheckError,
                       match=r"gradient of blocks\.\d\.depthwise\.bn\.bias \(batch \d\): error") as caught:
        export_bundle(model, EXAMPLE, tmp_path / "b", policy=UpdatePolicy.full())
    assert not (tmp_path / "b").exists()
    assert "cosine" in str(caught.value)


@pytest.mark.parametrize("name", ["cnn", "mobilenet", "transformer"])
def test_an_all_zero_gradient_fails_for_every_tensor_with_a_nonzero_torch_gradient(name):
    """Per tensor: replace ONNX Runtime's gradient by zeros; the comparison must flag exactly that
    tensor, for every tensor whose torch gradient is above its allowance (the numerical-zero level
    plus the rounding bound of its reduction): every tensor of the CNN and MobileNet."""
    model = reference_model(name)
    with ReductionBounds(model, [n for n, _ in model.named_parameters()]) as recorded:
        out = model(EXAMPLE)
        torch.nn.functional.cross_entropy(out, torch.arange(len(EXAMPLE)) % 5).backward()
    bounds = recorded.bounds()
    want = {n: p.grad.numpy().copy() for n, p in model.named_parameters()}
    scale = max(float(np.linalg.norm(g)) for g in want.values())
    allowed = {n: GRAD_ATOL * scale + REDUCTION_FACTOR * reduction_allowance(bounds[n]) for n in want}
    nonzero = [n for n, g in want.items() if float(np.linalg.norm(g)) > allowed[n]]
    if name != "transformer":  # the transformer's key biases have an exactly-zero gradient
        assert len(nonzero) == len(want)
        # conditioned well enough here that a gradient 5% wrong is caught on every tensor (the
        # worst, MobileNet's first expand BatchNorm scale, allows 3%)
        assert all(allowed[n] < 0.05 * float(np.linalg.norm(want[n])) for n in want)
    assert all(d.passed for d in compare_gradients(dict(want), want, bounds))
    for n in nonzero:
        got = dict(want)
        got[n] = np.zeros_like(want[n])
        failed = [d.what for d in compare_gradients(got, want, bounds) if not d.passed]
        assert failed == [f"gradient of {n}"], n


def test_an_all_zero_gradient_is_caught_end_to_end(tmp_path, monkeypatch):
    monkeypatch.setattr(OrtTrainingBackend, "get_gradient", lambda self, name: np.zeros_like(self.get_tensor(name)))
    with pytest.raises(SelfCheckError, match=r"(\d+) of \d+ checks fail") as caught:
        export_bundle(reference_model("cnn"), EXAMPLE, tmp_path / "b", policy=UpdatePolicy.full())
    assert "gradient of" in str(caught.value)
    assert not (tmp_path / "b").exists()


def test_a_slightly_wrong_optimizer_step_is_caught(tmp_path, monkeypatch):
    """ONNX Runtime's optimizer run with a learning rate 0.1% off the exported one."""
    apply = OrtTrainingBackend.apply_update
    monkeypatch.setattr(OrtTrainingBackend, "apply_update", lambda self, lr: apply(self, lr * 1.001))
    with pytest.raises(SelfCheckError, match=r"optimizer step of [\w.]+ \(batch \d\)"):
        export_bundle(reference_model("cnn"), EXAMPLE, tmp_path / "b", policy=UpdatePolicy.last_layer())


def test_check_batch_keeps_a_varied_example_and_replaces_a_constant_one():
    varied = np.random.default_rng(0).standard_normal((2, 3, 16)).astype(np.float32)
    assert check_batch(varied) is varied
    for value in (0.0, 2.5, -1.0):
        constant = np.full((2, 3, 16), value, np.float32)
        out = check_batch(constant)
        assert out.shape == constant.shape and out.dtype == np.float32
        assert np.ptp(out) > 0, "the check batch must vary"
        if value:
            assert (np.sign(out) == np.sign(value)).all(), "a nonzero constant's sign is kept"
        np.testing.assert_array_equal(out, check_batch(constant), "seeded: the same batch every time")


@pytest.mark.parametrize("backend", ["ort-training", "portable"])
def test_a_zero_example_exports_with_batch_statistics(tmp_path, backend):
    # An all-zero example makes every batch-statistics BatchNorm normalise a channel of zero
    # variance: gradients of pure float32 noise, refused before the check ran on varied windows.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(3, 8, 5), nn.BatchNorm1d(8), nn.ReLU(), nn.AdaptiveAvgPool1d(1),
                          nn.Flatten(), nn.Linear(8, 6)).eval()
    manifest = export_bundle(model, torch.zeros(2, 3, 32), tmp_path / "b", policy=UpdatePolicy.parse("bias-norm"),
                             loss="entropy", batchnorm="batch", backend=backend)
    assert manifest.trainable_numel > 0
