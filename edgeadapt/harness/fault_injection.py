"""Fault injection on bundles: damage every file, then load and adapt each damaged copy.

For a bundle exported from each reference model (small input shapes), seeded cases of five kinds:

* ``corrupt``   overwrite 1-3 random byte ranges of one file (checksums left as they were);
* ``rehashed``  the same, with the manifest's sha256 of the file recomputed, so only the
                 content checks (manifest schema, ONNX and masks checks, the settings digest,
                 ONNX Runtime's own parsing) stand between the damage and a training run;
* ``truncate``  cut a file to a random shorter length;
* ``delete``    remove a file;
* ``inflate``   grow a file (sparse) far beyond what the model needs: refused before reading.

Each case loads the damaged copy with ``Runner.load`` and adapts one epoch on random data, in a
worker process that the parent restarts after a native crash or a hang (per-case timeout). A
bundle holding both training engines is loaded with the engine that reads the damaged file (its
onnxruntime-training or its portable files; ``auto`` for shared ones), so every engine's files
are damaged where they are read.
Outcomes:

* ``refused``    a project exception (``BundleError``/``InputError``) whose message names the
                  damaged file - the wanted outcome;
* ``unnamed``    a project exception that does not name the file;
* ``raw``        any other exception (a leak: ``UnicodeDecodeError``, an ONNX Runtime error, ...);
* ``trained``    loaded and adapted although damaged (``rehashed`` cases whose damage no
                  content check can see: a changed parameter value, a changed constant);
* ``harmless``   loaded and adapted, and the damage changed only bytes that carry no meaning
                  (the file parses to the same manifest - but for its informational
                  ``versions`` -, masks, ONNX model or parameter values);
* ``crash`` / ``hang``  the worker died from a signal / exceeded the per-case timeout.

``benchmarks/fault_injection.py`` (seed 0, 100 corruptions per bundle and mode) prints the
README figures from it; ``tests/reliability/test_fault_injection.py`` runs a reduced count.
The worker is this module: ``python -m edgeadapt.harness.fault_injection --worker CASES.json --start I``.
"""

from __future__ import annotations

import collections
import json
import os
import selectors
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

MODELS = ("cnn", "mobilenet", "transformer")
KINDS = ("corrupt", "rehashed", "truncate", "delete", "inflate")
GOOD = ("refused", "harmless")
# Small shapes keep the exports and the adaptation runs fast.
N_CHANNELS, N_TIME_STEPS, N_CLASSES = 4, 32, 3


def export_reference_bundles(out_dir: Path, models=MODELS) -> dict[str, Path]:
    """Export one bundle per reference model under ``out_dir``: seeded, biases and norm affines
    train (the head only where the export self-check refuses that)."""
    import torch

    from edgeadapt.export import UpdatePolicy, export_bundle
    from edgeadapt.export.selfcheck import SelfCheckError
    from edgeadapt.models import build_model

    bundles = {}
    for name in models:
        torch.manual_seed(0)
        model = build_model(name, N_CHANNELS, N_CLASSES, N_TIME_STEPS).eval()
        example = torch.randn(2, N_CHANNELS, N_TIME_STEPS, generator=torch.Generator().manual_seed(0))
        path = out_dir / name
        if not path.exists():
            try:
                export_bundle(model, example, path, policy=UpdatePolicy.parse("bias-norm"))
            except SelfCheckError:  # a kernel ORT gets wrong for this model: train the head only
                export_bundle(model, example, path, policy=UpdatePolicy.parse("last-layer"))
        bundles[name] = path
    return bundles


def make_cases(bundles: dict[str, Path], n_corrupt: int, seed: int) -> list[dict]:
    """Seeded case descriptions; each names one bundle, one file and the damage done to it."""
    rng = np.random.default_rng(seed)
    cases = []
    for model, path in bundles.items():
        files = sorted(f.name for f in path.iterdir() if f.is_file())
        for kind in ("corrupt", "rehashed"):
            targets = files if kind == "corrupt" else [f for f in files if f != "manifest.json"]
            for _ in range(n_corrupt):
                name = targets[rng.integers(len(targets))]
                size = (path / name).stat().st_size
                ranges = []
                for _ in range(int(rng.integers(1, 4))):
                    length = int(rng.integers(1, 17))
                    offset = int(rng.integers(0, max(1, size - length)))
                    ranges.append([offset, rng.integers(0, 256, size=length, dtype=np.uint8).tobytes().hex()])
                cases.append({"model": model, "kind": kind, "file": name, "ranges": ranges})
        for name in files:
            size = (path / name).stat().st_size
            cases.append({"model": model, "kind": "truncate", "file": name, "length": int(rng.integers(0, size))})
            cases.append({"model": model, "kind": "delete", "file": name})
            cases.append({"model": model, "kind": "inflate", "file": name, "length": 1 << 31})
    return cases


# ---- the worker: damage a copy, load and adapt it, report --------------------------------
def _damage(case: dict, src: Path, dst: Path) -> bool:
    """Build the damaged copy; False when the damage changed nothing (random bytes equal the old)."""
    from edgeadapt.bundle import MANIFEST_DIGEST_KEY, manifest_digest, sha256_file

    shutil.copytree(src, dst)
    target = dst / case["file"]
    kind = case["kind"]
    if kind == "delete":
        target.unlink()
    elif kind == "truncate":
        os.truncate(target, case["length"])
    elif kind == "inflate":
        os.truncate(target, case["length"])  # a sparse hole: no disk space used
    else:
        data = bytearray(target.read_bytes())
        before = bytes(data)
        for offset, hexbytes in case["ranges"]:
            patch = bytes.fromhex(hexbytes)
            data[offset:offset + len(patch)] = patch[: max(0, len(data) - offset)]
        if bytes(data) == before:
            return False
        target.write_bytes(bytes(data))
        if kind == "rehashed":
            manifest = json.loads((dst / "manifest.json").read_text())
            manifest["sha256"][case["file"]] = sha256_file(target)
            manifest[MANIFEST_DIGEST_KEY] = manifest_digest(manifest)  # a rehash covers the manifest's own digest
            (dst / "manifest.json").write_text(json.dumps(manifest))
    return True


def _run_case(case: dict, src: Path, scratch: Path) -> dict:
    from edgeadapt.bundle import BundleError
    from edgeadapt.runtime import InputError, Runner

    dst = scratch / "case"
    shutil.rmtree(dst, ignore_errors=True)
    if not _damage(case, src, dst):
        return {"outcome": "noop"}
    try:
        runner = Runner.load(dst, device="cpu", threads=1, backend=_reader(case["file"], src))
        before = runner.parameters()
        spec = runner.manifest.input
        rng = np.random.default_rng(0)
        X = rng.normal(size=(16, *spec.shape[1:])).astype(np.float32)
        label = runner.manifest.label
        y = rng.integers(0, label["n_classes"], size=16).astype(np.int64) if label else None
        runner.adapt(X, y, epochs=1, batch_size=8, progress=False)
    except (BundleError, InputError) as e:
        named = case["file"] in str(e)
        return {"outcome": "refused" if named else "unnamed", "error": f"{type(e).__name__}: {str(e)[:300]}"}
    except Exception as e:  # noqa: BLE001 - classifying every leak is the point
        return {"outcome": "raw", "error": f"{type(e).__name__}: {str(e)[:300]}"}
    return {"outcome": "harmless" if _same_meaning(case["file"], src, dst, before) else "trained"}


def _reader(name: str, src: Path) -> str:
    """The backend that reads the bundle file ``name`` (``auto`` for files every backend reads)."""
    from edgeadapt.bundle import BACKEND_FILE_ROLES, PORTABLE_STATS_ROLE, read_manifest

    manifest = read_manifest(src, verify=False)
    role = next((r for r, f in manifest.files.items() if f == name), None)
    if len(manifest.backends) < 2 or role is None:
        return "auto"
    if role == PORTABLE_STATS_ROLE:
        return "portable"
    return next((b for b, roles in BACKEND_FILE_ROLES.items() if role in roles), "auto")


def _same_meaning(name: str, src: Path, dst: Path, parameters: dict) -> bool:
    """Whether the damaged file still means what the original did: the same manifest (but its
    informational ``versions``), the same masks, the same ONNX model, the same parameter values."""
    from edgeadapt.bundle import read_manifest

    if name == "manifest.json":
        original, loaded = (read_manifest(d, verify=False).to_dict() for d in (src, dst))
        return {k for k in set(original) | set(loaded) if original.get(k) != loaded.get(k)} <= {"versions"}
    if name.endswith(".npz"):
        with np.load(src / name) as a, np.load(dst / name) as b:
            return sorted(a.files) == sorted(b.files) and all(np.array_equal(a[k], b[k]) for k in a.files)
    if name.endswith(".onnx"):
        import onnx

        return onnx.load(src / name) == onnx.load(dst / name)
    original = _original_parameters(src)
    return parameters.keys() == original.keys() and all(np.array_equal(parameters[k], original[k]) for k in original)


_ORIGINALS: dict[Path, dict] = {}


def _original_parameters(src: Path) -> dict:
    from edgeadapt.runtime import Runner

    if src not in _ORIGINALS:
        _ORIGINALS[src] = Runner.load(src, device="cpu", threads=1).parameters()
    return _ORIGINALS[src]


def worker_main(cases_path: str, start: int) -> None:
    """Run cases from ``start``; print ``START i`` before and ``RESULT i {json}`` after each."""
    import logging

    logging.disable(logging.WARNING)
    spec = json.loads(Path(cases_path).read_text())
    with tempfile.TemporaryDirectory(prefix="edgeadapt-faults-") as scratch:
        for i in range(start, len(spec["cases"])):
            case = spec["cases"][i]
            print(f"START {i}", flush=True)
            result = _run_case(case, Path(spec["bundles"][case["model"]]), Path(scratch))
            print(f"RESULT {i} {json.dumps(result)}", flush=True)


# ---- the parent: run the worker, survive its crashes and hangs ---------------------------
def run_cases(bundles: dict[str, Path], cases: list[dict], *, timeout_s: float = 60.0,
              progress=None, worker: list[str] | None = None) -> list[dict]:
    """Run every case in restartable worker processes; returns one result dict per case.

    ``worker``: the command of the worker process (default: this module's ``--worker``), to
    which ``CASES.json --start I`` are appended."""
    results: list[dict | None] = [None] * len(cases)
    with tempfile.TemporaryDirectory(prefix="edgeadapt-faults-") as tmp:
        spec_path = Path(tmp) / "cases.json"
        spec_path.write_text(json.dumps({"cases": cases, "bundles": {k: str(v) for k, v in bundles.items()}}))
        next_case = 0
        command = worker or [sys.executable, "-m", "edgeadapt.harness.fault_injection", "--worker"]
        while next_case < len(cases):
            proc = subprocess.Popen([*command, str(spec_path), "--start", str(next_case)],
                                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            sel = selectors.DefaultSelector()
            sel.register(proc.stdout, selectors.EVENT_READ)
            current, deadline = None, time.monotonic() + timeout_s
            while True:
                if not sel.select(timeout=max(0.0, deadline - time.monotonic())):
                    proc.kill()
                    proc.wait()
                    i = current if current is not None else next_case
                    results[i] = {"outcome": "hang"}
                    next_case = i + 1
                    break
                line = proc.stdout.readline()
                if not line:
                    rc = proc.wait()
                    if current is not None:
                        results[current] = {"outcome": "crash", "returncode": rc}
                        next_case = current + 1
                    else:
                        next_case = len(cases) if rc == 0 else next_case + 1
                    break
                tag, index, *rest = line.rstrip("\n").split(" ", 2)
                if tag == "START":
                    current, deadline = int(index), time.monotonic() + timeout_s
                elif tag == "RESULT":
                    results[int(index)] = json.loads(rest[0])
                    current = None
                    next_case = int(index) + 1
                    if progress:
                        progress(int(index))
            sel.close()
            proc.stdout.close()
    return [r if r is not None else {"outcome": "crash"} for r in results]


def summarize(cases: list[dict], results: list[dict]) -> dict:
    """Outcome counts per case kind and overall (``noop`` cases excluded)."""
    table: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for case, result in zip(cases, results):
        if result["outcome"] == "noop":
            continue
        table[case["kind"]][result["outcome"]] += 1
        table["all"][result["outcome"]] += 1
    return {kind: dict(counter) for kind, counter in table.items()}


def _worker_entry(argv: list[str] | None = None) -> int:
    """``python -m edgeadapt.harness.fault_injection --worker CASES.json [--start I]``."""
    import argparse

    parser = argparse.ArgumentParser(description="the fault-injection worker (run by run_cases)")
    parser.add_argument("--worker", required=True)
    parser.add_argument("--start", type=int, default=0)
    args = parser.parse_args(argv)
    worker_main(args.worker, args.start)
    return 0


if __name__ == "__main__":
    sys.exit(_worker_entry())
