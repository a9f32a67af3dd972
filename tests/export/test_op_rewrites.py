"""Ops ONNX Runtime 1.19.2 cannot differentiate, rewritten by the exporter (``op_rewrites._OP_REWRITES``):
each trains with the full policy like torch autograd, and exports for inference like torch.
An op that stays unsupported is reported as UnsupportedOpError naming the op and module, at
each stage where ONNX Runtime can fail (artifact generation, session build, train step).

Tolerances as in test_parity.py: after STEPS AdamW steps, parameters atol 2e-5 + rtol 1e-4,
losses 1e-5.
"""

from __future__ import annotations

import copy

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from edgeadapt.export import OptimizerConfig, UnsupportedOpError, UpdatePolicy, export_bundle
from edgeadapt.runtime import Runner

STEPS, BATCH, LR = 4, 4, 1e-2
ATOL, RTOL, LOSS_ATOL = 2e-5, 1e-4, 1e-5


class _Fn(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


class _Net(nn.Module):
    """Conv1d(4, 8, 3) -> the op under test (module ``act``) -> mean over time if 3-D -> Linear."""

    def __init__(self, fn):
        super().__init__()
        self.conv = nn.Conv1d(4, 8, 3, padding=1)
        self.act = _Fn(fn)
        with torch.no_grad():
            features = self._features(torch.zeros(1, 4, 16))
        self.head = nn.Linear(features.shape[1], 3)

    def _features(self, x):
        y = self.act(self.conv(x))
        return y.mean(-1) if y.dim() == 3 else y

    def forward(self, x):
        return self.head(self._features(x))


# (id, function, ONNX op type torch exports for it, which must not reach the training graph; for
# ReduceLogSumExp / ReduceL2 only their keepdims=0 form, whose gradient ONNX Runtime cannot build)
REWRITTEN = [
    ("elu", nn.ELU(alpha=0.7), "Elu"),
    ("softplus", lambda x: F.softplus(x, beta=2.0), "Softplus"),
    ("hardsigmoid", F.hardsigmoid, "HardSigmoid"),
    ("hardswish", F.hardswish, "HardSwish"),
    ("amax", lambda x: x.amax(-1), "ReduceMax"),
    ("max-channels", lambda x: x.max(1, keepdim=True).values, "ReduceMax"),  # non-trailing axis, keepdims
    ("amin", lambda x: x.amin(-1), "ReduceMin"),
    ("logsumexp", lambda x: torch.logsumexp(x, -1), "ReduceLogSumExp/keepdims=0"),
    ("norm", lambda x: x.norm(dim=-1), "ReduceL2/keepdims=0"),
    ("flip", lambda x: x.flip(-1) * torch.linspace(0.5, 1.5, 16), "Slice"),  # flipped against a ramp
    ("interpolate", lambda x: F.interpolate(x, scale_factor=2) * torch.linspace(0.5, 1.5, 32), "Resize"),
]


def _model(fn) -> nn.Module:
    torch.manual_seed(0)
    return _Net(fn).eval()


def _torch_training(model, X, y):
    model = copy.deepcopy(model).eval()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    losses = []
    for s in range(STEPS):
        opt.zero_grad()
        loss = F.cross_entropy(model(torch.from_numpy(X[s * BATCH:(s + 1) * BATCH])),
                               torch.from_numpy(y[s * BATCH:(s + 1) * BATCH]))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return model, losses


@pytest.mark.parametrize("fn,op", [c[1:] for c in REWRITTEN], ids=[c[0] for c in REWRITTEN])
def test_rewritten_op_trains_like_torch(tmp_path, fn, op):
    rng = np.random.default_rng(3)
    X = rng.standard_normal((STEPS * BATCH, 4, 16)).astype(np.float32)
    y = rng.integers(0, 3, len(X)).astype(np.int64)
    model = _model(fn)
    export_bundle(model, torch.from_numpy(X[:2]), tmp_path / "b", policy=UpdatePolicy.full(),
                  optimizer=OptimizerConfig("adamw", lr=LR, weight_decay=0.01))
    ops = {n.op_type + "".join(f"/{a.name}={a.i}" for a in n.attribute if a.name == "keepdims")
           for n in onnx.load(tmp_path / "b" / "training_model.onnx").graph.node}
    assert not any(o == op or o.startswith(op + "/") for o in ops), f"{op} reached the training graph"

    runner = Runner.load(tmp_path / "b", device="cpu")
    losses = [runner.train_step(X[s * BATCH:(s + 1) * BATCH], y[s * BATCH:(s + 1) * BATCH]) for s in range(STEPS)]
    ref_model, ref_losses = _torch_training(model, X, y)
    np.testing.assert_allclose(losses, ref_losses, atol=LOSS_ATOL, rtol=1e-5)
    got = runner.parameters()
    for name, ref in ref_model.named_parameters():
        np.testing.assert_allclose(got[name], ref.detach().numpy(), atol=ATOL, rtol=RTOL, err_msg=name)
        assert not np.array_equal(got[name], dict(model.named_parameters())[name].detach().numpy()), name

    runner.export_inference(tmp_path / "inf.onnx")
    session = ort.InferenceSession(str(tmp_path / "inf.onnx"), providers=["CPUExecutionProvider"])
    with torch.no_grad():
        want = ref_model(torch.from_numpy(X)).numpy()
    np.testing.assert_allclose(session.run(None, {"input": X})[0], want, atol=1e-4, rtol=1e-4)


def _refused(tmp_path, fn, op, stage):
    with pytest.raises(UnsupportedOpError, match=stage) as info:
        export_bundle(_model(fn), torch.randn(2, 4, 16), tmp_path / "b", policy=UpdatePolicy.full())
    assert info.value.op == op
    assert info.value.modules == ["act"]
    assert "freeze everything before it" in str(info.value)
    assert "damaged" not in str(info.value)
    assert list(tmp_path.iterdir()) == []  # nothing written, no staging directory left


def test_op_without_gradient_is_refused_at_generation(tmp_path):
    _refused(tmp_path, lambda x: x.cumsum(-1), "CumSum", "has no gradient")


def test_op_without_gradient_kernel_is_refused_at_session_build(tmp_path):
    """Linear Resize: the gradient graph builds, but ONNX Runtime has no ResizeGrad kernel."""
    _refused(tmp_path, lambda x: F.interpolate(x, scale_factor=2, mode="linear"), "Resize",
             "cannot build the training session.*ResizeGrad")


def test_op_whose_gradient_fails_at_the_train_step_is_refused(tmp_path, monkeypatch):
    """A negative-step Slice without its rewrite: SliceGrad fails in the self-check's train step."""
    from edgeadapt.export import op_rewrites

    monkeypatch.setattr(op_rewrites, "_OP_REWRITES", tuple(r for r in op_rewrites._OP_REWRITES if r[0] != "Slice"))
    _refused(tmp_path, lambda x: x.flip(-1), "Slice", "training step fails.*SliceGrad")


def test_gradient_builder_failure_is_refused(tmp_path, monkeypatch):
    """logsumexp without its rewrite: ONNX Runtime's gradient builder emits an invalid node."""
    from edgeadapt.export import op_rewrites

    monkeypatch.setattr(op_rewrites, "_OP_REWRITES",
                        tuple(r for r in op_rewrites._OP_REWRITES if r[0] != "ReduceLogSumExp"))
    _refused(tmp_path, lambda x: torch.logsumexp(x, -1), "ReduceLogSumExp", "cannot build its gradient")


def test_budget_plan_trains_only_after_an_op_without_gradient(tmp_path, caplog):
    """CumSum in the middle (module ``act``): under a budget the planner trains only the head after
    it (the graph IR marks ``act`` not differentiable), where it used to pick the conv before it
    and fail; a policy that trains the conv is still refused with UnsupportedOpError."""
    import json
    import logging

    from edgeadapt.sched import Graph

    model, example = _model(lambda x: x.cumsum(-1)), torch.randn(8, 4, 16)
    with caplog.at_level(logging.INFO, logger="edgeadapt.sched.batching"):
        export_bundle(model, example, tmp_path / "b", memory_budget="16MiB", n_windows=16, batch_windows=8)
    manifest = json.loads((tmp_path / "b" / "manifest.json").read_text())
    trained = {p["name"] for p in manifest["plan"]["params"] if p["mode"] != "frozen"}
    assert trained and trained <= {"head.weight", "head.bias"}
    graph = Graph.from_dict(manifest["graph"])
    assert [op.name for op in graph.ops if not op.differentiable] == ["act"]
    assert graph.gradient_blocked() == {"conv.weight", "conv.bias"}
    assert "conv.weight" in caplog.text  # what the planner left out is logged
    with pytest.raises(UnsupportedOpError) as info:
        export_bundle(model, example, tmp_path / "c", memory_budget="16MiB", n_windows=16, batch_windows=8,
                      policy=UpdatePolicy.full())
    assert info.value.op == "CumSum" and info.value.modules == ["act"]
