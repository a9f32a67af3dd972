"""Recompute baked into the training graph (export.recompute): same loss and gradients, bit for
bit, with the runner's session settings; saved tensors found in the graph ONNX Runtime trains,
whose artifact generator fuses nodes of the exported model (GELU, LayerNorm)."""

from __future__ import annotations

import logging

import numpy as np
import onnx
import pytest
from helpers import make_cnn, make_data, make_fusible, make_transformer

from edgeadapt.export.recompute import (RECOMPUTE_SUFFIX, backward_nodes, kept_tensors, recompute_tensors,
                                        saved_tensors_by_op, unrecomputable)
from edgeadapt.runtime.backend import session_options
from edgeadapt.runtime.ort_import import pybind_state as C


def _reference_transformer():
    """The reference transformer, small: DecomposedLayerNorm, softmax attention, GELU MLP."""
    import torch

    from edgeadapt.models import build_model

    torch.manual_seed(0)
    return build_model("transformer", 4, 3, 16, patch_size=4, d_model=16, n_heads=2, n_layers=1).eval()


MODELS = {"cnn": make_cnn, "transformer": make_transformer, "reference": _reference_transformer,
          "fusible": make_fusible}


def _example():
    import torch

    return torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def bundles(tmp_path_factory, cnn_bundle):
    """Bundles that train everything (the CNN: the conftest one), exported on first use."""
    from edgeadapt.export import UpdatePolicy, export_bundle

    made = {"cnn": cnn_bundle}

    def get(name):
        if name not in made:
            made[name] = tmp_path_factory.mktemp("bundles") / name
            export_bundle(MODELS[name](), _example(), made[name], policy=UpdatePolicy.full())
        return made[name]

    return get


def _step(bundle, training_path, X, y, session):
    state = C.load_checkpoint(str(bundle / "checkpoint"))
    device = C.OrtDevice(C.OrtDevice.cpu(), C.OrtDevice.default_memory(), 0)
    module = C.Module(str(training_path), state, None, device, session_options(session, threads=1))
    fetches = C.OrtValueVector()
    module.train_step([X, y], fetches)
    grads = {n: state.get_parameter(n).grad.numpy().copy()
             for n in state.parameter_names() if state.get_parameter(n).requires_grad}
    return fetches[0].numpy().copy(), grads


@pytest.mark.parametrize("name,layout", [("cnn", "one run"), ("transformer", "one run"),
                                         ("transformer", "every other tensor"), ("reference", "one run"),
                                         ("reference", "every other tensor"), ("fusible", "one run"),
                                         ("fusible", "every other tensor")])
def test_recomputed_tensors_give_bit_identical_loss_and_gradients(bundles, name, layout, tmp_path, rng):
    bundle = bundles(name)
    model = onnx.load(bundle / "training_model.onnx")
    kept = list(kept_tensors(model.graph))
    done = recompute_tensors(model, [kept] if layout == "one run" else [[t] for t in kept[::2]])
    assert done, "no kept tensor of the test bundle could be rebuilt"
    backward = backward_nodes(model.graph)
    assert not set(done) & kept_tensors(model.graph).keys(), "a rebuilt tensor is still read by the backward"
    for copy in (n for n in model.graph.node if RECOMPUTE_SUFFIX in n.name):
        index = list(model.graph.node).index(copy)  # before its readers: backward nodes or copies
        readers = [i for i, n in enumerate(model.graph.node) if set(copy.output) & set(n.input)]
        assert readers and min(readers) > index and all(i in backward for i in readers)
    rewritten = tmp_path / "training_model.onnx"
    onnx.save(model, rewritten)

    X, y = make_data(rng, n=6)
    loss, grads = _step(bundle, bundle / "training_model.onnx", X, y, {"enable_mem_pattern": False})

    def identical(mem_pattern: bool) -> bool:
        loss_rc, grads_rc = _step(bundle, rewritten, X, y, {"enable_mem_pattern": mem_pattern, "disable_cse": True})
        return np.array_equal(loss, loss_rc) and grads.keys() == grads_rc.keys() and \
            all(np.array_equal(grads[k], grads_rc[k]) for k in grads)

    # ONNX Runtime's memory planner returns a wrong loss for some graphs with the memory pattern
    # off, others with it on; the export self-check records the setting that reproduces torch.
    assert identical(False) or identical(True)


@pytest.mark.parametrize("name", ["reference", "fusible"])
def test_saved_tensors_of_fused_nodes_belong_to_their_ops(bundles, name):
    """ONNX Runtime fuses the exported GELU (Div/Erf/Add/Mul/Mul) into one ``Gelu`` node and a
    LayerNorm written with ``Pow`` into ``LayerNormalization``: those nodes' names are gone, and
    the tensors their gradients keep still belong to the GELU's and the norm's ops."""
    from edgeadapt.export import UpdatePolicy
    from edgeadapt.export.onnx_export import to_onnx
    from edgeadapt.export.planning import model_graph, node_groups
    from edgeadapt.export.prepare import prepare_model

    graph, _ = model_graph(MODELS[name](), _example(), "frozen")
    prepared = prepare_model(MODELS[name](), UpdatePolicy.full(), "frozen")
    proto, _ = to_onnx(prepared.module, _example(), prepared.entries, "input", "output")
    tensor_ops = {t: op for op, nodes in node_groups(proto, graph).items() for n in nodes for t in n.output if t}
    training = onnx.load(bundles(name) / "training_model.onnx")
    by_op = saved_tensors_by_op(training, tensor_ops, [op.name for op in graph.ops])

    gelus = [n for n in training.graph.node if n.op_type == "Gelu"]
    exported_names = {n.name for n in proto.graph.node}
    assert gelus and not {n.name for n in gelus} & exported_names  # fused: the names are new
    gelu_op = "layers.0.mlp.act" if name == "reference" else "pool_act"
    assert by_op[gelu_op] == [gelus[0].input[0]]  # GeluGrad keeps the GELU's input
    if name == "fusible":  # LayerNormalizationGrad keeps the input, mean and inverse deviation
        norm = next(n for n in training.graph.node if n.op_type == "LayerNormalization")
        assert norm.name not in exported_names
        assert set(by_op["norm"]) == {norm.input[0], *norm.output[1:]}
    owned = [t for tensors in by_op.values() for t in tensors]
    assert len(owned) == len(set(owned)) and set(by_op) <= {op.name for op in graph.ops}
    assert not set(owned) & {i.name for i in training.graph.input}  # graph inputs stay with the caller


def test_batch_statistics_are_never_run_twice(tmp_path):
    """A BatchNorm trained with batch statistics updates its running statistics: a tensor whose
    rebuild would run it again is refused."""
    from edgeadapt.export import UpdatePolicy, export_bundle

    export_bundle(make_cnn(), _example(), tmp_path / "b", policy=UpdatePolicy.full(), batchnorm="batch")
    model = onnx.load(tmp_path / "b" / "training_model.onnx")
    kept = list(kept_tensors(model.graph))
    blocked = unrecomputable(model, [kept])
    assert blocked and set(blocked.values()) <= {n.name for n in model.graph.node
                                                  if n.op_type in ("BatchNormInternal", "BatchNormalization")}
    with pytest.raises(ValueError, match="must not run twice"):
        recompute_tensors(model, [kept])
    free = [t for t in kept if t not in blocked]
    assert not unrecomputable(model, [free]) and recompute_tensors(model, [free])


WINDOWS = 16


def _mlp_recompute_case(engine: str = "ort-training"):
    """The reference transformer (2 layers) and a budget under which the planner recomputes its
    first GELU (``layers.0.mlp.act``) with ``engine``'s cost constants, found by lowering the
    budget from what keeping every activation needs, so that the case follows the cost model."""
    import torch

    from edgeadapt.export import UpdatePolicy
    from edgeadapt.export.planning import model_graph
    from edgeadapt.models import build_model
    from edgeadapt.sched import CostModel, NoFeasiblePlan, plan_for_budget, plan_from_policy, predict

    torch.manual_seed(0)
    model = build_model("transformer", 2, 3, 64, patch_size=4, d_model=16, n_heads=2, n_layers=2)
    x = torch.randn(WINDOWS, 2, 64, generator=torch.Generator().manual_seed(0))
    graph, weights = model_graph(model, x, "frozen")
    cost = CostModel.default(engine)
    kw = dict(policy=UpdatePolicy.full(), weights=weights, batch_windows=WINDOWS, n_windows=WINDOWS, cost=cost)
    keep_all = predict(graph, plan_from_policy(graph, kw["policy"], weights=weights, batch_windows=WINDOWS,
                                               n_windows=WINDOWS, micro_batch_windows=WINDOWS), cost).peak_bytes
    for step in range(1, 200):
        try:
            plan = plan_for_budget(graph, int(keep_all * (1 - step / 400)), **kw)
        except NoFeasiblePlan:
            break
        if "layers.0.mlp.act" in plan.recomputed:
            return model, x, plan.budget_bytes
    pytest.fail("no budget makes the planner recompute layers.0.mlp.act")


def test_budget_plan_recomputing_the_mlp_exports_and_trains(tmp_path, rng, caplog):
    """Regression: the exported GELU's nodes (``/layers/layers.0/mlp/act/Div``, ``Erf``, ...)
    are fused into one ``Gelu`` in the training graph; exporting a plan that recomputes them
    failed with "recompute: no node named [...]"."""
    from edgeadapt.export import UpdatePolicy, export_bundle
    from edgeadapt.runtime import Runner

    model, x, budget = _mlp_recompute_case()
    out = tmp_path / "bundle"
    with caplog.at_level(logging.INFO, logger="edgeadapt.export.exporter"):
        manifest = export_bundle(model, x, out, policy=UpdatePolicy.full(), memory_budget=budget,
                                 n_windows=WINDOWS, batch_windows=WINDOWS, recompute=True)
    assert "layers.0.mlp.act" in [n for n, a in manifest.plan["activations"] if a == "recompute"]
    assert manifest.session["disable_cse"]
    assert "rebuilt in the backward" in caplog.text
    training = onnx.load(out / "training_model.onnx")
    gelu = next(n for n in training.graph.node if n.op_type == "Gelu" and "layers.0" in n.output[0])
    assert gelu.input[0] not in kept_tensors(training.graph)  # the GELU's input is rebuilt, not kept
    X, y = make_data(rng, n=WINDOWS, n_channels=2, length=64)
    result = Runner.load(out, device="cpu").adapt(X, y, epochs=1, batch_size=WINDOWS, progress=False)
    assert result.steps == 1 and np.isfinite(result.epoch_losses).all()


@pytest.mark.parametrize("plain_passes", [True, False])
def test_export_without_recompute_when_the_self_check_refuses_it(tmp_path, monkeypatch, caplog, plain_passes):
    """ONNX Runtime miscomputes some rewritten graphs (a grouped ConvGrad that overwrites a
    gradient buffer another branch still reads, depending on the execution order). When the
    self-check refuses the training graph with rebuilt tensors but accepts it without, the bundle
    keeps them instead, with a warning, and the planner plans again without recompute (here: a
    smaller micro-batch fits the same budget); when it refuses both, the model is the cause and
    its own error is raised."""
    from edgeadapt.export import UpdatePolicy, exporter
    from edgeadapt.export.selfcheck import SelfCheckError
    from edgeadapt.sched import Graph, Plan, verify

    real = exporter.choose_session

    def refusing(stage, manifest, *args):
        if manifest.session.get("disable_cse") or not plain_passes:
            raise SelfCheckError(f"gradient of layers.0.mlp.fc1.weight differs (recompute: {manifest.session})")
        return real(stage, manifest, *args)

    monkeypatch.setattr(exporter, "choose_session", refusing)
    model, x, budget = _mlp_recompute_case()
    out = tmp_path / "b"
    kw = dict(policy=UpdatePolicy.full(), memory_budget=budget, n_windows=WINDOWS, batch_windows=WINDOWS,
              recompute=True)
    with caplog.at_level(logging.WARNING):
        if not plain_passes:
            with pytest.raises(SelfCheckError):
                exporter.export_bundle(model, x, out, **kw)
            assert "exporting without recompute" not in caplog.text and not out.exists()
            return
        manifest = exporter.export_bundle(model, x, out, **kw)
    assert "exporting without recompute" in caplog.text
    assert not manifest.session.get("disable_cse")
    plan = Plan.from_dict(manifest.plan)
    assert plan.recomputed == () and plan.budget_bytes == budget
    assert plan.micro_batch_windows < WINDOWS  # the recomputing plan took the whole batch
    verify(Graph.from_dict(manifest.graph), plan, budget)  # the recorded plan is the one verified
    assert manifest.plan["predicted_peak_bytes"] <= budget
    training = onnx.load(out / "training_model.onnx")
    gelu = next(n for n in training.graph.node if n.op_type == "Gelu" and "layers.0" in n.output[0])
    assert gelu.input[0] in kept_tensors(training.graph)  # kept, not rebuilt


def test_a_budget_export_recomputes_nothing_unless_asked(tmp_path):
    """Recompute is opt-in (``recompute=True``): measured under ONNX Runtime 1.19.2 the saving is not
    reliably realized, so by default the planner keeps every saved activation."""
    from edgeadapt.export import UpdatePolicy, export_bundle

    model, x, budget = _mlp_recompute_case()
    manifest = export_bundle(model, x, tmp_path / "b", policy=UpdatePolicy.full(), memory_budget=2 * budget,
                             n_windows=WINDOWS, batch_windows=WINDOWS)
    assert all(a == "keep" for _, a in manifest.plan["activations"])
    assert not manifest.session.get("disable_cse")


def test_a_portable_only_export_is_planned_without_recompute(tmp_path):
    """The portable step graphs keep every activation the backward reads, so a portable-only
    export plans without recompute from the start (the budget then fits at a smaller micro-batch)
    instead of editing a recomputing plan afterwards."""
    from edgeadapt.export import UpdatePolicy, export_bundle
    from edgeadapt.sched import Graph, Plan, verify

    from edgeadapt.sched import CostModel

    model, x, budget = _mlp_recompute_case("portable")
    manifest = export_bundle(model, x, tmp_path / "b", policy=UpdatePolicy.full(), memory_budget=budget,
                             n_windows=WINDOWS, batch_windows=WINDOWS, recompute=True, backend="portable")
    plan = Plan.from_dict(manifest.plan)
    assert manifest.backends == ("portable",) and plan.recomputed == ()
    assert plan.micro_batch_windows < WINDOWS
    verify(Graph.from_dict(manifest.graph), plan, budget, cost=CostModel.default("portable"))
