"""Cutting the exported model into a frozen prefix and a trainable suffix (export/split.py), and
bundles that carry the prefix as an inference model (runtime/features.py)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from helpers import make_cnn, make_data
from torch import nn

from edgeadapt.export.graph import to_onnx
from edgeadapt.export.prepare import prepare_model
from edgeadapt.export.split import CutError, cut_tensor_of_node, split_model
from edgeadapt.runtime.ort_import import import_onnxruntime
from edgeadapt.sched.policy import UpdatePolicy

ort = import_onnxruntime()
EXAMPLE = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(0))


def _exported(model: nn.Module, policy: UpdatePolicy = UpdatePolicy.full()):
    prepared = prepare_model(model, policy)
    return to_onnx(prepared.module, EXAMPLE, prepared.entries)


def _run(model: onnx.ModelProto, feeds: dict) -> np.ndarray:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]


@pytest.mark.parametrize("node", ["/conv1/Conv", "/Relu", "/bn2/Add_1", "/Add", "/ReduceMean"])
def test_prefix_then_suffix_equals_the_whole_model(node, rng):
    proto, _ = _exported(make_cnn())
    split = split_model(proto, cut_tensor_of_node(proto, node))
    X, _ = make_data(rng, n=5)
    features = _run(split.prefix, {"input": X})
    chained = _run(split.suffix, {"features": features})
    whole = _run(proto, {"input": X})
    # The same kernels on the same values; fusions may differ between the sessions by float rounding.
    np.testing.assert_allclose(chained, whole, rtol=1e-6, atol=1e-6)
    assert [i.name for i in split.prefix.graph.input] == ["input"]
    assert [o.name for o in split.prefix.graph.output] == ["features"]
    assert [i.name for i in split.suffix.graph.input] == ["features"]
    assert split.features_shape[0] is None and split.features_shape[1:] == features.shape[1:]
    # every node lands on one side, except parameter-only arithmetic that both sides may copy
    n_prefix, n_suffix = len(split.prefix.graph.node), len(split.suffix.graph.node)
    assert n_prefix + n_suffix >= len(proto.graph.node) and n_prefix >= 1 and n_suffix >= 1


def test_a_connection_over_the_cut_is_refused():
    proto, _ = _exported(make_cnn())
    # x + dw(x): cutting at the depthwise conv's output leaves its input needed after the cut
    with pytest.raises(CutError, match=r"reads '/Clip_output_0' from before it .*crosses the cut"):
        split_model(proto, cut_tensor_of_node(proto, "/dw/Conv_private_grad"))


def test_a_trained_parameter_before_the_cut_is_refused():
    proto, _ = _exported(make_cnn())
    with pytest.raises(CutError, match=r"conv2.weight.*read before the cut"):
        split_model(proto, cut_tensor_of_node(proto, "/Add"), trained_initializers=["conv2.weight", "head.weight"])


def test_the_model_input_output_and_unknown_nodes_are_no_cut():
    proto, _ = _exported(make_cnn())
    with pytest.raises(CutError, match="input or output"):
        split_model(proto, "output")
    with pytest.raises(CutError, match="no node named"):
        cut_tensor_of_node(proto, "/blocks.9/Conv")


def test_the_prefix_holds_only_its_forward():
    proto, _ = _exported(make_cnn())
    split = split_model(proto, cut_tensor_of_node(proto, "/Relu"))
    prefix_inits = {i.name for i in split.prefix.graph.initializer}
    suffix_inits = {i.name for i in split.suffix.graph.initializer}
    assert {"conv1.weight", "bn1.running_var"} <= prefix_inits
    assert not prefix_inits & {"conv2.weight", "dw.weight", "head.weight"}
    assert {"conv2.weight", "head.weight"} <= suffix_inits and "conv1.weight" not in suffix_inits
    assert {n.domain for n in split.prefix.graph.node} <= {""}
