"""edgeadapt.sched imports no torch, onnx or onnxruntime (it is shared by the device and the server)."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import edgeadapt.sched


def test_sched_imports_no_heavy_library():
    modules = ["edgeadapt.sched"] + [f"edgeadapt.sched.{m.name}" for m in pkgutil.iter_modules(edgeadapt.sched.__path__)]
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}:\n"
        "    importlib.import_module(m)\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'onnx', 'onnxruntime'))\n"
        "assert not bad, bad\n"
        "print(len(sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert len(modules) >= 9
