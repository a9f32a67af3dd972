"""Parity with torch autograd: the runner's parameters after several steps match a torch model
trained with the same policy and optimizer semantics.

Torch reference for a channel subset: gradients are masked to the trained channels and the frozen
channels are restored after each step (so weight decay cannot move them) — the semantics the
bundle's split graph implements. Tolerance: float32 kernels differ in summation order, so after
6 steps we allow atol 2e-5 + rtol 1e-4 on parameters and 1e-5 on losses.
"""

from __future__ import annotations

import copy

import numpy as np
import onnxruntime as ort
import pytest
import torch
from helpers import make_cnn, make_cnn2d, make_data, make_groupnorm, make_transformer

from edgeadapt.export import OptimizerConfig, Rule, UpdatePolicy, export_bundle
from edgeadapt.export.objectives import torch_loss
from edgeadapt.runtime import Runner

STEPS, BATCH, LR = 6, 4, 1e-2
ATOL, RTOL, LOSS_ATOL = 2e-5, 1e-4, 1e-5

POLICIES = {
    "full": UpdatePolicy.full(),
    "last-layer": UpdatePolicy.last_layer(),
    "bias-norm": UpdatePolicy.bias_and_norm(),
    "channels": UpdatePolicy(rules=(Rule("head", "full"), Rule("conv2", "channels", ratio=0.5),
                                    Rule("bn2", "channels", indices=(0, 3, 7)))),
    "2d-channels": UpdatePolicy(rules=(Rule("head", "full"), Rule("dw", "channels", indices=(1, 4)),
                                       Rule("bn", "full"))),
    "tf-channels": UpdatePolicy(rules=(Rule("head", "full"), Rule("qkv", "channels", ratio=0.25),
                                       Rule("norm2", "full"))),
    "gn-channels": UpdatePolicy(rules=(Rule("head", "full"), Rule("conv1", "channels", indices=(0, 5)),
                                       Rule("gn", "full"), Rule("inorm", "bias"))),
}


def torch_reference(model, masks, loss, opt_name, X, y):
    """Train a copy of ``model`` as the bundle should; returns (model, per-step losses)."""
    model = copy.deepcopy(model).eval()
    params = dict(model.named_parameters())
    shaped = {}
    for name, p in params.items():
        m = torch.from_numpy(masks[name])
        p.requires_grad_(bool(m.any()))
        shaped[name] = m.reshape(-1, *([1] * (p.dim() - 1))).to(p.dtype)
    trained = [p for p in params.values() if p.requires_grad]
    opt = (torch.optim.AdamW(trained, lr=LR, weight_decay=0.01) if opt_name == "adamw"
           else torch.optim.SGD(trained, lr=LR))
    losses = []
    for s in range(STEPS):
        xb = torch.from_numpy(X[s * BATCH:(s + 1) * BATCH])
        yb = None if y is None else torch.from_numpy(y[s * BATCH:(s + 1) * BATCH])
        before = {n: p.detach().clone() for n, p in params.items() if p.requires_grad}
        opt.zero_grad()
        loss_t = torch_loss(loss, model(xb), yb)
        loss_t.backward()
        for n, p in params.items():
            if p.requires_grad:
                p.grad *= shaped[n]
        opt.step()
        with torch.no_grad():
            for n, p in params.items():
                if p.requires_grad:
                    p.copy_(p * shaped[n] + before[n] * (1 - shaped[n]))
        losses.append(loss_t.item())
    return model, losses


def targets(loss, rng, n, n_classes):
    if loss == "cross_entropy":
        return rng.integers(0, n_classes, n).astype(np.int64)
    if loss == "mse":
        return rng.standard_normal((n, n_classes)).astype(np.float32)
    if loss == "bce_with_logits":
        return rng.uniform(0, 1, (n, n_classes)).astype(np.float32)
    return None


CASES = [
    ("cnn", "full", "cross_entropy", "adamw"),
    ("cnn", "last-layer", "cross_entropy", "adamw"),
    ("cnn", "bias-norm", "cross_entropy", "adamw"),
    ("cnn", "channels", "cross_entropy", "adamw"),
    ("cnn", "channels", "cross_entropy", "sgd"),
    ("cnn", "full", "mse", "adamw"),
    ("cnn", "channels", "bce_with_logits", "adamw"),
    ("cnn", "bias-norm", "entropy", "sgd"),
    ("cnn2d", "full", "cross_entropy", "adamw"),
    ("cnn2d", "2d-channels", "cross_entropy", "adamw"),
    ("transformer", "full", "cross_entropy", "adamw"),
    ("transformer", "tf-channels", "cross_entropy", "adamw"),
    ("groupnorm", "full", "cross_entropy", "adamw"),
    ("groupnorm", "gn-channels", "mse", "adamw"),
]


@pytest.mark.parametrize("arch,policy,loss,opt_name", CASES, ids=["-".join(c) for c in CASES])
def test_runner_matches_torch_autograd(tmp_path, arch, policy, loss, opt_name):
    rng = np.random.default_rng(1)
    model = {"cnn": make_cnn, "cnn2d": make_cnn2d, "transformer": make_transformer, "groupnorm": make_groupnorm}[arch]()
    X, _ = make_data(rng, n=STEPS * BATCH, n_channels=8 if arch == "cnn2d" else 4)
    if arch == "cnn2d":  # (windows, 2, 8, 8): e.g. two spectrogram channels
        X = X.reshape(len(X), 2, 8, 8)
    y = targets(loss, rng, len(X), 3)
    opt = OptimizerConfig(opt_name, lr=LR, weight_decay=0.01 if opt_name == "adamw" else 0.0)
    export_bundle(model, torch.from_numpy(X[:2]), tmp_path / "b", policy=POLICIES[policy], loss=loss, optimizer=opt)
    runner = Runner.load(tmp_path / "b", device="cpu")
    masks = dict(np.load(tmp_path / "b" / "masks.npz", allow_pickle=False))

    losses = [runner.train_step(X[s * BATCH:(s + 1) * BATCH], None if y is None else y[s * BATCH:(s + 1) * BATCH])
              for s in range(STEPS)]
    ref_model, ref_losses = torch_reference(model, masks, loss, opt_name, X, y)

    np.testing.assert_allclose(losses, ref_losses, atol=LOSS_ATOL, rtol=1e-5)
    got = runner.parameters()
    original = {n: p.detach().numpy() for n, p in model.named_parameters()}
    moved = 0
    for name, ref in ref_model.named_parameters():
        np.testing.assert_allclose(got[name], ref.detach().numpy(), atol=ATOL, rtol=RTOL, err_msg=name)
        frozen_rows = ~masks[name]
        # Frozen parameters and frozen channels: bit-identical, not merely close.
        assert np.array_equal(got[name][frozen_rows], original[name][frozen_rows]), name
        moved += int(not np.array_equal(got[name], original[name]))
    assert moved > 0, "training changed no parameter"

    # export-inference equals the torch model carrying the adapted weights
    runner.export_inference(tmp_path / "inf.onnx")
    adapted = copy.deepcopy(model)
    adapted.load_state_dict({n: torch.from_numpy(v) for n, v in got.items()}, strict=False)
    session = ort.InferenceSession(str(tmp_path / "inf.onnx"), providers=["CPUExecutionProvider"])
    onnx_out = session.run(None, {"input": X})[0]
    with torch.no_grad():
        torch_out = adapted.eval()(torch.from_numpy(X)).numpy()
    np.testing.assert_allclose(onnx_out, torch_out, atol=1e-5, rtol=1e-5)


def test_batch_statistics_mode_trains_with_batch_stats(tmp_path):
    """batchnorm='batch': ORT normalises with batch statistics, like torch BatchNorm in train mode."""
    rng = np.random.default_rng(2)
    model = make_cnn()
    X, y = make_data(rng, n=STEPS * BATCH)
    export_bundle(model, torch.from_numpy(X[:2]), tmp_path / "b", policy=UpdatePolicy.last_layer(),
                  optimizer=OptimizerConfig("sgd", lr=LR, weight_decay=0.0), batchnorm="batch")
    runner = Runner.load(tmp_path / "b", device="cpu")
    ref = copy.deepcopy(model).train()
    for p in ref.parameters():
        p.requires_grad_(False)
    ref.head.weight.requires_grad_(True)
    ref.head.bias.requires_grad_(True)
    opt = torch.optim.SGD([ref.head.weight, ref.head.bias], lr=LR)
    for s in range(3):
        xb, yb = X[s * BATCH:(s + 1) * BATCH], y[s * BATCH:(s + 1) * BATCH]
        loss = runner.train_step(xb, yb)
        opt.zero_grad()
        ref_loss = torch.nn.functional.cross_entropy(ref(torch.from_numpy(xb)), torch.from_numpy(yb))
        ref_loss.backward()
        opt.step()
        assert loss == pytest.approx(ref_loss.item(), abs=1e-5)
    np.testing.assert_allclose(runner.parameters()["head.weight"], ref.head.weight.detach().numpy(), atol=ATOL)
