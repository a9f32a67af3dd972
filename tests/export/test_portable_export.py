"""Portable step graphs (export.portable) on tiny models: the files and manifest an export writes,
the graphs' form (standard ONNX, opset 18, IR <= 10, dynamic batch), and 10 AdamW steps of the
graphs driven directly with numpy on plain onnxruntime sessions against torch eager
(criteria in tests/portable_parity.py); SGD; batch-statistics BatchNorm; the portable backend
against the ort-training backend through Runner."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from helpers import make_cnn, run_python
from portable_parity import PortableGraphs, synced_steps

from edgeadapt.bundle import read_manifest
from edgeadapt.export import OptimizerConfig, Rule, UpdatePolicy, export_bundle
from edgeadapt.export.portable.optimizer_graph import optimizer_graph
from edgeadapt.runtime import Runner

STEPS, BATCH, LR = 10, 4, 1e-2
POLICY = UpdatePolicy(rules=(Rule("head", "full"), Rule("conv2", "channels", ratio=0.5), Rule("*bn*", "bias")))

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _data(n: int, seed: int = 1):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, 4, 16)).astype(np.float32), rng.integers(0, 3, n).astype(np.int64)


@pytest.fixture(scope="module")
def both_bundle(tmp_path_factory):
    """Channel subset of conv2, head, BN biases; frozen BatchNorm; AdamW; both backends; the
    training graph over the whole model (no cached prefix: the torch reference runs all of it)."""
    out = tmp_path_factory.mktemp("portable") / "both"
    x, _ = _data(BATCH)
    export_bundle(make_cnn(), torch.from_numpy(x), out, policy=POLICY, backend="both", cache_features=False,
                  optimizer=OptimizerConfig("adamw", lr=LR, weight_decay=0.01))
    return out


@pytest.fixture(scope="module")
def batch_bundle(tmp_path_factory):
    """Every parameter trained, BatchNorm with batch statistics, both backends."""
    out = tmp_path_factory.mktemp("portable") / "batch"
    x, _ = _data(BATCH)
    export_bundle(make_cnn(), torch.from_numpy(x), out, policy=UpdatePolicy.full(), batchnorm="batch", backend="both",
                  optimizer=OptimizerConfig("adamw", lr=LR, weight_decay=0.01))
    return out


def test_manifest_and_graph_form(both_bundle):
    m = read_manifest(both_bundle)
    assert m.backends == ("ort-training", "portable")
    assert {"portable_train", "portable_eval", "portable_optimizer", "portable_state"} <= set(m.files)
    assert "portable_stats" not in m.files and m.portable["opset"] == 18 and m.portable["recompute"] is False
    for role in m.portable["graphs"]:
        model = onnx.load(both_bundle / m.files[role])
        onnx.checker.check_model(model, full_check=True)
        assert model.ir_version <= 10
        assert {o.domain for o in model.opset_import} <= {"", "ai.onnx"}
        assert {n.domain for n in model.graph.node} <= {"", "ai.onnx"}
        spec = m.portable["graphs"][role]
        assert [n for _, n in spec["inputs"]] == [i.name for i in model.graph.input]
        assert [n for _, n in spec["outputs"]] == [o.name for o in model.graph.output]
    train = m.portable["graphs"]["portable_train"]
    trained = {n for e in m.parameters if e.trainable_numel
               for n in [e.onnx_names.get("trained", e.onnx_names.get("value"))]}
    assert {r[5:] for r, _ in train["outputs"] if r.startswith("grad:")} == trained
    # every parameter the forward reads is an input, none is baked in
    data_input = onnx.load(both_bundle / m.files["portable_train"])
    assert not [i for i in data_input.graph.initializer if i.dims and np.prod(i.dims) > 64]
    with np.load(both_bundle / m.files["portable_state"], allow_pickle=False) as z:
        assert int(z["step"]) == 0
        assert {r[6:] for r, _ in train["inputs"] if r.startswith("param:")} <= set(z.files)


def test_ten_adamw_steps_match_torch(both_bundle):
    worst, params = synced_steps(both_bundle, make_cnn(), _data(STEPS * BATCH, seed=2), BATCH, LR, n_terms=BATCH * 16)
    assert worst["grad"] <= 1 and worst["loss"] <= 1 and worst["step"] <= 1, worst
    graphs = PortableGraphs(both_bundle)
    trained = set(graphs.trained)
    for name, before in graphs.params.items():
        if name not in trained:  # frozen tensors, frozen channel slices, statistics: bit-identical
            assert np.array_equal(params[name], before), name
        else:
            assert not np.array_equal(params[name], before), name
    # the frozen channels of the split weight, reassembled, are the source model's bits
    e = next(e for e in graphs.manifest.parameters if e.is_split)
    full = np.concatenate([params[e.onnx_names["trained"]],
                           params[e.onnx_names["frozen"]]])[params[e.onnx_names["index"]]]
    source = dict(make_cnn().named_parameters())[e.name].detach().numpy()
    mask = np.load(both_bundle / "masks.npz")[e.name]
    assert np.array_equal(full[~mask], source[~mask]) and not np.array_equal(full[mask], source[mask])


def test_batch_statistics_graphs_match_torch(batch_bundle):
    m = read_manifest(batch_bundle)
    assert "portable_stats" in m.files
    worst, _ = synced_steps(batch_bundle, make_cnn(), _data(3 * BATCH, seed=2), BATCH, LR, n_terms=BATCH * 16)
    assert worst["grad"] <= 1 and worst["loss"] <= 1 and worst["step"] <= 1 and worst["stat"] <= 1, worst
    assert worst["stat"] > 0  # statistics were compared
    # the statistics graph gives the train graph's statistics
    graphs = PortableGraphs(batch_bundle)
    x, y = _data(BATCH)
    train = graphs.train(graphs.params, x, y)
    stats = graphs.run("portable_stats",
                       {**{f"param:{n}": v for n, v in graphs.params.items()}, "data": x, "labels": y})
    for r, v in stats.items():
        np.testing.assert_array_equal(v, train[r]) if r.startswith("stat:") else None


def test_sgd_graph_matches_torch_sgd():
    rng = np.random.default_rng(0)
    shapes = {"a.weight": (3, 5), "b.bias": (7,)}
    graph = optimizer_graph(shapes, {"name": "sgd", "lr": 0.1})
    import onnxruntime as ort

    session = ort.InferenceSession(graph.model.SerializeToString(), providers=["CPUExecutionProvider"])
    params = {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
    leaves = [torch.tensor(v, requires_grad=True) for v in params.values()]
    opt = torch.optim.SGD(leaves, lr=0.05)
    for _ in range(STEPS):
        grads = {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
        feeds = {"lr": np.array(0.05, np.float32)}
        for (n, v), leaf in zip(params.items(), leaves):
            feeds[f"param:{n}"], feeds[f"grad:{n}"] = v, grads[n]
            leaf.grad = torch.from_numpy(grads[n])
        opt.step()
        outs = session.run(None, {name: feeds[r] for r, name in graph.inputs})
        params = {r[6:]: v for (r, _), v in zip(graph.outputs, outs)}
        for (n, v), leaf in zip(params.items(), leaves):  # p - lr * g: one rounding either way
            np.testing.assert_allclose(v, leaf.detach().numpy(), rtol=0, atol=2 * np.finfo(np.float32).eps * 4)


@pytest.mark.parametrize("bundle", ["both_bundle", "batch_bundle"])
def test_portable_and_ort_training_backends_agree_through_runner(bundle, request):
    bundle = request.getfixturevalue(bundle)
    X, Y = _data(STEPS * BATCH, seed=3)
    runs = {}
    for backend in ("portable", "ort-training"):
        runner = Runner.load(bundle, device="cpu", backend=backend)
        losses = [runner.train_step(X[s * BATCH:(s + 1) * BATCH], Y[s * BATCH:(s + 1) * BATCH]) for s in range(STEPS)]
        runs[backend] = (np.array(losses), runner.parameters())
    (lp, pp), (lo, po) = runs["portable"], runs["ort-training"]
    # free-running: the loss trajectories agree to 2e-4 relative (TRAJECTORY_RTOL of test_parity_reference)
    np.testing.assert_allclose(lp, lo, rtol=2e-4)
    if read_manifest(bundle).batch_statistics:
        # A conv bias before batch-statistics BatchNorm has a gradient of exactly zero in exact
        # arithmetic (the batch mean removes it): AdamW turns each engine's float noise there into
        # full-size steps of its own, which also shift the running means. Per-step parameters and
        # statistics are compared against torch in test_batch_statistics_graphs_match_torch.
        return
    for name, v in po.items():
        # 10 steps of at most ~lr each; float noise moves AdamW's steps by far less than 1e-3 of that
        np.testing.assert_allclose(pp[name], v, rtol=0, atol=1e-3 * STEPS * LR, err_msg=name)


@pytest.mark.slow
def test_export_without_onnxruntime_training_writes_portable_only(tmp_path):
    """Where onnxruntime.training cannot be imported, auto exports portable graphs alone and
    nothing imports it; ort-training is refused with the fix."""
    result = run_python(f"""
        import importlib.abc, sys
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name == "onnxruntime.training" or name.startswith("onnxruntime.training."):
                    raise ImportError("blocked: " + name)
        sys.meta_path.insert(0, Block())
        sys.path.insert(0, {str(__import__('pathlib').Path(__file__).parents[1])!r})
        import torch
        from helpers import make_cnn
        from edgeadapt.export import export_bundle
        try:
            export_bundle(make_cnn(), torch.randn(3, 4, 16), {str(tmp_path / 'x')!r}, backend="ort-training")
        except ValueError as e:
            print("REFUSED", e)
        m = export_bundle(make_cnn(), torch.randn(3, 4, 16), {str(tmp_path / 'b')!r})
        print("BACKENDS", m.backends, sorted(m.files))
        print("IMPORTED", [k for k in sys.modules if k.startswith("onnxruntime.training")])
    """, timeout_s=900)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "REFUSED backend 'ort-training' needs onnxruntime-training" in result.stdout
    assert "BACKENDS ('portable',)" in result.stdout and "training_model" not in result.stdout
    assert "IMPORTED []" in result.stdout
    runner = Runner.load(tmp_path / "b", device="cpu")
    x, y = _data(BATCH)
    assert np.isfinite(runner.train_step(x, y))


def test_cli_export_backend_portable(tmp_path, capsys):
    from edgeadapt.cli import main

    out = tmp_path / "b"
    code = main(["export", "edgeadapt.models:build_model", "--factory-kwargs",
                 '{"name": "cnn", "n_channels": 4, "n_classes": 3, "n_time_steps": 64}', "--input-shape", "4,64",
                 "--out", str(out), "--backend", "portable", "--no-progress"])
    assert code == 0, capsys.readouterr().err
    m = read_manifest(out)
    assert m.backends == ("portable",) and not {"training_model", "checkpoint"} & set(m.files)
    with pytest.raises(SystemExit):
        main(["export", "edgeadapt.models:build_model", "--input-shape", "4,64", "--out", str(tmp_path / "c"),
              "--backend", "nonsense"])
