"""The device side runs with numpy + onnxruntime only: a process where `import torch` raises
imports the runner, adapts, evaluates, saves, and exports an inference model."""

from __future__ import annotations

import json

from helpers import run_python

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
                  "before": before.loss, "after": after.loss, "steps": result.steps, "max_diff": same}))
"""


def test_device_job_runs_where_torch_cannot_be_imported(cnn_bundle, tmp_path):
    probe = run_python("import torch", block_torch=True)
    assert probe.returncode != 0 and "torch is blocked" in probe.stderr
    code = DEVICE_JOB.replace("BUNDLE", repr(str(cnn_bundle))).replace("OUT", repr(str(tmp_path)))
    proc = run_python(code, block_torch=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["torch_loaded"] is False
    assert report["steps"] == 12
    assert report["after"] < report["before"]  # 12 AdamW steps on 16 windows fit them better
    assert report["max_diff"] < 1e-5
    assert (tmp_path / "adapted" / "manifest.json").is_file()


def test_device_side_modules_import_without_torch():
    # Where torch is installed, onnxruntime's own package __init__ imports it (through
    # onnxruntime.tools); so the proof that *our* device code needs no torch is a process where
    # torch cannot be imported at all.
    proc = run_python("import edgeadapt.runtime, edgeadapt.bundle, edgeadapt.cli, edgeadapt.datasets",
                      block_torch=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
