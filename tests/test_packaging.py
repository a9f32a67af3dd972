"""Packaging: one import namespace; the top-level export/ and datasets/ folders ship inside the
wheel as edgeadapt.export and edgeadapt.datasets (they are symlinks in edgeadapt/)."""

from __future__ import annotations

import subprocess
import sys
import zipfile

from helpers import REPO, run_python


def test_wheel_contains_linked_subpackages(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(REPO), "--no-deps", "--no-build-isolation", "-w", str(tmp_path)],
        capture_output=True, text=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    wheel = next(tmp_path.glob("edgeadapt-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    for module in ("edgeadapt/export/__init__.py", "edgeadapt/export/exporter.py",
                   "edgeadapt/datasets/__init__.py", "edgeadapt/datasets/synthetic.py",
                   "edgeadapt/runtime/runner.py", "edgeadapt/cli.py"):
        assert module in names, module
    assert not any(n.startswith(("export/", "datasets/", "tests/")) for n in names)
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "edgeadapt = edgeadapt.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_subpackages_resolve_inside_the_namespace():
    proc = run_python(
        "import edgeadapt.export, edgeadapt.datasets, importlib.util\n"
        "print(edgeadapt.export.__name__, edgeadapt.datasets.__name__)\n"
        "print(importlib.util.find_spec('datasets') is None or 'edgeadapt' not in str(importlib.util.find_spec('datasets').origin))",
        cwd=REPO / "tests",
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["edgeadapt.export", "edgeadapt.datasets", "True"]
