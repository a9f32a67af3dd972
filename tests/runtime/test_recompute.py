"""Recompute baked into the training graph (export.recompute): same loss and gradients, bit for
bit, with the runner's session settings (common subexpression elimination off)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from helpers import make_data

from edgeadapt.export.recompute import RECOMPUTE_SUFFIX, backward_nodes, recompute_nodes
from edgeadapt.runtime.backend import session_options
from edgeadapt.runtime.ort_import import pybind_state as C


def _step(bundle, training_path, X, y, session):
    state = C.load_checkpoint(str(bundle / "checkpoint"))
    device = C.OrtDevice(C.OrtDevice.cpu(), C.OrtDevice.default_memory(), 0)
    module = C.Module(str(training_path), state, None, device, session_options(session, threads=1))
    fetches = C.OrtValueVector()
    module.train_step([X, y], fetches)
    grads = {n: state.get_parameter(n).grad.numpy().copy()
             for n in state.parameter_names() if state.get_parameter(n).requires_grad}
    return fetches[0].numpy().copy(), grads


def test_recomputed_forward_nodes_give_bit_identical_loss_and_gradients(cnn_bundle, tmp_path, rng):
    model = onnx.load(cnn_bundle / "training_model.onnx")
    n_before = len(model.graph.node)
    # every forward node: those whose outputs no gradient node reads are skipped
    forward = [n.name for i, n in enumerate(model.graph.node) if i not in backward_nodes(model.graph)]
    done = recompute_nodes(model, forward)
    assert done, "no forward node of the test bundle has a saved output"
    assert len(model.graph.node) == n_before + len(done)
    copies = [n for n in model.graph.node if n.name.endswith(RECOMPUTE_SUFFIX)]
    backward = backward_nodes(model.graph)
    for copy in copies:  # each copy is placed before the gradient nodes that read it, and only they do
        index = list(model.graph.node).index(copy)
        readers = [i for i, n in enumerate(model.graph.node) if set(copy.output) & set(n.input)]
        assert readers and min(readers) > index and all(i in backward for i in readers)
    rewritten = tmp_path / "training_model.onnx"
    onnx.save(model, rewritten)

    X, y = make_data(rng, n=6)
    loss, grads = _step(cnn_bundle, cnn_bundle / "training_model.onnx", X, y, {"enable_mem_pattern": False})
    loss_rc, grads_rc = _step(cnn_bundle, rewritten, X, y, {"enable_mem_pattern": False, "disable_cse": True})
    assert np.array_equal(loss, loss_rc)
    assert grads.keys() == grads_rc.keys() and all(np.array_equal(grads[k], grads_rc[k]) for k in grads)


def test_recompute_refuses_unknown_node_names(cnn_bundle):
    model = onnx.load(cnn_bundle / "training_model.onnx")
    assert recompute_nodes(model, []) == []
    with pytest.raises(ValueError, match="no node named .*no/such/node"):
        recompute_nodes(model, ["no/such/node"])


def test_disable_cse_session_setting():
    options = session_options({"enable_mem_pattern": True, "disable_cse": True})
    assert options.get_session_config_entry("optimization.disable_specified_optimizers") == \
        "CommonSubexpressionElimination"
    assert options.enable_mem_pattern
