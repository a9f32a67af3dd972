"""Ctrl-C during ``adapt``: the step in progress completes, the runner goes back to the end of the
last completed epoch (parameters and optimizer state), which ``--out`` receives; one line, exit 130."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest
from helpers import make_data, run_python, sigint_at_train_step

from edgeadapt.bundle import sha256_file
from edgeadapt.cli import main
from edgeadapt.runtime import AdaptInterrupted, Runner

N, BATCH = 24, 8  # 3 steps per epoch
ARGS = ["--batch-size", str(BATCH), "--no-progress", "--device", "cpu", "--threads", "1"]

# Runs the CLI with Ctrl-C (a real SIGINT to this process) arriving during training call SIGINT_AT
# of ONNX Runtime's training step, i.e. in the middle of a step.
_CLI_WITH_CTRL_C = """
import os, signal, sys
from edgeadapt.runtime import backend
from edgeadapt.cli import main
real, calls = backend.OrtTrainingBackend.train_step, []
def train_step(self, x, y):
    calls.append(1)
    if len(calls) == {at}:
        os.kill(os.getpid(), signal.SIGINT)
    return real(self, x, y)
backend.OrtTrainingBackend.train_step = train_step
sys.exit(main({argv!r}))
"""


@pytest.fixture
def data(tmp_path):
    X, y = make_data(np.random.default_rng(0), n=N)
    np.savez(tmp_path / "d.npz", X=X.transpose(0, 2, 1), y=y, subject=np.ones(N, np.int64))
    return tmp_path / "d.npz"


def _parameters(bundle):
    return Runner.load(bundle, device="cpu").parameters()


def _files(bundle):
    return {p.name: sha256_file(p) for p in sorted(bundle.iterdir()) if p.is_file()}


@pytest.mark.parametrize("in_place", [False, True], ids=["new folder", "same bundle"])
def test_ctrl_c_keeps_the_last_completed_epoch_and_exits_130(cnn_bundle, tmp_path, data, in_place):
    src = tmp_path / "src"
    shutil.copytree(cnn_bundle, src)
    out = src if in_place else tmp_path / "out"
    argv = ["adapt", str(src), "--data", str(data), "--out", str(out), "--epochs", "5", *ARGS]
    proc = run_python(_CLI_WITH_CTRL_C.format(at=2 * 3 + 2, argv=argv))  # during epoch 3's second step
    assert proc.returncode == 130, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines == [f"interrupted: saved epoch 2 (step 6), the last completed one, to {out}"], proc.stderr
    # exactly the state of two uninterrupted epochs, optimizer state included
    twin = tmp_path / "twin"
    assert main(["adapt", str(cnn_bundle), "--data", str(data), "--out", str(twin), "--epochs", "2", *ARGS]) == 0
    saved = Runner.load(out, device="cpu")
    assert (saved.step, saved.epoch) == (6, 2)
    a, b = saved.parameters(), _parameters(twin)
    assert all(np.array_equal(a[k], b[k]) for k in b)
    X, y = make_data(np.random.default_rng(0), n=N)
    resumed = Runner.load(twin, device="cpu")
    assert saved.train_step(X[:BATCH], y[:BATCH]) == resumed.train_step(X[:BATCH], y[:BATCH])
    a, b = saved.parameters(), resumed.parameters()
    assert all(np.array_equal(a[k], b[k]) for k in b)


def test_ctrl_c_in_the_first_epoch_saves_nothing(cnn_bundle, tmp_path, data):
    src = tmp_path / "src"
    shutil.copytree(cnn_bundle, src)
    before = _files(src)
    argv = ["adapt", str(src), "--data", str(data), "--out", str(src), "--epochs", "5", *ARGS]
    proc = run_python(_CLI_WITH_CTRL_C.format(at=2, argv=argv))
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr.strip().splitlines() == ["interrupted before the first epoch ended; nothing saved"]
    assert _files(src) == before


def test_ctrl_c_from_outside_stops_a_long_adapt_at_an_epoch_boundary(cnn_bundle, tmp_path, data):
    out = tmp_path / "out"
    argv = ["adapt", str(cnn_bundle), "--data", str(data), "--out", str(out), "--epochs", "100000", *ARGS]
    code = ("import logging, sys; from edgeadapt.cli import main; sys.exit(main(['-v'] + {argv!r}))"
            .format(argv=argv))
    proc = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stderr:  # -v logs each epoch's end
            if "epoch 2: mean loss" in line:
                proc.send_signal(signal.SIGINT)
                break
        rest = proc.stderr.read()
        assert proc.wait(timeout=300) == 130, rest
    finally:
        proc.kill()
    saved = Runner.load(out, device="cpu")
    assert saved.epoch >= 2 and saved.step == 3 * saved.epoch
    assert rest.strip().splitlines()[-1].startswith(f"interrupted: saved epoch {saved.epoch} (step {saved.step})")


def test_ctrl_c_from_python_raises_adapt_interrupted_at_the_epoch_start(cnn_bundle, monkeypatch):
    X, y = make_data(np.random.default_rng(0), n=N)
    runner = Runner.load(cnn_bundle, device="cpu")
    twin = Runner.load(cnn_bundle, device="cpu")
    twin.adapt(X, y, epochs=1, batch_size=BATCH, progress=False)
    before = signal.getsignal(signal.SIGINT)  # SIG_IGN where the shell started the tests in the background
    sigint_at_train_step(monkeypatch, runner, 5)
    with pytest.raises(KeyboardInterrupt, match="end of epoch 1 .step 3.") as e:
        runner.adapt(X, y, epochs=3, batch_size=BATCH, progress=False)
    assert isinstance(e.value, AdaptInterrupted) and e.value.epochs_done == 1 and (runner.step, runner.epoch) == (3, 1)
    a, b = runner.parameters(), twin.parameters()
    assert all(np.array_equal(a[k], b[k]) for k in b)
    assert signal.getsignal(signal.SIGINT) is before  # handler restored
