"""edgeadapt.sched imports no torch, onnx or onnxruntime (it is shared by the device and the server)."""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import edgeadapt.sched


def test_sched_imports_no_heavy_library():
    modules = ["edgeadapt.sched"] + [f"edgeadapt.sched.{m.name}"
                                     for m in pkgutil.iter_modules(edgeadapt.sched.__path__)]
    # every module file of the package is checked (the list is not empty or partial)
    files = sorted(f"edgeadapt.sched.{p.stem}" for p in Path(edgeadapt.sched.__file__).parent.glob("*.py")
                   if p.stem != "__init__")
    assert sorted(modules[1:]) == files
    code = (
        "import importlib, json, sys\n"
        f"for m in {modules!r}:\n"
        "    importlib.import_module(m)\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'onnx', 'onnxruntime'))\n"
        "assert not bad, bad\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('edgeadapt.sched'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert set(json.loads(out.stdout.splitlines()[-1])) >= set(modules)  # each was imported in that process
