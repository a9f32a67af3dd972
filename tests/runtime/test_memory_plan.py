"""The runner carries a memory plan out without changing results: lazy training session,
micro-batched gradient accumulation, rollback without a per-epoch checkpoint, forward-only
BatchNorm statistics, measured peaks."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import make_cnn, make_data

from edgeadapt.runtime import NonFiniteLossError, Runner

# Micro-batching changes only the order of float additions in the gradient (sums of per-slice
# means, then one rescale), so parameters after a step agree to float32 rounding. Tolerances:
# gradients to 1e-6 relative to their scale; parameters after a step to 1e-6 absolute for SGD
# (the update is lr * gradient) and 2e-6 for AdamW (whose first step is ~lr * sign(g), which
# amplifies rounding only where |g| is within a few eps of 0).
GRAD_RTOL = 1e-6
PARAM_ATOL = {"sgd": 1e-6, "adamw": 2e-6}


def _export(tmp_path_factory, name: str, **kwargs):
    import torch

    from edgeadapt.export import Rule, UpdatePolicy, export_bundle

    out = tmp_path_factory.mktemp("bundles") / name
    policy = UpdatePolicy(rules=(Rule("head", "full"), Rule("conv2", "channels", ratio=0.5), Rule("bn2", "full")))
    export_bundle(make_cnn(), torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(0)), out,
                  policy=policy, **kwargs)
    return out


@pytest.fixture(scope="module")
def sgd_bundle(tmp_path_factory):
    from edgeadapt.export import OptimizerConfig

    return _export(tmp_path_factory, "sgd", optimizer=OptimizerConfig("sgd", lr=0.05, weight_decay=0.0))


@pytest.fixture(scope="module")
def batch_bn_bundle(tmp_path_factory):
    """Label-free, batch-statistics BatchNorm, the head trains: the bn-stats recipe."""
    from edgeadapt.export import Rule, UpdatePolicy, export_bundle
    import torch

    out = tmp_path_factory.mktemp("bundles") / "bnstats"
    export_bundle(make_cnn(), torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(0)), out,
                  policy=UpdatePolicy(rules=(Rule("head", "full"),)), loss="entropy", batchnorm="batch")
    return out


@pytest.fixture
def bundles(cnn_bundle, sgd_bundle):
    return {"adamw": cnn_bundle, "sgd": sgd_bundle}


def _tensors(runner: Runner) -> dict[str, np.ndarray]:
    """Every graph tensor of the checkpoint (parameters and BatchNorm running statistics)."""
    return {n: runner._backend.get_tensor(n) for n in runner._backend.parameter_names()}


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


# ---- lazy training session --------------------------------------------------------------
def test_training_session_opens_on_the_first_step_only(cnn_bundle, rng, tmp_path):
    X, y = make_data(rng, n=8)
    runner = Runner.load(cnn_bundle, device="cpu")
    before = runner.parameters()
    logits = runner.predict(X)
    result = runner.evaluate(X, y)
    assert not runner._backend.training_open
    # parameters and save work with no step run; the saved bundle loads and predicts the same
    saved = Runner.load(runner.save(tmp_path / "copy"), device="cpu")
    assert _equal(saved.parameters(), before)
    np.testing.assert_array_equal(saved.predict(X), logits)
    runner.adapt(X, y, epochs=1, batch_size=4, progress=False)
    assert runner._backend.training_open
    # the eval path before and after the session opened is the same graph: an unchanged
    # runner (lr so small nothing moves is not available, so compare with a fresh twin)
    twin = Runner.load(cnn_bundle, device="cpu")
    twin._backend.open_training()
    np.testing.assert_array_equal(twin.predict(X), logits)
    assert twin.evaluate(X, y).loss == result.loss


def test_exported_inference_model_matches_predict(cnn_bundle, rng, tmp_path):
    from edgeadapt.runtime.ort_import import import_onnxruntime

    ort = import_onnxruntime()
    X, y = make_data(rng, n=6)
    runner = Runner.load(cnn_bundle, device="cpu")
    runner.adapt(X, y, epochs=1, batch_size=3, progress=False)
    path = runner.export_inference(tmp_path / "model.onnx")
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == ["input"]
    np.testing.assert_allclose(session.run(["output"], {"input": X})[0], runner.predict(X), atol=1e-6)


# ---- micro-batching ---------------------------------------------------------------------
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("micro", [1, 4, 5])  # 10 windows: slices of 1, of 4-4-2 (rescaled), of 5-5
def test_micro_batched_step_equals_whole_batch_step(bundles, optimizer, micro, rng):
    X, y = make_data(rng, n=10)
    whole = Runner.load(bundles[optimizer], device="cpu")
    parts = Runner.load(bundles[optimizer], device="cpu")
    before = whole.parameters(trainable_only=True)
    for s in range(2):
        loss_whole = whole.train_step(X, y)
        loss_parts = parts.train_step(X, y, micro_batch=micro)
        assert loss_parts == pytest.approx(loss_whole, rel=1e-6)
    a, b = whole.parameters(trainable_only=True), parts.parameters(trainable_only=True)
    for k in a:
        assert not np.array_equal(a[k], before[k]), k  # the step moved it
        np.testing.assert_allclose(b[k], a[k], rtol=0, atol=PARAM_ATOL[optimizer], err_msg=k)


def test_accumulated_gradient_equals_whole_batch_gradient(cnn_bundle, rng):
    # The proof behind the parity above, on the gradients themselves: the kept gradient after
    # the weighted accumulation of slices 4-4-2 equals the whole batch's mean-loss gradient.
    X, y = make_data(rng, n=10)
    runner = Runner.load(cnn_bundle, device="cpu")
    backend = runner._backend
    names = backend.parameter_names(trainable_only=True)
    backend.train_step(X, y)
    whole = {n: backend.get_gradient(n) for n in names}
    backend.discard_gradients()
    for part, prev, w in ((slice(0, 4), None, 0.4), (slice(4, 8), 0.4, 0.4), (slice(8, 10), 0.4, 0.2)):
        if prev is not None and prev != w:
            backend.scale_gradients(prev / w)
        backend.train_step(X[part], y[part])
    backend.scale_gradients(0.2)
    for n in names:
        got = backend.get_gradient(n)
        scale = float(np.abs(whole[n]).max())
        assert scale > 0, n
        np.testing.assert_allclose(got, whole[n], rtol=0, atol=GRAD_RTOL * scale, err_msg=n)


def test_adapt_micro_batch_keeps_results(cnn_bundle, rng):
    X, y = make_data(rng, n=12)
    plain, micro = Runner.load(cnn_bundle, device="cpu"), Runner.load(cnn_bundle, device="cpu")
    r1 = plain.adapt(X, y, epochs=2, batch_size=6, progress=False)
    r2 = micro.adapt(X, y, epochs=2, batch_size=6, micro_batch=2, progress=False)
    assert r1.steps == r2.steps == 4
    np.testing.assert_allclose(r2.epoch_losses, r1.epoch_losses, rtol=1e-5)
    a, b = plain.parameters(), micro.parameters()
    for k in a:
        np.testing.assert_allclose(b[k], a[k], rtol=0, atol=1e-5, err_msg=k)


def test_batch_statistics_bundle_refuses_micro_batches(batch_bn_bundle, rng):
    X, _ = make_data(rng, n=8)
    runner = Runner.load(batch_bn_bundle, device="cpu")
    with pytest.raises(ValueError, match="micro_batch=2 is smaller than the batch .*batch statistics"):
        runner.adapt(X, epochs=1, batch_size=8, micro_batch=2, progress=False)
    runner.adapt(X, epochs=1, batch_size=8, micro_batch=8, progress=False)  # whole batch: fine


@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_bad_micro_batch(cnn_bundle, rng, bad):
    X, y = make_data(rng, n=4)
    with pytest.raises(ValueError, match="micro_batch must be a positive int"):
        Runner.load(cnn_bundle, device="cpu").adapt(X, y, micro_batch=bad, progress=False)


# ---- rollback without a per-epoch checkpoint ----------------------------------------------
def test_rollback_writes_no_checkpoint_and_restores_a_later_epoch(cnn_bundle, rng, monkeypatch):
    X, y = make_data(rng, n=8)
    runner = Runner.load(cnn_bundle, device="cpu")
    writes = []
    real = runner._backend.save_checkpoint
    monkeypatch.setattr(runner._backend, "save_checkpoint", lambda p: (writes.append(p), real(p)))
    # A non-finite loss in the third epoch: the first two are replayed from the bundle's file.
    poisoned = X.copy()
    calls = {"n": 0}
    step = runner._step

    def step_with_nan_in_epoch_3(x, yy, lr, micro):
        calls["n"] += 1
        if calls["n"] == 5:  # 2 steps per epoch: the first step of epoch 3
            x = np.full_like(x, np.nan)
        return step(x, yy, lr, micro)

    monkeypatch.setattr(runner, "_step", step_with_nan_in_epoch_3)
    with pytest.raises(NonFiniteLossError, match="rolled back to step 4"):
        runner.adapt(poisoned, y, epochs=3, batch_size=4, progress=False)
    assert writes == []  # no checkpoint written: the runner was unchanged since load
    assert runner.step == 4 and runner.epoch == 2
    twin = Runner.load(cnn_bundle, device="cpu")
    twin.adapt(X, y, epochs=2, batch_size=4, progress=False)
    assert _equal(runner.parameters(), twin.parameters())
    # optimizer state too: the next steps agree bit for bit
    monkeypatch.undo()
    assert runner.train_step(X[:4], y[:4]) == twin.train_step(X[:4], y[:4])
    assert _equal(runner.parameters(), twin.parameters())


def test_rollback_of_a_changed_runner_snapshots_once_per_call(cnn_bundle, rng, monkeypatch):
    X, y = make_data(rng, n=8)
    runner = Runner.load(cnn_bundle, device="cpu")
    runner.train_step(X[:4], y[:4])  # changed since load: no file holds this state
    writes = []
    real = runner._backend.save_checkpoint
    monkeypatch.setattr(runner._backend, "save_checkpoint", lambda p: (writes.append(p), real(p)))
    runner.adapt(X, y, epochs=3, batch_size=4, progress=False)
    assert len(writes) == 1  # at the call's start, not per epoch


# ---- bn-stats: forward only ---------------------------------------------------------------
def test_bn_statistics_forward_only_equal_the_training_step_way(batch_bn_bundle, rng):
    X, _ = make_data(rng, n=12)
    # the way bn-stats ran before: full training steps at learning rate 0
    old = Runner.load(batch_bn_bundle, device="cpu")
    old._backend.open_training()
    for epoch in range(2):
        order = np.random.default_rng(epoch).permutation(12)
        for b in range(3):
            idx = order[4 * b:4 * b + 4]
            old._backend.train_step(X[idx], None)
            old._backend.apply_update(0.0)
    new = Runner.load(batch_bn_bundle, device="cpu")
    before = _tensors(new)
    result = new.adapt(X, None, epochs=2, batch_size=4, lr=0, progress=False)
    assert not new._backend.training_open  # no gradients, no optimizer state
    assert result.steps == 6 and new.step == 6 and len(result.epoch_losses) == 2
    after = _tensors(new)
    assert _equal(after, _tensors(old))  # bit-identical statistics and parameters
    changed = [k for k in after if not np.array_equal(after[k], before[k])]
    assert changed and all(k.endswith(("running_mean", "running_var")) for k in changed), changed


def test_bn_statistics_roll_back_on_a_non_finite_batch(batch_bn_bundle, rng):
    X, _ = make_data(rng, n=8)
    runner = Runner.load(batch_bn_bundle, device="cpu")
    before = _tensors(runner)
    X[5] = 1e19  # accepted as input (its square is a float32), but the second batch's statistics overflow
    with pytest.raises(NonFiniteLossError):
        runner.update_bn_statistics(X, epochs=1, batch_size=4, shuffle=False, progress=False)
    assert _equal(_tensors(runner), before) and runner.step == 0


# ---- measured memory ------------------------------------------------------------------
def test_adapt_reports_step_and_call_peaks(cnn_bundle, rng):
    X, y = make_data(rng, n=8)
    result = Runner.load(cnn_bundle, device="cpu").adapt(X, y, epochs=1, batch_size=4, progress=False)
    for name in ("step_peak_bytes", "step_peak_anon_bytes", "call_peak_bytes", "call_peak_anon_bytes"):
        assert isinstance(getattr(result, name), int), name
    # a step lies inside the call, and the first call opens the training session (> 0 bytes)
    assert 0 < result.step_peak_bytes <= result.call_peak_bytes
    assert result.step_peak_anon_bytes <= result.call_peak_anon_bytes
