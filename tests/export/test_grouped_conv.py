"""Depthwise (grouped) 1-D convolutions followed by BatchNorm and ReLU6 train as in torch.

Two ONNX Runtime 1.19.2 behaviours meet in MobileNet's depthwise blocks (docs/ort_notes.md):

* The CPU ConvGrad of a grouped conv whose kernel rank is not 2 writes ``(C - C / group) * L``
  zeros past the end of its input gradient (wrong gradients elsewhere, or heap corruption). The
  exporter writes grouped 1-D convs as 2-D ones and refuses grouped 3-D ones.
* ORT's Clip gradient passes ``dy`` at ``x == min`` / ``x == max``; torch's ReLU6 / Hardtanh does
  not. A fresh BatchNorm (zero bias and mean) after a depthwise conv over ReLU6 outputs gives
  exact zeros, so the BN bias gradient was wrong. ``hardtanh`` / ``relu6`` are exported with
  torch's gradient.
"""

from __future__ import annotations

import contextlib

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper
from torch import nn

from edgeadapt.export import OptimizerConfig, UpdatePolicy, export_bundle
from edgeadapt.export import onnx_export
from edgeadapt.export.onnx_export import to_onnx
from edgeadapt.export.op_rewrites import check_grouped_conv_grads
from edgeadapt.export.unsupported import UnsupportedOpError
from edgeadapt.export.prepare import prepare_model
from edgeadapt.export.selfcheck import SelfCheckError
from edgeadapt.runtime import Runner
from edgeadapt.runtime.ort_import import import_onnxruntime

ort = import_onnxruntime()
POLICY = "head=full,dw_bn=full"
STEPS, BATCH, LR = 4, 8, 0.05


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


class DepthwiseBlock(nn.Module):
    """expand 1x1 + ReLU6 -> depthwise k3 -> BatchNorm (fresh: zero bias and mean) -> ReLU6 ->
    project 1x1 -> mean over time -> head."""

    def __init__(self):
        super().__init__()
        self.expand = nn.Conv1d(4, 12, 1)
        self.dw = nn.Conv1d(12, 12, 3, padding=1, groups=12, bias=False)
        self.dw_bn = nn.BatchNorm1d(12)
        self.act = nn.ReLU6()
        self.project = nn.Conv1d(12, 6, 1)
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        x = self.act(self.dw_bn(self.dw(nn.functional.relu6(self.expand(x)))))
        return self.head(self.project(x).mean(-1))


def _block() -> nn.Module:
    torch.manual_seed(0)
    return DepthwiseBlock().eval()


def _data(n: int):
    rng = np.random.default_rng(0)
    return rng.standard_normal((n, 4, 32)).astype(np.float32), rng.integers(0, 3, n).astype(np.int64)


def test_the_block_has_relu6_ties():
    """Precondition of the parity test: exact zeros reach the ReLU6 after the depthwise BN."""
    model = _block()
    X, _ = _data(BATCH)
    with torch.no_grad():
        pre = model.dw_bn(model.dw(nn.functional.relu6(model.expand(torch.from_numpy(X)))))
    assert int((pre == 0).sum()) > 100


def test_depthwise_bn_trains_as_in_torch(tmp_path):
    model = _block()
    X, y = _data(STEPS * BATCH)
    export_bundle(model, torch.from_numpy(X[:BATCH]), tmp_path / "b", policy=UpdatePolicy.parse(POLICY),
                  optimizer=OptimizerConfig("sgd", lr=LR, weight_decay=0.0))
    runner = Runner.load(tmp_path / "b", device="cpu")
    ref = _block()
    trained = [p for n, p in ref.named_parameters() if n.split(".")[0] in ("head", "dw_bn")]
    for n, p in ref.named_parameters():
        p.requires_grad_(n.split(".")[0] in ("head", "dw_bn"))
    opt = torch.optim.SGD(trained, lr=LR)
    for s in range(STEPS):
        xb, yb = X[s * BATCH:(s + 1) * BATCH], y[s * BATCH:(s + 1) * BATCH]
        loss = runner.train_step(xb, yb)
        opt.zero_grad()
        ref_loss = nn.functional.cross_entropy(ref(torch.from_numpy(xb)), torch.from_numpy(yb))
        ref_loss.backward()
        opt.step()
        np.testing.assert_allclose(loss, ref_loss.item(), rtol=1e-5, atol=1e-6)
    got = runner.parameters()
    for name, p in ref.named_parameters():
        np.testing.assert_allclose(got[name], p.detach().numpy(), rtol=1e-4, atol=2e-6, err_msg=name)
    assert not np.array_equal(got["dw_bn.bias"], np.zeros(12, np.float32))


def test_clip_gradient_at_ties_is_refused_without_the_rewrite(tmp_path, monkeypatch):
    """With ReLU6 exported as a plain Clip, ORT's gradient is wrong on the BN bias (the defect the
    reference MobileNet hit); the self-check refuses the bundle."""
    monkeypatch.setattr(onnx_export, "_torch_gradient_symbolics", contextlib.nullcontext)
    X, _ = _data(BATCH)
    with pytest.raises(SelfCheckError, match=r"gradient of dw_bn\.bias"):
        export_bundle(_block(), torch.from_numpy(X), tmp_path / "b", policy=UpdatePolicy.parse(POLICY))
    assert not (tmp_path / "b").exists()


def test_clamp_keeps_clip_and_relu6_gets_torchs_gradient():
    class Acts(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def forward(self, x):
            x = self.lin(x)
            return torch.clamp(x, 0.0, 1.0) + nn.functional.relu6(x) + nn.functional.hardtanh(x, -1.0, 2.0)

    model = Acts().eval()
    with torch.no_grad():
        model.lin.weight.copy_(torch.eye(3))
        model.lin.bias.zero_()
    prepared = prepare_model(model, UpdatePolicy.full())
    proto, _ = to_onnx(prepared.module, torch.zeros(2, 3), prepared.entries)
    ops = [n.op_type for n in proto.graph.node]
    assert ops.count("Clip") == 1 and ops.count("Where") == 4
    x = np.array([[-2.0, -1.0, 0.0], [1.0, 6.0, 7.0]], dtype=np.float32)
    out = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"input": x})[0]
    with torch.no_grad():
        want = model(torch.from_numpy(x)).numpy()
    assert np.array_equal(out, want)
    # NaN stays NaN, as in torch: a non-finite input must still give a non-finite loss
    nan_in = np.full((1, 3), np.nan, dtype=np.float32)
    nan_session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    nan_out = nan_session.run(None, {"input": nan_in})[0]
    assert np.isnan(nan_out).all()


def test_grouped_1d_convs_are_exported_as_2d():
    prepared = prepare_model(_block(), UpdatePolicy.full())
    proto, _ = to_onnx(prepared.module, torch.zeros(2, 4, 32), prepared.entries)
    for node in proto.graph.node:
        if node.op_type == "Conv" and any(a.name == "group" and a.i > 1 for a in node.attribute):
            kernel = next(list(a.ints) for a in node.attribute if a.name == "kernel_shape")
            assert kernel == [1, 3]


def _convgrad_overrun(rank: int, group: int, n: int = 3, c: int = 8, length: int = 16) -> int:
    """Run ORT's ConvGrad alone with its input gradient bound to the head of a larger buffer;
    returns how many floats after the tensor's end it changed."""
    spatial, kernel = [1] * (rank - 1) + [length], [1] * (rank - 1) + [3]
    node = helper.make_node("ConvGrad", ["dY", "X", "W"], ["dX", "dW"], domain="com.microsoft", group=group,
                            kernel_shape=kernel, pads=[0] * (rank - 1) + [1] + [0] * (rank - 1) + [1],
                            strides=[1] * rank, dilations=[1] * rank)
    shape, wshape = [n, c, *spatial], [c, c // group, *kernel]
    graph = helper.make_graph(
        [node], "g",
        [helper.make_tensor_value_info("dY", TensorProto.FLOAT, shape),
         helper.make_tensor_value_info("X", TensorProto.FLOAT, shape),
         helper.make_tensor_value_info("W", TensorProto.FLOAT, wshape)],
        [helper.make_tensor_value_info("dX", TensorProto.FLOAT, shape),
         helper.make_tensor_value_info("dW", TensorProto.FLOAT, wshape)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)])
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    size = int(np.prod(shape))
    buffer = np.full(2 * size, 7.0, dtype=np.float32)
    binding = session.io_binding()
    for name, s in (("dY", shape), ("X", shape), ("W", wshape)):
        binding.bind_cpu_input(name, rng.standard_normal(s).astype(np.float32))
    binding.bind_output("dX", "cpu", 0, np.float32, shape, buffer.ctypes.data)
    binding.bind_output("dW")
    session.run_with_iobinding(binding)
    return int((buffer[size:] != 7.0).sum())


def test_ort_grouped_convgrad_writes_past_its_input_gradient_unless_2d():
    """The ONNX Runtime defect the 1-D -> 2-D rewrite avoids (if this fails, ORT changed: re-check
    docs/ort_notes.md)."""
    assert _convgrad_overrun(rank=1, group=8) == (8 - 1) * 16
    assert _convgrad_overrun(rank=1, group=2) == (8 - 4) * 16
    assert _convgrad_overrun(rank=3, group=2) == (8 - 4) * 16
    assert _convgrad_overrun(rank=1, group=1) == 0
    assert _convgrad_overrun(rank=2, group=8) == 0


def test_a_grouped_3d_conv_that_needs_its_input_gradient_is_refused(tmp_path):
    model = nn.Sequential(nn.Conv3d(2, 4, 1), nn.Conv3d(4, 4, 3, padding=1, groups=4), nn.Flatten(),
                          nn.Linear(4 * 4 * 4 * 4, 3)).eval()
    with pytest.raises(UnsupportedOpError, match=r"'Conv' in module .*ConvGrad writes past .* 3-D kernel"):
        export_bundle(model, torch.randn(2, 2, 4, 4, 4), tmp_path / "b", policy=UpdatePolicy.full())
    assert not (tmp_path / "b").exists()
    training = onnx.helper.make_model(onnx.helper.make_graph([], "empty", [], []))
    check_grouped_conv_grads(training)  # nothing to refuse
