"""The first adapt call of a process allocates only what the plan counts: it imports no module and
leaves no thread behind (tqdm's default first bar imports multiprocessing for its lock and
starts a monitor thread), with the progress bar on, on every training engine the bundle holds."""

from __future__ import annotations

import json

import pytest
from helpers import run_python

CODE = """
import json, sys, threading
from edgeadapt.runtime import Runner
from edgeadapt.measure import synthetic_data
runner = Runner.load({bundle!r}, device="cpu", threads=1, backend={backend!r})
X, y = synthetic_data(runner.manifest, 12, 0)
before, threads = set(sys.modules), threading.active_count()
runner.adapt(X, y, epochs=2, batch_size=4, progress=True)
print(json.dumps({{"modules": sorted(set(sys.modules) - before), "threads": [threads, threading.active_count()]}}))
"""


@pytest.mark.parametrize("backend", ["ort-training", "portable"])
def test_the_first_adapt_call_imports_nothing_and_starts_no_thread(cnn_bundle, backend):
    manifest = json.loads((cnn_bundle / "manifest.json").read_text())
    if backend not in manifest.get("backends", ["ort-training"]):
        pytest.skip(f"the bundle holds no {backend} graphs")
    proc = run_python(CODE.format(bundle=str(cnn_bundle), backend=backend), block_torch=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["modules"] == []
    assert report["threads"][1] == report["threads"][0]
