"""Cutting the exported model into a frozen prefix and a trainable suffix (export/split.py), and
bundles that carry the prefix as an inference model (runtime/features.py)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from helpers import make_cnn, make_data, strip_plan
from torch import nn

from edgeadapt.bundle import read_manifest
from edgeadapt.export import Rule, export_bundle
from edgeadapt.export.onnx_export import to_onnx
from edgeadapt.export.prepare import prepare_model
from edgeadapt.export.split import CutError, cut_tensor_of_node, split_model
from edgeadapt.runtime import Runner
from edgeadapt.runtime.features import PrefixModel
from edgeadapt.runtime.ort_import import import_onnxruntime
from edgeadapt.sched import Graph, Plan
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
    with pytest.raises(CutError, match=r"reads '/Where_1_output_0' from before it .*crosses the cut"):
        split_model(proto, cut_tensor_of_node(proto, "/dw/Conv_as_1d"))


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


# ---- bundles with a prefix model ---------------------------------------------------------------
# dw and head train: the frozen prefix conv1 -> bn1 -> relu -> conv2 -> bn2 -> relu6 ends where the
# residual branch starts, a clean cut.
TWIN_POLICY = UpdatePolicy(rules=(Rule("head", "full"), Rule("dw", "full")))
# Trained parameters after 3 epochs of AdamW agree to this (float32 kernels of two sessions may
# round the frozen prefix's output differently by ~1e-8); frozen ones are bit-identical.
PARAM_ATOL, PARAM_RTOL = 1e-5, 1e-4


@pytest.fixture(scope="module")
def twins(tmp_path_factory):
    """The same model and policy exported twice: features cached (prefix model) and plain."""
    root = tmp_path_factory.mktemp("twins")
    export_bundle(make_cnn(), EXAMPLE, root / "cached", policy=TWIN_POLICY, cache_features=True)
    export_bundle(make_cnn(), EXAMPLE, root / "plain", policy=TWIN_POLICY, cache_features=False)
    return root / "cached", root / "plain"


def test_the_cached_bundle_carries_prefix_plan_and_graph(twins):
    cached, plain = (read_manifest(b) for b in twins)
    assert cached.files["prefix_model"] == "prefix_model.onnx" and "prefix_model" not in plain.files
    for m in (cached, plain):
        plan = Plan.from_dict(m.plan)
        graph = Graph.from_dict(m.graph)
        assert m.plan["predicted_peak_bytes"] == plan.predicted.peak_bytes > 0
        assert {p.name for p in plan.trained} == {"dw.weight", "dw.bias", "head.weight", "head.bias"}
        assert {p.name for p in graph.params} >= {"conv1.weight", "head.weight"}
    plan = Plan.from_dict(cached.plan)
    assert plan.cache_features and plan.cut >= 0
    training = onnx.load(twins[0] / "training_model.onnx").graph
    assert [i.name for i in training.input][0] == "features"
    assert [i.name for i in onnx.load(twins[1] / "training_model.onnx").graph.input][0] == "input"


def test_feature_cached_adapt_gives_the_parameters_of_the_plain_bundle(twins, rng):
    X, y = make_data(rng, n=20)
    X_eval, y_eval = make_data(rng, n=9)
    runners = [Runner.load(b, device="cpu") for b in twins]
    results = [r.adapt(X, y, epochs=3, batch_size=8, seed=1, progress=False) for r in runners]
    np.testing.assert_allclose(results[0].epoch_losses, results[1].epoch_losses, rtol=1e-5, atol=1e-6)
    (cached, plain) = (r.parameters() for r in runners)
    assert cached.keys() == plain.keys()
    for name in cached:
        if name.split(".")[0] in ("dw", "head"):
            np.testing.assert_allclose(cached[name], plain[name], rtol=PARAM_RTOL, atol=PARAM_ATOL, err_msg=name)
        else:
            np.testing.assert_array_equal(cached[name], plain[name], err_msg=name)
    np.testing.assert_allclose(runners[0].predict(X_eval), runners[1].predict(X_eval), rtol=1e-4, atol=1e-5)
    ev = [r.evaluate(X_eval, y_eval) for r in runners]
    assert ev[0].accuracy == ev[1].accuracy and ev[0].loss == pytest.approx(ev[1].loss, rel=1e-5, abs=1e-6)


def test_the_prefix_allocates_no_training_state(twins):
    runner = Runner.load(twins[0], device="cpu")
    assert isinstance(runner._prefix, PrefixModel)
    assert isinstance(runner._prefix._session, ort.InferenceSession)  # inference only: no gradient/optimizer buffers
    prefix = onnx.load(twins[0] / "prefix_model.onnx").graph
    assert [o.name for o in prefix.output] == ["features"] and [i.name for i in prefix.input] == ["input"]
    assert {n.domain for n in prefix.node} <= {""}  # no com.microsoft gradient / optimizer kernels
    assert not [n.op_type for n in prefix.node if "Grad" in n.op_type or "Optimizer" in n.op_type]
    assert not {i.name for i in prefix.initializer} & {"dw.weight", "dw.bias", "head.weight", "head.bias"}
    training = onnx.load(twins[0] / "training_model.onnx").graph
    buffers = {i.name.split("_grad.")[0] for i in training.input if "_grad.accumulation" in i.name}
    assert buffers == {"dw.weight", "dw.bias", "head.weight", "head.bias"}
    # the prefix's layers are not in the training graph at all (no forward, no backward)
    assert not {i.name for i in training.input} & {"conv1.weight", "bn1.weight", "conv2.weight"}


def test_export_inference_chains_prefix_and_adapted_suffix(twins, rng, tmp_path):
    runner = Runner.load(twins[0], device="cpu")
    X, y = make_data(rng, n=12)
    runner.adapt(X, y, epochs=2, batch_size=6, progress=False)
    path = runner.export_inference(tmp_path / "model.onnx")
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == ["input"]
    np.testing.assert_allclose(session.run(None, {"input": X})[0], runner.predict(X), rtol=1e-5, atol=1e-6)
    saved = runner.save(tmp_path / "adapted")
    assert (saved / "prefix_model.onnx").is_file()
    again = Runner.load(saved, device="cpu")
    for name, value in runner.parameters().items():
        np.testing.assert_array_equal(again.parameters()[name], value, err_msg=name)


def test_bundles_without_a_plan_still_load_and_adapt(twins, rng, tmp_path):
    strip_plan(twins[1], tmp_path / "old")
    manifest = read_manifest(tmp_path / "old")
    assert manifest.plan is None and manifest.graph is None and not manifest.has_prefix
    runner = Runner.load(tmp_path / "old", device="cpu")
    X, y = make_data(rng, n=8)
    result = runner.adapt(X, y, epochs=1, batch_size=4, progress=False)
    assert result.steps == 2 and np.isfinite(result.epoch_losses).all()
