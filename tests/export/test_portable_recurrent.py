"""GRU and LSTM in the portable engine: the interpreter's forms of ONNX's recurrent ops against
torch's modules, and a recurrent net trained whole through a portable bundle (whose export
self-check compares its training step with torch autograd)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from torch import nn

from edgeadapt.export.onnx_export import to_onnx
from edgeadapt.export.portable.interpret import run_graph
from edgeadapt.export.prepare import prepare_model
from edgeadapt.sched.policy import UpdatePolicy

INPUT, HIDDEN, STEPS = 4, 8, 10
EPS32 = float(np.finfo(np.float32).eps)


class Recurrent(nn.Module):
    def __init__(self, kind: str, **kw):
        super().__init__()
        self.rnn = getattr(nn, kind)(INPUT, HIDDEN, batch_first=True, **kw)

    def forward(self, x):  # (batch, channels, time) as the project's models take it
        out, _ = self.rnn(x.transpose(1, 2))
        return out


FORMS = [("GRU", {}), ("GRU", {"bidirectional": True}), ("GRU", {"bias": False}), ("GRU", {"num_layers": 2}),
         ("LSTM", {}), ("LSTM", {"bidirectional": True, "num_layers": 2}), ("LSTM", {"bias": False})]


@pytest.mark.parametrize("kind,kw", FORMS, ids=[f"{k}-{'-'.join(kw) or 'plain'}" for k, kw in FORMS])
def test_recurrent_ops_match_torch(kind, kw):
    torch.manual_seed(0)
    model = Recurrent(kind, **kw).eval()
    x = torch.randn(3, INPUT, STEPS)
    prepared = prepare_model(model, UpdatePolicy.full(), "frozen")
    proto, _ = to_onnx(prepared.module, x, prepared.entries)
    assert kind in {n.op_type for n in proto.graph.node}
    got = run_graph(proto.graph, {"input": x})["output"]
    with torch.no_grad():
        want = model.double()(x.double())
    # float32 against float64: each step's gate pre-activations sum INPUT + HIDDEN + 2 products
    # (inputs, state, two biases) of O(1) values, and an error reaches the output through at most
    # STEPS contracting cells (sigmoid/tanh slopes <= 1) per layer
    layers = kw.get("num_layers", 1)
    tol = 4 * EPS32 * (INPUT + HIDDEN + 2) * STEPS * layers
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert float((got.double() - want).abs().max()) <= tol


def test_a_recurrent_form_outside_the_covered_ones_is_named():
    from edgeadapt.export.unsupported import UnsupportedOpError

    torch.manual_seed(0)
    model = Recurrent("GRU").eval()
    x = torch.randn(2, INPUT, STEPS)
    prepared = prepare_model(model, UpdatePolicy.full(), "frozen")
    proto, _ = to_onnx(prepared.module, x, prepared.entries)
    gru = next(n for n in proto.graph.node if n.op_type == "GRU")
    gru.attribute.append(onnx.helper.make_attribute("clip", 5.0))
    with pytest.raises(UnsupportedOpError, match="GRU.*clip is not supported"):
        run_graph(proto.graph, {"input": x})


@pytest.mark.parametrize("kind", ["GRU", pytest.param("LSTM", marks=pytest.mark.slow)])
def test_a_recurrent_net_trains_whole_on_the_portable_engine(tmp_path, kind):
    """(~15-30 s each: the step graph unrolls the cell over the time steps; 4 here.)"""
    steps = 4
    from edgeadapt.export import export_bundle
    from edgeadapt.runtime import Runner

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = getattr(nn, kind)(INPUT, HIDDEN, batch_first=True)
            self.head = nn.Linear(HIDDEN, 3)

        def forward(self, x):
            out, _ = self.rnn(x.transpose(1, 2))
            return self.head(out[:, -1])

    torch.manual_seed(0)
    x = torch.randn(8, INPUT, steps)
    manifest = export_bundle(Net().eval(), x, tmp_path / "b", policy=UpdatePolicy.full(), backend="portable")
    assert manifest.backends == ("portable",)
    assert manifest.trainable_numel == manifest.total_numel  # the recurrent weights train too
    runner = Runner.load(tmp_path / "b", device="cpu")
    rng = np.random.default_rng(0)
    X = rng.standard_normal((16, INPUT, steps)).astype(np.float32)
    y = rng.integers(0, 3, 16).astype(np.int64)
    before = runner.evaluate(X, y).loss
    result = runner.adapt(X, y, epochs=5, batch_size=8, lr=0.01, progress=False)
    assert result.steps == 10 and np.isfinite(result.epoch_losses).all()
    assert runner.evaluate(X, y).loss < before


def test_a_budget_is_refused_where_the_portable_step_graph_unrolls_a_recurrent_layer(tmp_path):
    """The unrolled cell's session state is not in any cost model term: a budgeted export that
    would train through a recurrent layer on the portable engine is refused, naming the fixes."""
    from edgeadapt.export import export_bundle

    torch.manual_seed(0)
    model = Recurrent("GRU").eval()
    with pytest.raises(ValueError, match="rnn is a recurrent layer.*backend='ort-training'"):
        export_bundle(model, torch.randn(4, INPUT, STEPS), tmp_path / "b", loss="mse", policy=UpdatePolicy.full(),
                      memory_budget="64MiB", backend="portable")
    assert not (tmp_path / "b").exists()
