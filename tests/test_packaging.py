"""Packaging: one import namespace; the top-level export/ and datasets/ folders ship inside the
wheel as edgeadapt.export and edgeadapt.datasets (they are symlinks in edgeadapt/)."""

from __future__ import annotations

import subprocess
import sys
import zipfile

import pytest
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
                   "edgeadapt/runtime/runner.py", "edgeadapt/cli/__init__.py", "edgeadapt/cli/adapt.py"):
        assert module in names, module
    assert not any(n.startswith(("export/", "datasets/", "tests/")) for n in names)
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "edgeadapt = edgeadapt.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_subpackages_resolve_inside_the_namespace():
    proc = run_python(
        "import edgeadapt.export, edgeadapt.datasets, importlib.util\n"
        "print(edgeadapt.export.__name__, edgeadapt.datasets.__name__)\n"
        "print(importlib.util.find_spec('datasets') is None or "
        "'edgeadapt' not in str(importlib.util.find_spec('datasets').origin))",
        cwd=REPO / "tests",
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["edgeadapt.export", "edgeadapt.datasets", "True"]


def _extras() -> dict[str, list]:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    from packaging.requirements import Requirement  # a dependency of pytest

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return {name: [Requirement(r) for r in reqs] for name, reqs in project["optional-dependencies"].items()}


def _onnx_stack(reqs, machine: str, python: str) -> dict[str, str]:
    env = {"platform_machine": machine, "python_version": python, "python_full_version": python + ".0",
           "extra": "server"}
    chosen = [r for r in reqs if r.marker is None or r.marker.evaluate(env)]
    return {r.name: str(r.specifier) for r in chosen if r.name.startswith("onnx") and r.name != "onnxscript"}


@pytest.mark.parametrize("machine, python, training", [
    ("x86_64", "3.10", True), ("x86_64", "3.12", True), ("AMD64", "3.11", True),
    ("x86_64", "3.13", False), ("aarch64", "3.11", False), ("aarch64", "3.13", False), ("arm64", "3.12", False),
])
def test_server_extra_picks_one_onnxruntime_per_platform(machine, python, training):
    """onnxruntime-training (and the onnx it loads) where its wheels exist; stock onnxruntime and
    a current onnx elsewhere - never both (they share the `onnxruntime` package)."""
    from packaging.specifiers import SpecifierSet

    stack = _onnx_stack(_extras()["server"], machine, python)
    if training:
        assert stack == {"onnxruntime-training-cpu": "==1.19.2", "onnx": "==1.17.0"}
    else:
        assert set(stack) == {"onnxruntime", "onnx"}
        assert "1.31.1" in SpecifierSet(stack["onnxruntime"]) and "1.17.0" not in SpecifierSet(stack["onnx"])


def test_device_extras_carry_no_torch_and_one_onnxruntime_each():
    extras = _extras()
    for name in ("device", "device-ort-training", "device-cuda"):
        names = [r.name for r in extras[name]]
        assert "torch" not in names and "onnx" in names, name
        assert sum(n.startswith("onnxruntime") for n in names) == 1, name
    assert {r.name for r in extras["device"]} == {"onnxruntime", "onnx"}
    assert "1.31.1" in next(r.specifier for r in extras["device"] if r.name == "onnxruntime")
    assert {r.name: str(r.specifier) for r in extras["device-ort-training"]} == {
        "onnxruntime-training-cpu": "==1.19.2", "onnx": "==1.17.0"}
    assert "onnxruntime-gpu" in [r.name for r in extras["device-cuda"]]
