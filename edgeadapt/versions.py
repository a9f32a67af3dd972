"""Versions and host facts that a figure or a bundle depends on, gathered in one place.

Torch-free: nothing here imports torch (or onnxruntime); a figure from a process that already
imported torch also gets torch's kernel level (``torch_cpu_capability``).
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path

__all__ = ["package_versions", "cpu_info", "host_info", "code_version", "KERNEL_ISA_FLAGS", "cpu_jiffies"]

# /proc/cpuinfo flags that select different compute kernels in torch (ATen) and ONNX Runtime
# (MLAS): a figure can move when they differ between machines.
KERNEL_ISA_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
                    "avx512_bf16", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8", "asimd", "sve")

_DEFAULT_PACKAGES = ("edgeadapt", "torch", "onnx", "onnxruntime-training-cpu", "onnxruntime-training",
                     "onnxruntime", "numpy")


def package_versions(packages: tuple[str, ...] = _DEFAULT_PACKAGES) -> dict[str, str]:
    """Installed versions of ``packages`` (distribution names); absent ones are left out.

    ``onnxruntime`` is also reported under that name when only a training build is installed
    (``onnxruntime-training[-cpu]`` installs the ``onnxruntime`` import package), read from the
    distribution metadata so that nothing is imported.
    """
    out = {}
    for pkg in packages:
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    if "onnxruntime" in packages and "onnxruntime" not in out:
        for build in ("onnxruntime-training-cpu", "onnxruntime-training"):
            if build in out:
                out["onnxruntime"] = out[build]
                break
    return out


def cpu_info() -> dict:
    """CPU model and the kernel-selecting ISA flags it has (from ``/proc/cpuinfo`` on Linux)."""
    model, flags = None, set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "Model") and model is None:
                    model = value.strip()
                elif key in ("flags", "Features"):
                    flags = set(value.split())
                elif not key and flags:  # the first processor's block is enough
                    break
    except OSError:
        pass
    model = model or platform.processor() or platform.machine()
    return {"model": model, "machine": platform.machine(), "logical_cpus": os.cpu_count(),
            "isa_flags": [f for f in KERNEL_ISA_FLAGS if f in flags]}


def host_info() -> dict:
    """Python, platform, CPU, package versions and the thread/kernel environment variables.

    Where torch is already imported in this process, also torch's CPU kernel level (e.g.
    ``AVX2``/``AVX512``) and its thread count; torch is never imported here.
    """
    out = {"python": platform.python_version(), "platform": platform.platform(), "cpu": cpu_info(),
           "versions": package_versions(),
           "env": {k: os.environ[k] for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "ATEN_CPU_CAPABILITY",
                                              "OMP_WAIT_POLICY", "MALLOC_ARENA_MAX") if k in os.environ}}
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            out["torch_cpu_capability"] = torch.backends.cpu.get_cpu_capability()
            out["torch_threads"] = torch.get_num_threads()
        except AttributeError:  # a stub or a very old torch
            pass
    return out


def code_version(repo: str | Path | None = None) -> dict:
    """The commit the code comes from, the tracked files that differ from it, and where the
    imported ``edgeadapt`` lives (read-only git; ``None`` where git cannot answer).

    Args:
        repo: the checkout to ask (default: the one holding this package).
    """
    repo = Path(repo) if repo is not None else Path(__file__).resolve().parents[1]

    def git(*args: str) -> str | None:
        try:
            return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=30,
                                  check=True).stdout.rstrip("\n")  # porcelain lines start with a space
        except (OSError, subprocess.SubprocessError):
            return None

    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": git("rev-parse", "HEAD"),
            "modified_files": None if status is None else [line[3:] for line in status.splitlines()],
            "edgeadapt_path": str(Path(__file__).resolve().parent)}


def cpu_jiffies() -> tuple[int, int]:
    """(busy jiffies of the whole machine, jiffies this process used), from ``/proc`` (Linux):
    sampled before and after a timed span, they tell how contended the machine was."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    # user nice system idle iowait irq softirq steal [guest guest_nice, already in user/nice]
    busy = v[0] + v[1] + v[2] + v[5] + v[6] + (v[7] if len(v) > 7 else 0)
    with open("/proc/self/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return busy, int(fields[11]) + int(fields[12])  # utime + stime, all threads
