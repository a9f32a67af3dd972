"""Runner behaviour: device choice and fallback, input validation, checksums, atomic save and
resume, non-finite losses."""

from __future__ import annotations

import json
import logging
import shutil

import numpy as np
import pytest
from helpers import make_data, run_python

from edgeadapt.bundle import BundleError
from edgeadapt.runtime import DeviceUnavailableError, InputError, NonFiniteLossError, NonFiniteUpdateError, Runner
from edgeadapt.runtime import device as device_mod


@pytest.fixture
def bundle(cnn_bundle, tmp_path):
    """A private copy of the session's CNN bundle (tests may modify it)."""
    dst = tmp_path / "bundle"
    shutil.copytree(cnn_bundle, dst)
    return dst


# ---- device ---------------------------------------------------------------------------
def test_cpu_device(bundle):
    assert Runner.load(bundle, device="cpu").device == "cpu"


def test_cuda_request_fails_clearly_when_cuda_cannot_run(bundle, monkeypatch):
    # On this CPU build the CUDA session cannot be created; claim the provider exists anyway.
    monkeypatch.setattr(device_mod, "cuda_listed", lambda: True)
    with pytest.raises(DeviceUnavailableError, match="CUDA cannot run the training session.*--device cpu"):
        Runner.load(bundle, device="cuda")


def test_auto_falls_back_to_cpu_with_one_warning(bundle, monkeypatch, caplog, rng):
    monkeypatch.setattr(device_mod, "cuda_listed", lambda: True)
    with caplog.at_level(logging.WARNING):
        runner = Runner.load(bundle, device="auto")
        X, y = make_data(rng, n=8)
        runner.adapt(X, y, epochs=2, batch_size=4, progress=False)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert runner.device == "cpu"
    assert len(warnings) == 1 and "falling back to the CPU" in warnings[0].getMessage()


def test_unknown_device(bundle):
    with pytest.raises(ValueError, match="device must be one of"):
        Runner.load(bundle, device="tpu")


# ---- bundle validation ----------------------------------------------------------------
def test_tampered_file_fails_checksum(bundle):
    with open(bundle / "eval_model.onnx", "ab") as f:
        f.write(b"\0")
    with pytest.raises(BundleError, match="eval_model.onnx has sha256"):
        Runner.load(bundle)


def test_missing_file_and_missing_manifest(bundle, tmp_path):
    (bundle / "masks.npz").unlink()
    with pytest.raises(BundleError, match="masks.npz is missing"):
        Runner.load(bundle)
    with pytest.raises(BundleError, match="manifest.json is missing"):
        Runner.load(tmp_path)


def test_malformed_manifest(bundle):
    m = json.loads((bundle / "manifest.json").read_text())
    m["loss"] = "hinge"
    m.pop("manifest_sha256")  # as a manifest written before manifests carried their digest
    (bundle / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(BundleError, match="manifest.json is invalid at loss"):
        Runner.load(bundle)


# ---- input validation -----------------------------------------------------------------
@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda X, y: (X.astype(np.float64), y), "dtype float64.*astype"),
        (lambda X, y: (X[:, :3], y), r"shape \[8, 3, 16\].*\['batch', 4, 16\]"),
        (lambda X, y: (X[..., None], y), "shape"),
        (lambda X, y: (np.where(X > 2, np.nan, X).astype(np.float32), y), "NaN or infinite"),
        (lambda X, y: (X, y[:5]), "5 entries but X has 8"),
        (lambda X, y: (X, y + 3), r"labels in \[3, 5\] but the model has 3 classes"),
        (lambda X, y: (X, y.astype(np.float32)), "integer class indices"),
        (lambda X, y: (X, None), "needs labels"),
    ],
    ids=["dtype", "channels", "rank", "nan", "length", "label-range", "label-dtype", "no-labels"],
)
def test_bad_inputs_are_refused_before_training(bundle, rng, mutate, match):
    runner = Runner.load(bundle, device="cpu")
    X, y = make_data(rng, n=8)
    before = runner.parameters()
    Xb, yb = mutate(X, y)
    with pytest.raises(InputError, match=match):
        runner.adapt(Xb, yb, progress=False)
    after = runner.parameters()
    assert all(np.array_equal(before[k], after[k]) for k in before)
    assert runner.step == 0


# ---- non-finite loss ------------------------------------------------------------------
def test_non_finite_update_rolls_back_to_epoch_start(bundle, rng):
    runner = Runner.load(bundle, device="cpu")
    X, y = make_data(rng, n=12)
    runner.adapt(X[:8], y[:8], epochs=1, batch_size=4, progress=False)
    good = runner.parameters()
    # A huge learning rate: the first step's loss is finite but its update overflows the
    # parameters; that update is caught at once (the next loss would be the first non-finite one).
    with pytest.raises(NonFiniteUpdateError, match="rolled back to step 2") as info:
        runner.adapt(X, y, epochs=1, batch_size=4, lr=1e38, shuffle=False, progress=False)
    assert info.value.step == 2 and np.isfinite(info.value.loss) and info.value.applied
    assert runner.step == 2
    state = runner.parameters()
    assert all(np.array_equal(state[k], good[k]) for k in good)
    # optimizer state was rolled back too: training resumes as if the failed call never happened
    twin = Runner.load(bundle, device="cpu")
    twin.adapt(X[:8], y[:8], epochs=1, batch_size=4, progress=False)
    assert runner.train_step(X[:4], y[:4]) == twin.train_step(X[:4], y[:4])
    a, b = runner.parameters(), twin.parameters()
    assert all(np.array_equal(a[k], b[k]) for k in a)


def test_single_step_with_non_finite_loss_applies_no_update(bundle, rng):
    runner = Runner.load(bundle, device="cpu")
    X, y = make_data(rng, n=4)
    with pytest.raises(NonFiniteUpdateError, match="the update was applied"):
        runner.train_step(X, y, lr=1e38)
    before = runner.parameters()
    with pytest.raises(NonFiniteLossError, match="update of that step was not applied"):
        runner.train_step(X, y)
    after = runner.parameters()
    assert all(np.array_equal(before[k], after[k], equal_nan=True) for k in before)


# ---- save / resume --------------------------------------------------------------------
def test_resume_continues_exactly(bundle, tmp_path, rng):
    X, y = make_data(rng, n=16)
    straight = Runner.load(bundle, device="cpu")
    for s in range(4):
        straight.train_step(X[4 * s:4 * s + 4], y[4 * s:4 * s + 4])

    first = Runner.load(bundle, device="cpu")
    for s in range(2):
        first.train_step(X[4 * s:4 * s + 4], y[4 * s:4 * s + 4])
    first.save(tmp_path / "adapted")
    resumed = Runner.load(tmp_path / "adapted", device="cpu")
    assert resumed.step == 2
    for s in range(2, 4):
        resumed.train_step(X[4 * s:4 * s + 4], y[4 * s:4 * s + 4])
    a, b = straight.parameters(), resumed.parameters()
    # optimizer moments and step count travel with the checkpoint: bit-identical continuation
    assert all(np.array_equal(a[k], b[k]) for k in a)


def test_save_in_place_and_refuse_foreign_directory(bundle, tmp_path, rng):
    X, y = make_data(rng, n=8)
    runner = Runner.load(bundle, device="cpu")
    runner.adapt(X, y, epochs=1, batch_size=4, progress=False)
    runner.save()  # in place
    files = sorted(p.name for p in bundle.iterdir())
    assert sum(n.startswith("checkpoint") for n in files) == 1, files
    assert Runner.load(bundle, device="cpu").step == 2
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not a bundle of the same model"):
        runner.save(tmp_path / "other")
    assert (tmp_path / "other" / "notes.txt").read_text() == "keep me"


KILL_DURING_SAVE = """
import os, signal, sys
import numpy as np
from edgeadapt import bundle as bundle_mod
from edgeadapt.runtime import Runner, runner as runner_mod
runner = Runner.load(sys.argv[1], device="cpu")
rng = np.random.default_rng(0)
X = rng.standard_normal((4, 4, 16)).astype(np.float32)
runner.train_step(X, np.array([0, 1, 2, 0]))
def die(*a, **k):  # the new checkpoint is on disk; die before the manifest switches to it
    os.kill(os.getpid(), signal.SIGKILL)
runner_mod.write_manifest = die
runner.save(sys.argv[1])
"""


def test_kill_during_save_leaves_previous_checkpoint_loadable(bundle, rng):
    X, y = make_data(rng, n=8)
    runner = Runner.load(bundle, device="cpu")
    runner.adapt(X, y, epochs=1, batch_size=4, progress=False)
    runner.save()
    saved = runner.parameters()
    code = KILL_DURING_SAVE.replace("sys.argv[1]", repr(str(bundle)))
    proc = run_python(code)
    assert proc.returncode == -9, proc.stderr[-2000:]
    reloaded = Runner.load(bundle, device="cpu")  # checksums verified on load
    assert reloaded.step == 2
    got = reloaded.parameters()
    assert all(np.array_equal(got[k], saved[k]) for k in saved)
    # the orphan checkpoint of the killed save is removed by the next save
    reloaded.save()
    assert sum(p.name.startswith("checkpoint") for p in bundle.iterdir()) == 1


def test_predict_and_evaluate_agree(bundle, rng):
    runner = Runner.load(bundle, device="cpu")
    X, y = make_data(rng, n=10)
    logits = runner.predict(X, batch_size=3)
    assert logits.shape == (10, 3)
    result = runner.evaluate(X, y, batch_size=4)
    assert result.accuracy == pytest.approx(float((logits.argmax(1) == y).mean()))
    assert result.n_windows == 10 and np.isfinite(result.loss)


@pytest.mark.parametrize("call, message", [
    (lambda r, X, y: r.predict(X, batch_size=0), "batch_size must be a positive int, got 0"),
    (lambda r, X, y: r.evaluate(X, y, batch_size=2.5), r"batch_size must be a positive int, got 2\.5 \(float\)"),
    (lambda r, X, y: r.adapt(X, y, epochs=1.5), r"epochs must be a positive int, got 1\.5 \(float\)"),
    (lambda r, X, y: r.adapt(X, y, epochs=True), r"epochs must be a positive int, got True \(bool\)"),
    (lambda r, X, y: r.adapt(X, y, batch_size=0), "batch_size must be a positive int, got 0"),
    (lambda r, X, y: r.adapt(X, y, seed=-1), "seed must be an int >= 0, got -1"),
    (lambda r, X, y: r.adapt(X, y, seed=0.5), r"seed must be an int >= 0, got 0\.5 \(float\)"),
    (lambda r, X, y: r.adapt(X, y, micro_batch=2.0), r"micro_batch must be a positive int, got 2\.0 \(float\)"),
    (lambda r, X, y: r.adapt(X, y, lr=0, epochs=0), "epochs must be a positive int, got 0"),  # bn-stats
    (lambda r, X, y: r.update_bn_statistics(X, batch_size=False), r"batch_size must be a positive int, got False"),
    (lambda r, X, y: r.train_step(X, y, micro_batch=0), "micro_batch must be a positive int, got 0"),
])
def test_bad_counts_are_refused_with_the_argument_named(bundle, rng, call, message):
    runner = Runner.load(bundle, device="cpu")
    X, y = make_data(rng, n=6)
    with pytest.raises(InputError, match=message):
        call(runner, X, y)
    assert runner.step == 0


def test_threads_must_be_a_count(bundle):
    with pytest.raises(InputError, match="threads must be an int >= 0, got -1"):
        Runner.load(bundle, device="cpu", threads=-1)
    assert Runner.load(bundle, device="cpu", threads=np.int64(1)).device == "cpu"


@pytest.mark.gpu
@pytest.mark.skipif(not device_mod.cuda_listed(), reason="needs an ONNX Runtime build with a CUDA provider")
def test_cuda_session_matches_cpu(bundle, rng):
    X, y = make_data(rng, n=8)
    try:
        gpu = Runner.load(bundle, device="cuda")
    except DeviceUnavailableError as e:  # CUDA provider built in, but no usable GPU/libraries here
        pytest.skip(str(e))
    cpu = Runner.load(bundle, device="cpu")
    assert gpu.device == "cuda"
    for runner in (cpu, gpu):
        runner.adapt(X, y, epochs=2, batch_size=4, shuffle=False, progress=False)
    a, b = cpu.parameters(), gpu.parameters()
    assert all(np.allclose(a[k], b[k], atol=1e-5) for k in a)
