"""The device side as the README installs it, proved end to end (slow: both install from the
package registry).

1. A wheel built once (``python -m pip wheel --no-deps . -w dist/``) installed with its
   ``[device]`` extra into a fresh virtual environment: stock onnxruntime, no torch, no
   onnxruntime-training. There, a portable bundle is loaded, adapted, saved, reloaded and exported
   for inference (tests/device_roundtrip.py).
2. The same wheel's ``[device]`` extra resolved for aarch64 / CPython 3.13 and run under emulation
   (tools/arm64_py313.sh: a Debian trixie arm64 userland under qemu-user): the same round trip,
   whose parameters must match the x86_64 run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
from helpers import REPO

pytestmark = pytest.mark.slow

ROUNDTRIP = Path(__file__).with_name("device_roundtrip.py")
ARM64 = REPO / "tools" / "arm64_py313.sh"
EPOCHS = 3
N_CHANNELS, N_STEPS, N_CLASSES, N_WINDOWS, BATCH, LR = 4, 32, 3, 24, 8, 3e-3
#: Parameters after the round trip on another platform (aarch64) or onnxruntime release, per tensor
#: relative to its largest value. The runs differ only in the kernels' summation order (NEON vs
#: AVX, another release): a float32 sum of n terms moves by <= n u of the sum of magnitudes
#: (u = 2^-24); the longest reductions here (a conv weight's gradient over batch x time, 8 x 16)
#: give <= 1e-5 relative per gradient. An AdamW step is lr * m / (sqrt(v) + eps), so a gradient
#: error of relative e moves it by about e * lr: 9 steps of lr 3e-3 leave ~3e-7 relative on
#: parameters of magnitude ~0.5, well inside this bound.
PLATFORM_RTOL = 1e-5


def _env() -> dict[str, str]:
    """This process's environment minus what would leak the checkout into another interpreter."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}


def _run(argv, *, timeout_s: int, cwd: Path | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(a) for a in argv], capture_output=True, text=True, cwd=cwd, timeout=timeout_s,
                          env=env or _env())
    assert proc.returncode == 0, f"{argv[:4]} exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The project's wheel, built with the README's command (isolated build, no dependencies)."""
    out = tmp_path_factory.mktemp("dist")
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", ".", "-w", out], cwd=REPO, timeout_s=300)
    (whl,) = out.glob("edgeadapt-*-py3-none-any.whl")
    return whl


@pytest.fixture(scope="module")
def case(tmp_path_factory) -> dict[str, Path]:
    """A small CNN exported as a portable bundle (its frozen prefix cached as features, the last
    conv's channel subset and the head trained) and labelled windows for it."""
    import torch
    from helpers import make_cnn

    from edgeadapt.export import OptimizerConfig, Rule, UpdatePolicy, export_bundle

    root = tmp_path_factory.mktemp("case")
    torch.manual_seed(0)
    policy = UpdatePolicy(rules=(Rule("head", "full"), Rule("conv2", "channels", ratio=0.5)), default="frozen")
    export_bundle(make_cnn(seed=0, n_channels=N_CHANNELS, n_classes=N_CLASSES), torch.randn(8, N_CHANNELS, N_STEPS),
                  root / "bundle", policy=policy, optimizer=OptimizerConfig("adamw", lr=LR, weight_decay=0.01),
                  n_windows=N_WINDOWS, batch_windows=BATCH, backend="portable")
    rng = np.random.default_rng(1)
    data = root / "data.npz"
    np.savez(data, X=rng.normal(size=(N_WINDOWS, N_CHANNELS, N_STEPS)).astype(np.float32),
             y=rng.integers(0, N_CLASSES, N_WINDOWS))
    return {"bundle": root / "bundle", "data": data}


def _roundtrip(python_argv: list, case: dict[str, Path], out: Path, *, timeout_s: int, env=None, cwd=None) -> dict:
    out.mkdir()
    proc = _run([*python_argv, ROUNDTRIP, case["bundle"], case["data"], out, EPOCHS, BATCH],
                timeout_s=timeout_s, env=env, cwd=cwd or out)
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not report["torch_imported"] and not report["ort_training_imported"], report
    assert report["steps"] == EPOCHS * -(-N_WINDOWS // BATCH)
    assert len(report["epoch_losses"]) == EPOCHS and all(np.isfinite(report["epoch_losses"]))
    assert (out / "adapted" / "manifest.json").is_file() and (out / "model.onnx").is_file()
    lf = report["label_free"]  # the label-free call ran its gate on the device side too
    # cross-fitted: every window adapted on, and each held back once for the gate's evidence
    assert lf["gate"] is not None and lf["gate_windows"] == lf["adapt_windows"] == N_WINDOWS, lf
    with np.load(out / "parameters.npz", allow_pickle=False) as p:
        report["parameters"] = {k: p[k] for k in p.files}
    return report


@pytest.fixture(scope="module")
def x86_reference(case, tmp_path_factory) -> dict:
    """The round trip on this checkout's interpreter (the reference for the other platforms)."""
    return _roundtrip([sys.executable], case, tmp_path_factory.mktemp("ref") / "out", timeout_s=300)


def _assert_same_parameters(got: dict, want: dict, rtol: float) -> float:
    """Every tensor within ``rtol`` of its largest value; returns the worst such ratio."""
    assert sorted(got) == sorted(want)
    worst = 0.0
    for k, w in want.items():
        err = float(np.abs(got[k].astype(np.float64) - w).max())
        assert err <= rtol * float(np.abs(w).max()), f"{k}: max difference {err:.3g}, max |value| {np.abs(w).max():.3g}"
        worst = max(worst, err / float(np.abs(w).max()))
    return worst


def _device_requirements(whl: Path) -> list[str]:
    with zipfile.ZipFile(whl) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    return sorted(line.split(":", 1)[1].strip() for line in meta.splitlines()
                  if line.startswith("Requires-Dist:") and ("extra ==" not in line or 'extra == "device"' in line))


def test_device_extra_from_a_wheel_adapts_on_stock_onnxruntime_without_torch(wheel, case, x86_reference, tmp_path):
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", venv], timeout_s=120)
    py = venv / "bin" / "python"
    _run([py, "-m", "pip", "install", "-q", f"{wheel}[device]"], timeout_s=600)
    installed = json.loads(_run([py, "-c", (
        "import importlib.metadata as m, importlib.util as u, json\n"
        "print(json.dumps({'dists': sorted(d.metadata['Name'].lower() for d in m.distributions()),"
        " 'torch': u.find_spec('torch') is not None}))")], timeout_s=60).stdout)
    assert not installed["torch"]
    assert "onnxruntime" in installed["dists"] and "onnx" in installed["dists"]
    assert not any(d.startswith("onnxruntime-training") or d == "torch" for d in installed["dists"]), installed

    where = _run([py, "-c", "import edgeadapt; print(edgeadapt.__file__)"], timeout_s=60, cwd=tmp_path).stdout.strip()
    assert Path(where).is_relative_to(venv), where  # the installed wheel, not the checkout

    report = _roundtrip([py], case, tmp_path / "out", timeout_s=300)
    assert report["machine"] == x86_reference["machine"]
    # Same platform, another onnxruntime release (the registry's current one): only the kernels'
    # summation order may differ, as on aarch64.
    worst = _assert_same_parameters(report["parameters"], x86_reference["parameters"], PLATFORM_RTOL)
    print(f"x86_64, onnxruntime {report['onnxruntime']} (fresh venv) vs {x86_reference['onnxruntime']} (checkout): "
          f"worst relative parameter difference {worst:.2g}")


def test_device_extra_on_emulated_aarch64_python313_matches_x86_64(wheel, case, x86_reference, tmp_path):
    check = subprocess.run(["bash", ARM64, "check"], capture_output=True, text=True, timeout=120)
    if check.returncode == 3:
        pytest.skip(f"aarch64 emulation is not possible here: {check.stdout.strip()}")
    assert check.returncode == 0, check.stdout + check.stderr
    env = {**_env(), "PIP_PYTHON": sys.executable}  # the host's pip that resolves the aarch64 wheels
    root = Path(env.setdefault("ARM64_ROOT", str(REPO / ".cache" / "arm64-py313")))
    _run(["bash", ARM64, "setup"], timeout_s=900, env=env)
    # Dependencies once per requirement set (a reinstall would drop the emulated interpreter's
    # cached bytecode, which takes minutes to rebuild under emulation); the project every time.
    stamp = root / "site" / ".edgeadapt-device-requirements"
    wanted = "\n".join(_device_requirements(wheel))
    if not stamp.is_file() or stamp.read_text() != wanted:
        _run(["bash", ARM64, "install", f"{wheel}[device]"], timeout_s=900, env=env)
        stamp.write_text(wanted)
    else:
        _run(["bash", ARM64, "install", "--no-deps", wheel], timeout_s=300, env=env)

    report = _roundtrip(["bash", ARM64, "run"], case, tmp_path / "out", timeout_s=1800, env=env)
    assert report["machine"] == "aarch64" and report["python"].startswith("3.13."), report
    worst = _assert_same_parameters(report["parameters"], x86_reference["parameters"], PLATFORM_RTOL)
    print(f"aarch64 / Python {report['python']} / onnxruntime {report['onnxruntime']} vs x86_64 / onnxruntime "
          f"{x86_reference['onnxruntime']}: worst relative parameter difference {worst:.2g}")
