"""Every runner feature on the portable backend, through the real exporter: adapt with
micro-batches, rollback of a NaN loss, of a non-finite update and of Ctrl-C (parameters and
optimizer state), save/reload (a save by one backend drops the other's files), export-inference
with and without a prefix model, frozen channels, BatchNorm statistics, label-free adaptation
(entropy loss, ``adapt_unlabeled``), the CLI with ``--backend`` and the CUDA fallback.

Two bundles are exported once per session (portable exports trace step graphs: seconds each):

* ``cnn_both``: the test CNN, head trained fully and half of conv2's output channels, frozen
  BatchNorm, AdamW, the frozen prefix (conv1, bn1) cut off with cached features, both backends;
* ``toy_both``: 1x1 conv (identity) + BatchNorm with batch statistics + Linear head, the label-free
  entropy loss, biases and norms trained, both backends.
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import replace

import numpy as np
import onnx
import pytest
import torch
from helpers import make_cnn, make_data, sigint_at_train_step
from onnx import numpy_helper
from portable_parity import PortableGraphs, TorchReference, grad_deviations

from edgeadapt.bundle import BundleError, read_manifest
from edgeadapt.export import OptimizerConfig, Rule, UpdatePolicy, export_bundle
from edgeadapt.runtime import (
    AdaptInterrupted,
    DeviceUnavailableError,
    NonFiniteLossError,
    Runner,
)
from edgeadapt.runtime import device as device_mod
from edgeadapt.runtime.ort_import import import_onnxruntime
from edgeadapt.runtime.unlabeled import UnlabeledSettings

EPS32 = float(np.finfo(np.float32).eps)
LR = 1e-2
N_CLASSES, TOY_STEPS = 3, 8
ORT_FILES = ("training_model", "eval_model", "optimizer_model", "checkpoint")
PORTABLE_FILES = ("portable_train", "portable_eval", "portable_optimizer", "portable_state")

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="session")
def cnn_both(tmp_path_factory):
    out = tmp_path_factory.mktemp("portable_features") / "cnn"
    x, _ = make_data(np.random.default_rng(0), n=4)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        export_bundle(make_cnn(), torch.from_numpy(x), out, backend="both", cache_features=True,
                      policy=UpdatePolicy(rules=(Rule("head", "full"), Rule("conv2", "channels", ratio=0.5))),
                      optimizer=OptimizerConfig("adamw", lr=LR, weight_decay=0.01))
    finally:
        torch.set_num_threads(before)
    return out


class _Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv1d(N_CLASSES, N_CLASSES, 1, bias=False)
        self.bn = torch.nn.BatchNorm1d(N_CLASSES)
        self.head = torch.nn.Linear(N_CLASSES, N_CLASSES)

    def forward(self, x):
        return self.head(self.bn(self.conv(x)).mean(-1))


@pytest.fixture(scope="session")
def toy_both(tmp_path_factory):
    model = _Toy()
    with torch.no_grad():
        model.conv.weight.copy_(torch.eye(N_CLASSES)[:, :, None])
        model.head.weight.copy_(torch.eye(N_CLASSES))
        model.head.bias.zero_()
    out = tmp_path_factory.mktemp("portable_features") / "toy"
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        export_bundle(model.eval(), torch.from_numpy(_toy_windows(4, seed=9)), out,
                      policy=UpdatePolicy.parse("bias-norm"),
                      loss="entropy", batchnorm="batch", backend="both")
    finally:
        torch.set_num_threads(before)
    return out


@pytest.fixture
def cnn_copy(cnn_both, tmp_path):
    dst = tmp_path / "cnn"
    shutil.copytree(cnn_both, dst)
    return dst


def _load(bundle, backend="portable", **kwargs):
    return Runner.load(bundle, device="cpu", threads=1, backend=backend, **kwargs)


def _toy_windows(n: int, seed: int = 0, amplitude: float = 1.5) -> np.ndarray:
    rng = np.random.default_rng(seed)
    means = amplitude * np.eye(N_CLASSES)[np.arange(n) % N_CLASSES]
    return (means[:, :, None] + 0.3 * rng.standard_normal((n, N_CLASSES, TOY_STEPS))).astype(np.float32)


def _same_state(a: Runner, b: Runner) -> None:
    """Parameters, running statistics, AdamW moments and the step count bit for bit."""
    sa, sb = a._backend.state_arrays(), b._backend.state_arrays()
    assert sa.keys() == sb.keys()
    assert any(k.startswith("exp_avg_sq/") for k in sa)
    differ = [k for k in sa if not np.array_equal(sa[k], sb[k])]
    assert not differ, differ


# ---- adapt ------------------------------------------------------------------------------
def _gradients_of_one_step(runner: Runner, x, y, micro_batch, monkeypatch) -> dict[str, np.ndarray]:
    """The gradients the update of one ``train_step`` applies (read just before it)."""
    backend, seen = runner._backend, {}
    real = backend.apply_update

    def apply_update(lr):
        seen.update({n: backend.get_gradient(n) for n in backend.parameter_names(trainable_only=True)})
        real(lr)

    monkeypatch.setattr(backend, "apply_update", apply_update)
    runner.train_step(x, y, micro_batch=micro_batch)
    return seen


def test_micro_batches_give_the_whole_batch_step(cnn_both, monkeypatch):
    """Gradients accumulated over unequal micro-batches (3 + 3 + 2 windows) and the whole batch's
    are both within the float32 allowance of torch's float64 gradient (tests/portable_parity.py:
    the longest weight-gradient sum is 8 windows x 8 conv2 output positions)."""
    x, y = make_data(np.random.default_rng(1), n=8)
    whole = _gradients_of_one_step(_load(cnn_both), x, y, None, monkeypatch)
    split = _gradients_of_one_step(_load(cnn_both), x, y, 3, monkeypatch)
    graphs = PortableGraphs(cnn_both)
    ref = TorchReference(make_cnn(), graphs, batch_statistics=False)
    prefix = onnx.load(cnn_both / graphs.manifest.files["prefix_model"])
    params = {**{t.name: numpy_helper.to_array(t) for t in prefix.graph.initializer}, **graphs.params}
    _, g64, _ = ref.loss_grads(params, x, y, torch.float64)
    _, g32, _ = ref.loss_grads(params, x, y, torch.float32)
    for got in (whole, split):
        worst = grad_deviations(got, g64, g32, n_terms=8 * 8)
        assert max(worst.values()) <= 1, worst


def _nan_at(runner: Runner, call: int, monkeypatch) -> None:
    """The backend's ``call``-th training step (counted from 1) returns a NaN loss."""
    real, calls = runner._backend.train_step, []

    def train_step(x, y):
        calls.append(1)
        loss, out = real(x, y)
        return (float("nan") if len(calls) == call else loss), out

    monkeypatch.setattr(runner._backend, "train_step", train_step)


def test_nan_loss_rolls_back_parameters_and_optimizer_state(cnn_both, monkeypatch):
    X, y = make_data(np.random.default_rng(2), n=12)
    twin = _load(cnn_both)
    twin.adapt(X, y, epochs=1, batch_size=4, progress=False)
    runner = _load(cnn_both)
    _nan_at(runner, 5, monkeypatch)  # epoch 2, step 2: back to the end of epoch 1 (replayed from the bundle's state)
    with pytest.raises(NonFiniteLossError, match="rolled back to step 3"):
        runner.adapt(X, y, epochs=3, batch_size=4, progress=False)
    assert (runner.step, runner.epoch) == (3, 1)
    _same_state(runner, twin)
    # and it trains on exactly as the twin does
    assert runner.train_step(X[:4], y[:4]) == twin.train_step(X[:4], y[:4])
    _same_state(runner, twin)


def test_non_finite_update_rolls_back_to_the_call_start(cnn_both):
    X, y = make_data(np.random.default_rng(3), n=8)
    runner, twin = _load(cnn_both), _load(cnn_both)
    for r in (runner, twin):
        r.adapt(X, y, epochs=1, batch_size=4, progress=False)
    # a learning rate that overflows the parameters: the update is applied, found non-finite,
    # and the call's start (a checkpoint written by this call: the runner changed since load) restored
    with pytest.raises(NonFiniteLossError, match="rolled back to step 2"):
        runner.adapt(X, y, epochs=1, batch_size=4, lr=1e38, shuffle=False, progress=False)
    assert runner.step == 2
    _same_state(runner, twin)


def test_ctrl_c_stops_at_the_last_completed_epoch(cnn_both, monkeypatch):
    X, y = make_data(np.random.default_rng(4), n=12)
    twin = _load(cnn_both)
    twin.adapt(X, y, epochs=1, batch_size=4, progress=False)
    runner = _load(cnn_both)
    sigint_at_train_step(monkeypatch, runner, 5)
    with pytest.raises(AdaptInterrupted):
        runner.adapt(X, y, epochs=3, batch_size=4, progress=False)
    assert (runner.step, runner.epoch) == (3, 1)
    _same_state(runner, twin)


def test_frozen_channels_and_tensors_stay_bit_identical(cnn_both):
    runner = _load(cnn_both)
    before = runner.parameters()
    X, y = make_data(np.random.default_rng(5), n=16)
    runner.adapt(X, y, epochs=2, batch_size=8, progress=False)
    after = runner.parameters()
    trained = set(runner.parameters(trainable_only=True))
    assert trained == {"head.weight", "head.bias", "conv2.weight", "conv2.bias"}
    for name in before:
        if name not in trained:  # the prefix (conv1, bn1), bn2, dw: untouched
            assert np.array_equal(after[name], before[name]), name
    with np.load(cnn_both / "masks.npz") as masks:
        mask = masks["conv2.weight"]
    assert 0 < mask.sum() < mask.size
    w0, w1 = before["conv2.weight"], after["conv2.weight"]
    assert np.array_equal(w1[~mask], w0[~mask]) and not np.array_equal(w1[mask], w0[mask])


# ---- save / reload ----------------------------------------------------------------------
def _members(bundle) -> set[str]:
    return {p.name for p in bundle.iterdir()}


def test_a_portable_save_drops_the_ort_training_files_and_resumes_bit_identically(cnn_copy, tmp_path):
    X, y = make_data(np.random.default_rng(6), n=16)
    straight = _load(cnn_copy)
    straight.adapt(X, y, epochs=2, batch_size=8, progress=False)

    first = _load(cnn_copy, backend="auto")  # auto: the portable graphs, which the bundle holds
    assert first.backend == "portable"
    first.adapt(X, y, epochs=1, batch_size=8, progress=False)
    held = read_manifest(cnn_copy)
    saved = first.save(tmp_path / "saved")
    m = read_manifest(saved)
    assert m.backends == ("portable",) and m.portable == held.portable
    assert not set(ORT_FILES) & set(m.files)
    assert _members(saved) == {*m.files.values(), "manifest.json"}  # no ORT file copied
    with pytest.raises(BundleError, match="holds no ort-training graphs"):
        _load(saved, backend="ort-training")
    resumed = _load(saved, backend="auto")
    assert (resumed.backend, resumed.step, resumed.epoch) == ("portable", 2, 1)
    resumed.adapt(X, y, epochs=1, batch_size=8, progress=False)
    _same_state(resumed, straight)

    # in place: the ORT-training files go too (the checkpoint would be stale)
    in_place = _load(cnn_copy)
    in_place.adapt(X, y, epochs=2, batch_size=8, progress=False)
    in_place.save()
    m = read_manifest(cnn_copy)
    assert m.backends == ("portable",) and not set(ORT_FILES) & set(m.files)
    assert _members(cnn_copy) == {*m.files.values(), "manifest.json"}
    _same_state(_load(cnn_copy), straight)


def test_an_ort_training_save_drops_the_portable_files(cnn_copy, tmp_path):
    X, y = make_data(np.random.default_rng(7), n=8)
    runner = _load(cnn_copy, backend="ort-training")
    runner.adapt(X, y, epochs=1, batch_size=4, progress=False)
    want = runner.parameters()
    for out in (runner.save(tmp_path / "saved"), runner.save()):
        m = read_manifest(out)
        assert m.backends == ("ort-training",) and m.portable is None
        assert not set(PORTABLE_FILES) & set(m.files)
        assert not [n for n in _members(out) if n.startswith("portable_")]
        reloaded = _load(out, backend="auto")
        assert reloaded.backend == "ort-training" and reloaded.step == 2
        got = reloaded.parameters()
        assert all(np.array_equal(got[k], want[k]) for k in want)
        with pytest.raises(BundleError, match="holds no portable graphs"):
            _load(out, backend="portable")


# ---- export-inference -------------------------------------------------------------------
def _run_model(path, X) -> np.ndarray:
    ort = import_onnxruntime()
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"]).run(None, {"input": X})[0]


def test_export_inference_behind_a_prefix_model(cnn_both, tmp_path):
    """The merged model (prefix at its own opset brought to the suffix's, one graph) computes what
    predict computes in two sessions, but ONNX Runtime may fuse and reorder across the former
    boundary: equal within float32 rounding of the model's reductions (at most 8 x 3 conv taps,
    12 head inputs, 4 positions averaged: 40 terms), relative to the largest logit."""
    runner = _load(cnn_both)
    X, y = make_data(np.random.default_rng(8), n=12)
    runner.adapt(X, y, epochs=1, batch_size=4, progress=False)
    path = runner.export_inference(tmp_path / "model.onnx")
    model = onnx.load(path)
    onnx.checker.check_model(model, full_check=True)
    assert [i.name for i in model.graph.input] == ["input"]
    out, want = _run_model(path, X), runner.predict(X)
    np.testing.assert_allclose(out, want, rtol=0, atol=40 * EPS32 * float(np.abs(want).max()))
    # the adapted parameters are in it, under their own names
    inits = {t.name for t in model.graph.initializer}
    assert {"head.weight", "head.bias"} <= inits


def test_export_inference_without_a_prefix_is_predict_bit_for_bit(toy_both, tmp_path):
    runner = _load(toy_both)
    X = _toy_windows(12)
    runner.adapt(X, None, epochs=1, batch_size=4, lr=0.05, progress=False)
    path = runner.export_inference(tmp_path / "model.onnx")
    onnx.checker.check_model(onnx.load(path), full_check=True)
    assert np.array_equal(_run_model(path, X), runner.predict(X))


# ---- BatchNorm statistics and label-free adaptation ------------------------------------
def _stats(runner: Runner) -> dict[str, np.ndarray]:
    return {n: runner._backend.get_tensor(f"bn.{n}") for n in ("running_mean", "running_var")}


def test_bn_statistics_follow_torch_momentum_and_nothing_else_moves(toy_both):
    """The toy's BatchNorm reads the input itself (identity 1x1 conv): after one batch the running
    statistics are torch's ``0.9 * old + 0.1 * batch`` with the batch's unbiased variance, from
    float64 numpy; a mean and a variance of 4 x 8 float32 terms per channel: relative 32 ulp."""
    runner = _load(toy_both)
    before, stats0 = runner.parameters(), _stats(runner)
    X = _toy_windows(4, seed=1)
    result = runner.adapt(X, None, epochs=1, batch_size=4, lr=0, shuffle=False, progress=False)
    assert result.steps == 1 and runner.step == 1
    x64 = X.astype(np.float64)
    mean, var = x64.mean(axis=(0, 2)), x64.var(axis=(0, 2), ddof=1)
    got, tol = _stats(runner), 32 * EPS32
    np.testing.assert_allclose(got["running_mean"], 0.9 * stats0["running_mean"] + 0.1 * mean, rtol=0,
                               atol=tol * np.abs(x64).max())
    np.testing.assert_allclose(got["running_var"], 0.9 * stats0["running_var"] + 0.1 * var, rtol=tol)
    after = runner.parameters()
    assert all(np.array_equal(after[n], before[n]) for n in before)
    assert not runner._backend.training_open  # no backward, no optimizer
    # The ort-training backend's statistics pass gives the same means. (Its variance differs: ONNX
    # Runtime's BatchNormInternal keeps the batch's biased variance, torch the unbiased one.)
    other = _load(toy_both, backend="ort-training")
    other.update_bn_statistics(X, shuffle=False, progress=False)
    np.testing.assert_allclose(_stats(other)["running_mean"], got["running_mean"], rtol=0,
                               atol=2 * tol * np.abs(x64).max())


def test_entropy_loss_adapts_like_the_ort_training_backend(toy_both):
    """The label-free loss trains on both engines alike: losses and parameters after 6 steps
    (free-running, as tests/export/test_portable_export.py compares them)."""
    X = _toy_windows(24, seed=2)
    runs = {}
    for backend in ("portable", "ort-training"):
        runner = _load(toy_both, backend=backend)
        result = runner.adapt(X, None, epochs=2, batch_size=8, lr=0.05, shuffle=False, progress=False)
        runs[backend] = (np.array(result.epoch_losses), runner.parameters())
    (lp, pp), (lo, po) = runs["portable"], runs["ort-training"]
    np.testing.assert_allclose(lp, lo, rtol=2e-4)
    assert lp[-1] < lp[0]  # the entropy falls
    for name, v in po.items():
        np.testing.assert_allclose(pp[name], v, rtol=0, atol=1e-3 * 6 * 0.05, err_msg=name)


def test_adapt_unlabeled_on_the_portable_backend(toy_both):
    """Every stage runs on portable: statistics, entropy steps, and the prototype head, found in the
    exported inference model as MatMul + Add (the portable graphs are traced through core aten ops)
    under the parameters' own names. Entropy steps and prototypes give what they give on the
    ort-training backend (statistics off there: the backends' running variances differ, see above)."""
    X = _toy_windows(30, seed=3, amplitude=4.0)
    every = UnlabeledSettings(stats_prior_windows=20.0, entropy_steps=3, lr=0.05, entropy_threshold=1.0,
                              prototype_mix=0.5, prototype_threshold=1.0, gate=False)
    result = _load(toy_both).adapt_unlabeled(X, every)
    assert result.stages == ("stats", "entropy", "prototypes") and result.skipped == () and result.steps == 3
    no_stats = replace(every, stats_prior_windows=float("inf"))
    params = {}
    for backend in ("portable", "ort-training"):
        runner = _load(toy_both, backend=backend)
        assert runner.adapt_unlabeled(X, no_stats).stages == ("entropy", "prototypes")
        params[backend] = runner.parameters()
    for name, v in params["ort-training"].items():
        # 3 AdamW steps of <= lr each: float noise moves them far less than 1e-3 of that
        np.testing.assert_allclose(params["portable"][name], v, rtol=0, atol=1e-3 * 3 * 0.05, err_msg=name)
    gated = _load(toy_both).adapt_unlabeled(X)  # the default method, with its safety gate
    assert gated.gate is not None and not gated.skipped


# ---- CLI and device ---------------------------------------------------------------------
def test_cli_adapt_and_export_inference_with_each_backend(cnn_both, tmp_path, capsys):
    from edgeadapt.cli import main

    X, y = make_data(np.random.default_rng(9), n=8)
    data = tmp_path / "data.npz"
    np.savez(data, X=X.transpose(0, 2, 1), y=y, subject=np.zeros(len(X), np.int64), sample_rate_hz=50.0)
    for backend, drops in (("portable", ORT_FILES), ("ort-training", PORTABLE_FILES)):
        out = tmp_path / backend
        code = main(["adapt", str(cnn_both), "--data", str(data), "--epochs", "1", "--batch-size", "4",
                     "--device", "cpu", "--backend", backend, "--out", str(out), "--no-progress"])
        assert code == 0, capsys.readouterr().err
        m = read_manifest(out)
        assert m.backends == (backend,) and not set(drops) & set(m.files)
        assert main(["export-inference", str(out), str(tmp_path / f"{backend}.onnx")]) == 0
        assert _run_model(tmp_path / f"{backend}.onnx", X).shape == (len(X), N_CLASSES)
    assert main(["export-inference", str(tmp_path / "portable"), str(tmp_path / "x.onnx"),
                 "--backend", "ort-training"]) == 2
    assert "holds no ort-training graphs" in capsys.readouterr().err


def test_auto_device_falls_back_to_cpu_with_one_warning(cnn_both, monkeypatch, caplog):
    monkeypatch.setattr(device_mod, "cuda_listed", lambda: True)  # claim CUDA; this build cannot open it
    X, y = make_data(np.random.default_rng(10), n=8)
    with caplog.at_level(logging.WARNING):
        runner = Runner.load(cnn_both, device="auto", threads=1, backend="portable")
        runner.adapt(X, y, epochs=2, batch_size=4, progress=False)
        # a rollback re-opens the backend on the device chosen first: no second warning
        with pytest.raises(NonFiniteLossError):
            runner.adapt(X, y, epochs=1, batch_size=4, lr=1e38, progress=False)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert runner.device == "cpu" and runner.backend == "portable"
    assert len(warnings) == 1 and "falling back to the CPU" in warnings[0].getMessage()
    with pytest.raises(DeviceUnavailableError, match="CUDA cannot run the training session"):
        Runner.load(cnn_both, device="cuda", backend="portable")


# ---- damaged files ----------------------------------------------------------------------
def test_every_damaged_portable_file_is_refused_naming_it(cnn_both):
    """benchmarks/fault_injection.py on the two-engine bundle: each portable file truncated,
    deleted or inflated, and random bytes of any file overwritten (checksums kept or recomputed),
    loaded with the engine that reads the damaged file (tests/reliability/test_fault_injection.py
    runs the same harness on onnxruntime-training bundles)."""
    fi = _fault_injection()
    files = read_manifest(cnn_both).files
    portable = {files[r] for r in PORTABLE_FILES}
    assert {n for n in portable if n.endswith(".onnx")} and {n for n in portable if n.endswith(".npz")}
    cases = [c for c in fi.make_cases({"cnn": cnn_both}, n_corrupt=6, seed=0)
             if c["kind"] in ("corrupt", "rehashed") or c["file"] in portable]
    assert {c["file"] for c in cases if c["kind"] == "delete"} == portable
    results = fi.run_cases({"cnn": cnn_both}, cases, timeout_s=120)
    bad = [(c["kind"], c["file"], r) for c, r in zip(cases, results)
           if r["outcome"] not in ("refused", "noop") and not (c["kind"] == "rehashed" and r["outcome"] in
                                                                 ("harmless", "trained"))]
    assert not bad, bad
    summary = fi.summarize(cases, results)
    assert summary["rehashed"].get("refused", 0) >= summary["rehashed"].get("trained", 0), summary


def _fault_injection():
    from helpers import load_benchmark

    return load_benchmark("fault_injection", register=True)


@pytest.mark.parametrize("backend", ["portable", "ort-training"])
def test_statistics_on_a_frozen_statistics_bundle_change_nothing_and_raise_nothing(cnn_both, backend):
    """A frozen-statistics bundle (the export's default) with labels: the portable engine computes
    no loss there, which is not a non-finite loss (it rolled back and blamed the learning rate)."""
    x, y = make_data(np.random.default_rng(3), n=8)
    runner = _load(cnn_both, backend=backend)
    before = runner.parameters()
    runner.update_bn_statistics(x, y, progress=False)
    runner.adapt(x, y, lr=0.0, epochs=1, batch_size=4, progress=False)
    after = runner.parameters()
    assert all(np.array_equal(before[k], after[k]) for k in before)
