"""The device side never imports torch — where torch cannot be imported, and where it is installed.

``import onnxruntime`` alone imports torch when torch is installed (its package ``__init__``
reaches ``onnxruntime.training``), so the installed-torch tests run in fresh interpreters WITHOUT
the torch blocker and check ``sys.modules`` at the end of a real adapt, from Python and from the
CLI. The exporter and the runner also share one process in either import order.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import numpy as np
import pytest
from helpers import REPO, run_python

DEVICE_JOB = """
import json, sys
import numpy as np
from edgeadapt.runtime import Runner
import onnxruntime as ort
rng = np.random.default_rng(0)
X = rng.standard_normal((16, 4, 16)).astype(np.float32)
y = rng.integers(0, 3, 16)
runner = Runner.load(BUNDLE, device="auto")
before = runner.evaluate(X, y)
result = runner.adapt(X, y, epochs=3, batch_size=4, lr=1e-2, progress=False)
after = runner.evaluate(X, y)
runner.save(OUT + "/adapted")
path = runner.export_inference(OUT + "/model.onnx")
session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
same = float(np.abs(session.run(None, {"input": X})[0] - runner.predict(X)).max())
print(json.dumps({"torch_loaded": any(m == "torch" or m.startswith("torch.") for m in sys.modules),
                  "ort_training_loaded": any(m.startswith("onnxruntime.training") for m in sys.modules),
                  "before": before.loss, "after": after.loss, "steps": result.steps, "max_diff": same}))
"""

torch_installed = pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                                     reason="checks a process where torch is installed")


def _report(proc) -> dict:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("block_torch", [True, False], ids=["torch-blocked", "torch-installed"])
def test_device_job_never_imports_torch(cnn_bundle, tmp_path, block_torch):
    if block_torch:
        probe = run_python("import torch", block_torch=True)
        assert probe.returncode != 0 and "torch is blocked" in probe.stderr
    elif importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed: the blocked variant covers this environment")
    code = DEVICE_JOB.replace("BUNDLE", repr(str(cnn_bundle))).replace("OUT", repr(str(tmp_path)))
    report = _report(run_python(code, block_torch=block_torch))
    assert report["torch_loaded"] is False
    assert report["ort_training_loaded"] is False  # the torch-importing half of onnxruntime stays unloaded
    assert report["steps"] == 12
    assert report["after"] < report["before"]  # 12 AdamW steps on 16 windows fit them better
    assert report["max_diff"] < 1e-5
    assert (tmp_path / "adapted" / "manifest.json").is_file()


@torch_installed
def test_cli_adapt_never_imports_torch(cnn_bundle, tmp_path, rng):
    """``python -X importtime -m edgeadapt adapt``: the interpreter lists every module it imports."""
    X = rng.standard_normal((12, 16, 4)).astype(np.float32)  # documented layout: windows x time x channels
    np.savez(tmp_path / "d.npz", X=X, y=np.arange(12) % 3, subject=np.zeros(12, dtype=np.int64), sample_rate_hz=50.0)
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "edgeadapt", "adapt", str(cnn_bundle),
                           "--data", str(tmp_path / "d.npz"), "--out", str(tmp_path / "o"), "--epochs", "1",
                           "--batch-size", "4", "--device", "cpu", "--no-progress"],
                          capture_output=True, text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "done: 3 steps" in proc.stdout
    imported = [line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")]
    assert "onnxruntime.capi._pybind_state" in imported and "edgeadapt.runtime" in imported  # it lists imports
    # importtime also lists imports that failed: torch was not even attempted.
    assert not [m for m in imported if m == "torch" or m.startswith("torch.")]


MIXED = """
import sys
import numpy as np
sys.path.insert(0, TESTS)
if FIRST == "runtime":
    import edgeadapt.runtime
    assert "torch" not in sys.modules
import torch
from helpers import make_cnn
from edgeadapt.export import UpdatePolicy, export_bundle
from edgeadapt.runtime import Runner
import onnxruntime as ort
from onnxruntime.training import api, artifacts
out = OUT
export_bundle(make_cnn(), torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(0)), out,
              policy=UpdatePolicy.last_layer())
runner = Runner.load(out, device="cpu")
loss = runner.train_step(np.zeros((4, 4, 16), np.float32), np.array([0, 1, 2, 0]))
state = api.CheckpointState.load_checkpoint(out + "/checkpoint")  # ORT's own (torch-backed) wrapper
print(loss, len(list(state.parameters)) > 0, callable(ort.InferenceSession))
"""


@torch_installed
@pytest.mark.parametrize("first", ["runtime", "exporter"])
def test_exporter_and_runner_share_a_process(first, tmp_path):
    """The torch-free import leaves onnxruntime whole: the exporter (onnxruntime.training with
    torch) works after the runtime was imported, and the runner after the exporter."""
    code = (MIXED.replace("TESTS", repr(str(REPO / "tests"))).replace("FIRST", repr(first))
            .replace("OUT", repr(str(tmp_path / "b"))))
    proc = run_python(code, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    loss, has_params, has_session = proc.stdout.split()[-3:]
    assert np.isfinite(float(loss)) and has_params == "True" and has_session == "True"


def test_device_side_modules_import_without_torch():
    # The proof that *our* device code needs no torch at all: a process where it cannot be imported.
    proc = run_python("import edgeadapt.runtime, edgeadapt.bundle, edgeadapt.cli, edgeadapt.datasets",
                      block_torch=True)
    assert proc.returncode == 0, proc.stderr[-3000:]


@torch_installed
def test_runtime_import_loads_no_torch_with_torch_installed():
    proc = run_python("import sys, edgeadapt.runtime, edgeadapt.cli, edgeadapt.bundle\n"
                      "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]"
