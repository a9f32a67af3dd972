"""The export side of the planner: ONNX -> sched graph on the reference models, importance,
and applying a plan to the torch module."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("onnx")

from torch import nn  # noqa: E402

from edgeadapt.export.onnx_export import to_onnx  # noqa: E402
from edgeadapt.export.importance import measure_importance  # noqa: E402
from edgeadapt.export.prepare import prepare_from_plan, prepare_model  # noqa: E402
from edgeadapt.export.sched_graph import graph_from_onnx, module_path_of_node  # noqa: E402
from edgeadapt.models import build_model  # noqa: E402
from edgeadapt.sched import (CostModel, Graph, Mode, UpdatePolicy, plan_for_budget, plan_from_policy,  # noqa: E402
                             trained_bytes, verify)
from edgeadapt.sched.cost import activation_arrays, live_bytes  # noqa: E402

C, T = 4, 64


def _graph(name: str):
    torch.manual_seed(0)
    model = build_model(name, C, 3, T)
    prepared = prepare_model(model, UpdatePolicy.full())
    x = torch.randn(2, C, T, generator=torch.Generator().manual_seed(1))
    proto, entries = to_onnx(prepared.module, x, prepared.entries)
    types = {p: type(m).__name__ for p, m in prepared.module.named_modules() if p}
    return model, prepared.module, graph_from_onnx(proto, entries, x.shape, name=name, module_types=types), x


def test_module_path_of_node():
    assert module_path_of_node("/blocks/blocks.0/conv/Conv") == "blocks.0.conv"
    assert module_path_of_node("/blocks/blocks.0/blocks.0.conv/Conv") == "blocks.0.conv"
    assert module_path_of_node("/head/Gemm") == "head"
    assert module_path_of_node("/ReduceMean") == "<root>"


@pytest.mark.parametrize("name", ["cnn", "mobilenet", "transformer"])
def test_graph_matches_torch_shapes(name):
    model, module, g, x = _graph(name)
    assert g.input_bytes == C * T * 4
    used = {p for op in g.ops for p in op.params}
    assert used == {p.name for p in g.params} == {n for n, _ in module.named_parameters()}
    assert Graph.from_dict(g.to_dict()) == g
    # Each op that owns parameters outputs what its torch module outputs for one window.
    outputs = {}

    def record(path):
        def hook(_module, _inputs, output):
            outputs.setdefault(path, output.numel() * 4)
        return hook

    hooks = [m.register_forward_hook(record(path))
             for path, m in module.named_modules() if path and list(m.parameters(recurse=False))]
    with torch.no_grad():
        module(x[:1])
    for h in hooks:
        h.remove()
    checked = 0
    for op in g.ops:
        if op.params and op.module in outputs and "#" not in op.name:
            assert op.output_bytes == outputs[op.module], op.name
            checked += 1
    assert checked >= 3
    for op in g.ops:
        if op.kind == "Conv" and op.params and not op.inputs:
            assert op.saved_bytes == g.input_bytes  # a Conv's weight gradient re-reads its input
    assert all(op.flops > 0 for op in g.ops if op.kind in ("Conv", "Gemm", "MatMul"))


@pytest.mark.parametrize("name", ["cnn", "mobilenet", "transformer"])
def test_policies_resolve_on_reference_graphs(name):
    _, _, g, _ = _graph(name)
    head = max(g.owner_index(p.name) for p in g.params if p.module == "head")
    last = plan_from_policy(g, UpdatePolicy.last_layer())
    assert last.cut == head - 1 and {p.name for p in last.trained} == {"head.weight", "head.bias"}
    bias_norm = plan_from_policy(g, UpdatePolicy.bias_and_norm())
    assert all(p.mode is Mode.FULL for p in bias_norm.trained)
    assert {p.name for p in bias_norm.trained} >= {p.name for p in g.params if p.is_bias}
    assert verify(g, last, cost=CostModel()).peak_bytes < verify(g, plan_from_policy(g, UpdatePolicy.full()),
                                                                 cost=CostModel()).peak_bytes


def test_prepare_from_plan_applies_channel_subsets():
    model, _, g, x = _graph("cnn")
    weight = g.param("blocks.3.conv.weight")
    plan = plan_for_budget(g, 10**9, importance={"blocks.3.conv.weight": [1.0] * 8 + [0.0] * (weight.shape[0] - 8),
                                                  "head.weight": 1.0, "head.bias": 1.0},
                           batch_windows=4, n_windows=8, cost=CostModel())
    prepared = prepare_from_plan(model, plan)
    numel = sum(e.trainable_numel for e in prepared.entries)
    assert numel * 4 == trained_bytes(g, plan.params)
    channels = prepared.trained_channels.get("blocks.3.conv.weight")
    assert channels == plan.param("blocks.3.conv.weight").channels
    with torch.no_grad():
        assert torch.allclose(prepared.module(x), model.eval()(x), atol=1e-5)


def test_importance_is_the_mean_squared_gradient():
    torch.manual_seed(0)
    lin = nn.Linear(5, 3)
    x = torch.randn(8, 5, generator=torch.Generator().manual_seed(2))
    y = torch.randn(8, 3, generator=torch.Generator().manual_seed(3))
    imp = measure_importance(lin, x, labels=y, loss="mse", batch_windows=4, max_batches=2)
    w, b = lin.weight.detach().double().numpy(), lin.bias.detach().double().numpy()
    xs, ys = x.double().numpy(), y.double().numpy()
    expect_w, expect_b = np.zeros(3), np.zeros(3)
    for s in (0, 4):
        xb, yb = xs[s:s + 4], ys[s:s + 4]
        r = xb @ w.T + b - yb  # d mean((xW^T + b - y)^2) / d out = 2 r / (N * O)
        gw = 2.0 / r.size * r.T @ xb
        gb = 2.0 / r.size * r.sum(axis=0)
        expect_w += (gw ** 2).sum(axis=1) / 2
        expect_b += gb ** 2 / 2
    np.testing.assert_allclose(imp["weight"], expect_w, rtol=1e-5)
    np.testing.assert_allclose(imp["bias"], expect_b, rtol=1e-5)


def test_importance_drives_selection_on_cnn():
    model, _, g, x = _graph("cnn")
    imp = measure_importance(model, torch.randn(16, C, T), g, batch_windows=8, max_batches=2)
    assert set(imp) == {p.name for p in g.params}
    assert all(np.asarray(v).shape == (g.param(n).out_channels,) for n, v in imp.items())
    plan = plan_for_budget(g, "256KiB", importance=imp, batch_windows=8, n_windows=32, cost=CostModel())
    assert plan.predicted.peak_bytes <= 256 * 1024 and plan.trained


def test_policy_resolves_the_same_on_the_graph_and_on_the_module():
    model, module, g, _ = _graph("cnn")
    policy = UpdatePolicy.parse("blocks.2.conv=channels:0.25,blocks.3.*=bias,head=full")
    weights = {n: p.detach().numpy() for n, p in module.named_parameters()}
    plan = plan_from_policy(g, policy, weights=weights)
    prepared = prepare_model(model, policy)
    entries = {e.name: e for e in prepared.entries}
    for pp in plan.params:
        assert (entries[pp.name].trainable_numel > 0) == pp.trains, pp.name
        if pp.mode is Mode.CHANNELS:
            assert prepared.trained_channels[pp.name] == pp.channels
    assert entries["blocks.3.bn.bias"].mode == "bias" and plan.param("blocks.3.bn.bias").mode is Mode.FULL


@pytest.mark.parametrize("cell, bidirectional, kept_per_hidden, kernel_per_hidden",
                         [(nn.GRU, False, 4, 3), (nn.LSTM, True, 6, 5)])
def test_a_recurrent_layer_keeps_every_step_state_and_gate(cell, bidirectional, kept_per_hidden, kernel_per_hidden):
    """A GRU's training form keeps, per step and direction, its hidden state and three gates; an
    LSTM's its hidden and cell states and four gates: the op's saved bytes are its input plus
    those, per window. While its forward runs, the kernel also holds buffers no graph tensor shows
    (the training form's unread outputs, the inference kernel's gates; a reverse direction's
    reversed input and output): counted in the forward's live bytes, not in the backward's."""
    steps, features, hidden = 20, 4, 8

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = cell(features, hidden, batch_first=True, bidirectional=bidirectional)
            self.head = nn.Linear(hidden * (2 if bidirectional else 1), 3)

        def forward(self, x):
            y, _ = self.rnn(x.transpose(1, 2))
            return self.head(y[:, -1])

    torch.manual_seed(0)
    prepared = prepare_model(Net().eval(), UpdatePolicy.full())
    x = torch.randn(2, features, steps)
    proto, entries = to_onnx(prepared.module, x, prepared.entries)
    g = graph_from_onnx(proto, entries, x.shape)
    op = next(o for o in g.ops if o.module == "rnn")
    directions = 2 if bidirectional else 1
    assert op.saved_bytes == 4 * (steps * features + steps * directions * hidden * kept_per_hidden)
    reversed_copies = steps * (features + hidden) if bidirectional else 0
    assert op.kernel_bytes == 4 * (steps * directions * hidden * kernel_per_hidden + reversed_copies)
    i = g.op_index(op.name)
    base = replace(g, ops=tuple(replace(o, kernel_bytes=0) for o in g.ops))
    assert live_bytes(g)[i] - live_bytes(base)[i] == op.kernel_bytes
    trained = {p.name for p in g.params}
    assert activation_arrays(g, trained).grad_transient == activation_arrays(base, trained).grad_transient
    # Its weights are re-ordered per gate at every step (W, R and both biases: fixed bytes), and
    # its gradient kernel accumulates through W- and R-sized buffers of its own.
    rows = directions * (3 if cell is nn.GRU else 4) * hidden
    assert op.param_copy_bytes == 4 * (rows * features + rows * hidden + 2 * rows)
    assert op.param_grad_bytes == 2 * op.param_copy_bytes + 4 * rows * (features + hidden)
    assert op.recurrent_layers == 1 and sum(o.recurrent_layers for o in g.ops) == 1
    assert Graph.from_dict(g.to_dict()) == g
