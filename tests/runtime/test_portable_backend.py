"""The portable backend (plain onnxruntime sessions over a bundle's step graphs), tested on a
hand-built portable bundle (tests/portable_linear.py: Linear(4 -> 3), cross-entropy,
AdamW) against a float64 numpy AdamW, and through the Runner: adapt, rollback, micro-batches,
save/reload, export-inference, backend choice and the refusals of bad input."""

from __future__ import annotations

import json
import math

import numpy as np
import onnx
import pytest
from helpers import run_python
from portable_linear import B, BETAS, LR, N_IN, N_OUT, W, initial_parameters, reference_steps, write_bundle

from edgeadapt.bundle import BundleError, read_manifest, sha256_file, write_manifest
from edgeadapt.runtime import NonFiniteLossError, Runner
from edgeadapt.runtime import engines
from edgeadapt.runtime.engines import BackendUnavailableError
from edgeadapt.runtime.portable import PortableBackend, check_opset_supported

F32_EPS = 2.0 ** -24


@pytest.fixture
def bundle(tmp_path):
    return write_bundle(tmp_path / "linear")


def _batches(rng, n_steps: int, n: int = 8):
    return [(rng.normal(size=(n, N_IN)).astype(np.float32), rng.integers(0, N_OUT, n)) for _ in range(n_steps)]


def _adamw_tolerance(steps: int, reduction: int) -> float:
    """Bound on |float32 - float64| of a parameter after ``steps`` AdamW steps of size ``LR``.

    Each update is ``step_size * m / (sqrt(v)/c2 + eps)``, of magnitude <= LR / (1 - beta1) at
    worst; its float32 relative error is a few ulp per op (~12 ops) plus the gradient's, which
    sums ``reduction`` products (error ~ reduction ulp relative). Per step: LR * (12 + reduction)
    ulp, times 10 for the amplification of m/sqrt(v) when successive gradients partly cancel;
    plus the rounding of the parameter itself (|p| < 4 here) each step.
    """
    return steps * (LR / (1 - BETAS[0]) * (12 + reduction) * 10 * F32_EPS + 4 * F32_EPS)


def test_ten_steps_match_float64_adamw(bundle, rng):
    backend = PortableBackend(bundle, read_manifest(bundle), device="cpu", threads=1)
    start = {n: backend.get_tensor(n) for n in backend.parameter_names()}
    batches = _batches(rng, 10)
    for x, y in batches:
        loss, out = backend.train_step(x, y)
        assert out.shape == (len(x), N_OUT) and math.isfinite(loss)
        backend.apply_update(LR)
    want = reference_steps(start, batches)
    tol = _adamw_tolerance(10, reduction=8)
    for n in (W, B):
        np.testing.assert_allclose(backend.get_tensor(n), want[n], rtol=0, atol=tol)
    assert backend.state_arrays()["step"] == 10
    assert backend.parameter_names(trainable_only=True) == [W, B]


def test_gradient_is_the_mean_loss_gradient_and_accumulates(bundle, rng):
    backend = PortableBackend(bundle, read_manifest(bundle), device="cpu", threads=1)
    (x, y), = _batches(rng, 1, n=6)
    p = {k: v.astype(np.float64) for k, v in initial_parameters().items()}
    logits = x.astype(np.float64) @ p[W].T + p[B]
    e = np.exp(logits - logits.max(1, keepdims=True))
    dl = (e / e.sum(1, keepdims=True) - np.eye(N_OUT)[y]) / len(x)
    backend.train_step(x, y)
    # 6-term sums in float32: a few ulp of the largest term (|dl * x| < 1 here)
    np.testing.assert_allclose(backend.get_gradient(W), dl.T @ x, rtol=0, atol=16 * F32_EPS)
    # a second micro-batch adds into the kept gradient; scale_gradients multiplies in place
    backend.train_step(x, y)
    backend.scale_gradients(0.5)
    np.testing.assert_allclose(backend.get_gradient(W), dl.T @ x, rtol=0, atol=32 * F32_EPS)
    backend.discard_gradients()
    assert not backend.get_gradient(W).any() and not backend.get_gradient(B).any()


def test_micro_batches_equal_the_whole_batch_step(bundle, rng):
    whole, split = Runner.load(bundle, device="cpu", threads=1), Runner.load(bundle, device="cpu", threads=1)
    (x, y), = _batches(rng, 1, n=10)
    assert whole.train_step(x, y) == pytest.approx(split.train_step(x, y, micro_batch=3), abs=1e-6)
    a, b = whole.parameters(), split.parameters()
    # AdamW's first step is lr * sign(g) up to eps: micro-batch sums differ in the last ulp only
    for k in a:
        np.testing.assert_allclose(a[k], b[k], rtol=0, atol=_adamw_tolerance(1, reduction=10))


def test_adapt_save_reload_resumes_bit_identical(bundle, tmp_path, rng):
    X = rng.normal(size=(24, N_IN)).astype(np.float32)
    y = rng.integers(0, N_OUT, 24)
    straight = Runner.load(bundle, device="cpu", threads=1)
    assert straight.backend == "portable"
    straight.adapt(X, y, epochs=2, batch_size=8, progress=False)
    first = Runner.load(bundle, device="cpu", threads=1)
    first.adapt(X, y, epochs=1, batch_size=8, progress=False)
    saved = first.save(tmp_path / "saved")
    names = sorted(p.name for p in saved.iterdir())
    assert [n for n in names if n.startswith("portable_state")] == [read_manifest(saved).files["portable_state"]]
    resumed = Runner.load(saved, device="cpu", threads=1)
    assert (resumed.step, resumed.epoch) == (3, 1)
    resumed.adapt(X, y, epochs=1, batch_size=8, progress=False)
    a, b = straight.parameters(), resumed.parameters()
    assert all(np.array_equal(a[k], b[k]) for k in a)
    # in place: the new state file replaces the old one
    resumed.save()
    states = [p.name for p in saved.iterdir() if p.name.startswith("portable_state")]
    assert states == [read_manifest(saved).files["portable_state"]]
    assert Runner.load(saved, device="cpu").step == 6


def test_non_finite_loss_rolls_back_parameters_and_optimizer_state(bundle, rng):
    X = rng.normal(size=(16, N_IN)).astype(np.float32)
    y = rng.integers(0, N_OUT, 16)
    runner = Runner.load(bundle, device="cpu", threads=1)
    runner.adapt(X[:8], y[:8], epochs=1, batch_size=4, progress=False)
    good = runner.parameters()
    with pytest.raises(NonFiniteLossError, match="rolled back to step 2"):
        runner.adapt(X, y, epochs=1, batch_size=4, lr=1e38, shuffle=False, progress=False)
    assert runner.step == 2
    after = runner.parameters()
    assert all(np.array_equal(after[k], good[k]) for k in good)
    twin = Runner.load(bundle, device="cpu", threads=1)
    twin.adapt(X[:8], y[:8], epochs=1, batch_size=4, progress=False)
    assert runner.train_step(X[:4], y[:4]) == twin.train_step(X[:4], y[:4])
    a, b = runner.parameters(), twin.parameters()
    assert all(np.array_equal(a[k], b[k]) for k in a)


def test_frozen_tensors_stay_bit_identical(tmp_path, rng):
    bundle = write_bundle(tmp_path / "bias_only", train_weight=False)
    runner = Runner.load(bundle, device="cpu", threads=1)
    before = runner.parameters()
    X = rng.normal(size=(16, N_IN)).astype(np.float32)
    runner.adapt(X, rng.integers(0, N_OUT, 16), epochs=2, batch_size=4, progress=False)
    after = runner.parameters()
    assert np.array_equal(after["fc.weight"], before["fc.weight"])
    assert not np.array_equal(after["fc.bias"], before["fc.bias"])
    assert list(runner.parameters(trainable_only=True)) == ["fc.bias"]


def test_export_inference_matches_predict(bundle, tmp_path, rng):
    from edgeadapt.runtime.ort_import import import_onnxruntime

    runner = Runner.load(bundle, device="cpu", threads=1)
    X = rng.normal(size=(12, N_IN)).astype(np.float32)
    runner.adapt(X, rng.integers(0, N_OUT, 12), epochs=1, batch_size=4, progress=False)
    path = runner.export_inference(tmp_path / "model.onnx")
    model = onnx.load(path)
    onnx.checker.check_model(model, full_check=True)
    assert [i.name for i in model.graph.input] == ["input"] and [o.name for o in model.graph.output] == ["logits"]
    ort = import_onnxruntime()
    (out,) = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"input": X})
    assert np.array_equal(out, runner.predict(X))


def test_runs_without_onnxruntime_training_or_torch(bundle, tmp_path):
    code = f"""
        import sys, numpy as np
        from edgeadapt.runtime import Runner
        r = Runner.load({str(bundle)!r}, device="cpu", threads=1)
        rng = np.random.default_rng(0)
        X = rng.normal(size=(8, {N_IN})).astype(np.float32)
        r.adapt(X, rng.integers(0, {N_OUT}, 8), epochs=1, batch_size=4, progress=False)
        r.save({str(tmp_path / "out")!r})
        r.export_inference({str(tmp_path / "m.onnx")!r})
        print(r.backend, sorted(m for m in sys.modules if m.startswith(("onnxruntime.training", "torch"))))
    """
    proc = run_python(code, block_torch=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split()[-2:] == ["portable", "[]"], proc.stdout


# ---- backend choice and bad input -------------------------------------------------------
def test_a_backend_the_bundle_does_not_hold_is_refused(bundle):
    with pytest.raises(BundleError, match="holds no ort-training graphs"):
        Runner.load(bundle, device="cpu", backend="ort-training")
    with pytest.raises(ValueError, match="backend must be one of"):
        Runner.load(bundle, device="cpu", backend="tensorrt")


@pytest.mark.parametrize(("held", "extra"), [("portable", 'pip install ".[device]" in an edgeadapt checkout'),
                                             ("ort-training", 'pip install ".[device-ort-training]"')])
def test_an_engine_that_is_not_installed_names_its_extra(monkeypatch, held, extra):
    class _Held:
        plan = None

        def has_backend(self, b):
            return b == held

    monkeypatch.setattr(engines, "backend_installed", lambda b: False)
    with pytest.raises(BackendUnavailableError) as info:
        engines.choose_backend(_Held(), "auto", "b/")
    message = str(info.value)
    assert extra in message and "\n" not in message


@pytest.mark.parametrize(("budget_bytes", "chosen"), [(None, "portable"), (600 * 1024, "ort-training")])
def test_auto_runs_a_budgeted_bundle_on_the_engine_its_budget_was_verified_for(monkeypatch, budget_bytes, chosen):
    class _Both:
        plan = {"budget_bytes": budget_bytes}

        def has_backend(self, b):
            return True

    monkeypatch.setattr(engines, "backend_installed", lambda b: True)
    assert engines.choose_backend(_Both(), "auto") == chosen
    assert engines.choose_backend(_Both(), "portable") == "portable"
    monkeypatch.setattr(engines, "backend_installed", lambda b: b == "portable")  # e.g. an aarch64 device
    assert engines.choose_backend(_Both(), "auto") == "portable"


def test_onnxruntime_too_old_for_the_opset_names_the_version(bundle, monkeypatch):
    with pytest.raises(BundleError,
                       match=r'opset 18, which needs onnxruntime >= 1\.14.*pip install -U "onnxruntime>=1\.14"'):
        check_opset_supported(18, "1.13.1")
    check_opset_supported(18, "1.14.0")
    check_opset_supported(21, "1.31.1")
    from edgeadapt.runtime.ort_import import import_onnxruntime

    monkeypatch.setattr(import_onnxruntime(), "__version__", "1.12.0")
    with pytest.raises(BundleError, match=r"needs onnxruntime >= 1\.14"):
        Runner.load(bundle, device="cpu")


def _edit_graph(bundle, role, edit):
    m = read_manifest(bundle)
    path = bundle / m.files[role]
    model = onnx.load(path)
    edit(model)
    onnx.save(model, path)
    # re-checksum, as a careful hand edit would: the interface check must still refuse it
    from dataclasses import replace

    write_manifest(bundle, replace(m, sha256={**m.sha256, m.files[role]: sha256_file(path)}))


def _swap_first_inputs(model):
    a, b = model.graph.input[0], model.graph.input[1]
    a2, b2 = onnx.ValueInfoProto(), onnx.ValueInfoProto()
    a2.CopyFrom(b), b2.CopyFrom(a)
    model.graph.input[0].CopyFrom(a2), model.graph.input[1].CopyFrom(b2)


def _widen_weight(model):
    model.graph.input[0].type.tensor_type.shape.dim[1].dim_value = N_IN + 1


def _drop_bias_grad(model):
    del model.graph.output[3]


@pytest.mark.parametrize(("role", "edit", "match"), [
    ("portable_train", _swap_first_inputs, "the list of graph inputs"),
    ("portable_eval", _widen_weight, r"the shape of param:fc\.weight"),
    ("portable_optimizer", _swap_first_inputs, "the list of graph inputs"),
    ("portable_train", _drop_bias_grad, "the list of graph outputs"),
])
def test_edited_graphs_are_refused_at_load(bundle, role, edit, match):
    _edit_graph(bundle, role, edit)
    with pytest.raises(BundleError, match=match):
        Runner.load(bundle, device="cpu")


def test_a_role_map_that_misses_a_parameter_is_refused(bundle):
    m = read_manifest(bundle)
    d = json.loads((bundle / "manifest.json").read_text())
    train = d["portable"]["graphs"]["portable_train"]
    train["inputs"][0][0] = "param:other.weight"
    from dataclasses import replace

    write_manifest(bundle, replace(m, portable=d["portable"]))
    with pytest.raises(BundleError, match=r"no input for the parameter tensor 'fc\.weight'"):
        Runner.load(bundle, device="cpu")


def test_state_of_the_wrong_shape_is_refused_at_load(bundle):
    m = read_manifest(bundle)
    state = dict(np.load(bundle / m.files["portable_state"]))
    state[W] = np.zeros((N_OUT, N_IN + 1), np.float32)
    with open(bundle / m.files["portable_state"], "wb") as f:
        np.savez(f, **state)
    from dataclasses import replace

    write_manifest(bundle, replace(m, sha256={**m.sha256, m.files["portable_state"]:
                                              sha256_file(bundle / m.files["portable_state"])}))
    with pytest.raises(BundleError, match=r"tensor 'fc\.weight' has shape \[3, 5\]"):
        Runner.load(bundle, device="cpu")


def test_save_refuses_non_finite_state(bundle, tmp_path):
    backend = PortableBackend(bundle, read_manifest(bundle), device="cpu", threads=1)
    backend.set_tensor(B, np.array([0.0, np.nan, 0.0], np.float32))
    with pytest.raises(ValueError, match="NaN or infinite"):
        backend.save_checkpoint(tmp_path / "state.npz")
    assert not (tmp_path / "state.npz").exists()


def test_cli_backend_option(bundle, tmp_path, capsys):
    from edgeadapt.cli import main

    assert main(["export-inference", str(bundle), str(tmp_path / "m.onnx"), "--backend", "portable"]) == 0
    assert main(["export-inference", str(bundle), str(tmp_path / "n.onnx"), "--backend", "ort-training"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "holds no ort-training graphs" in err
