"""export-inference's merge of the frozen prefix and the adapted suffix when the two were
written at different opsets (a portable suffix is opset 18; the prefix may be older)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from edgeadapt.runtime.features import FEATURES_NAME, merge_inference
from edgeadapt.runtime.ort_import import import_onnxruntime


def _model(nodes, inp, out, opset, inits=()):
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(inp, TensorProto.FLOAT, ["n", 3])],
                              [helper.make_tensor_value_info(out, TensorProto.FLOAT, ["n", 1])], list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def _prefix(opset):
    # ReduceMean takes its axes as an attribute before opset 18 and as an input from 18 on.
    if opset < 18:
        nodes = [helper.make_node("ReduceMean", ["input"], [FEATURES_NAME], axes=[1], keepdims=1)]
        return _model(nodes, "input", FEATURES_NAME, opset)
    axes = helper.make_tensor("axes", TensorProto.INT64, [1], [1])
    nodes = [helper.make_node("ReduceMean", ["input", "axes"], [FEATURES_NAME], keepdims=1)]
    return _model(nodes, "input", FEATURES_NAME, opset, [axes])


def _suffix(opset):
    two = helper.make_tensor("two", TensorProto.FLOAT, [], [2.0])
    return _model([helper.make_node("Mul", [FEATURES_NAME, "two"], ["logits"])], FEATURES_NAME, "logits", opset, [two])


@pytest.mark.parametrize("prefix_opset, suffix_opset", [(17, 18), (18, 17), (18, 18)])
def test_prefix_and_suffix_of_different_opsets_merge_into_one_model(tmp_path, prefix_opset, suffix_opset):
    onnx.save(_prefix(prefix_opset), tmp_path / "prefix.onnx")
    onnx.save(_suffix(suffix_opset), tmp_path / "suffix.onnx")
    merge_inference(tmp_path / "prefix.onnx", tmp_path / "suffix.onnx", tmp_path / "model.onnx")
    merged = onnx.load(tmp_path / "model.onnx")
    assert {o.domain: o.version for o in merged.opset_import}[""] == max(prefix_opset, suffix_opset)
    ort = import_onnxruntime()
    session = ort.InferenceSession(str(tmp_path / "model.onnx"), providers=["CPUExecutionProvider"])
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    (got,) = session.run(None, {"input": x})
    np.testing.assert_array_equal(got, 2 * x.mean(1, keepdims=True))  # exact: means of small integers
