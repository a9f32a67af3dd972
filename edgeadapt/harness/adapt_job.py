"""A torch-free adaptation job in a process of its own: JSON spec in, JSON report out.

``python -m edgeadapt.harness.adapt_job SPEC.json REPORT.json`` forbids ``import torch`` before anything
else is imported, then loads the bundle with the runner, evaluates, adapts, evaluates again,
saves the adapted bundle and reports accuracy, memory (the peak of one step and of the whole
``adapt`` call, each total and anonymous-only) and time. The quickstart and the
benchmarks run every on-device step this way, so their figures come from a process that
demonstrably holds no torch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..atomic import atomic_write_json

__all__ = ["AdaptJobSpec", "run_job", "run_job_in_subprocess", "main"]


@dataclass(frozen=True)
class AdaptJobSpec:
    """What one job does. Data files are ``WindowDataset.save_npz`` files (channels-first X).

    Attributes:
        bundle: the exported bundle to adapt.
        adapt_data: windows to adapt on (labels ignored for a label-free loss).
        eval_data: held-out windows of the same subject to evaluate before and after.
        out_dir: where the adapted bundle goes (must not exist).
        epochs, batch_size, lr, schedule, seed: passed to ``Runner.adapt``; ``lr=None`` uses
            the bundle's.
        device, threads: passed to ``Runner.load``.
        unlabeled: settings of ``Runner.adapt_unlabeled`` (JSON form): the job adapts label-free
            with them instead of calling ``Runner.adapt``; the report gains ``label_free`` (the
            gate's decision and evidence, the stages kept, resets).
    """

    bundle: str
    adapt_data: str
    eval_data: str
    out_dir: str
    epochs: int = 10
    batch_size: int = 16
    lr: float | None = None
    schedule: str = "constant"
    seed: int = 0
    device: str = "auto"
    threads: int | None = None
    unlabeled: dict | None = None


def run_job(spec: AdaptJobSpec) -> dict[str, Any]:
    """Run the job in this process and return the report (see module docstring).

    Memory figures (bytes) follow the measuring protocol (:mod:`edgeadapt.measure`): the
    baseline is this process with the runner loaded and evaluated once, just before ``adapt``
    (freed heap returned to the OS first: ``heap_trimmed``); ``call_peak_bytes`` is the
    resident high-water mark (VmHWM) of the whole call as the caller sees it over it,
    ``call_peak_anon_bytes`` the same for anonymous memory only (sampled RssAnon, no file
    pages); ``step_peak_bytes`` / ``step_peak_anon_bytes`` are the runner's own figures for its
    largest single optimizer step (:class:`~edgeadapt.runtime.AdaptResult`).
    ``load_rss_bytes``/``load_anon_bytes``: what loading the bundle allocated, before the
    baseline (imports excluded).
    """
    from ..datasets import WindowDataset
    from ..measure import measure_call
    from ..memory import status_fields
    from ..runtime import Runner
    from ..versions import host_info

    start = time.perf_counter()
    adapt = WindowDataset.load_npz(spec.adapt_data)
    held_out = WindowDataset.load_npz(spec.eval_data)
    imported = status_fields("VmRSS", "RssAnon")
    runner = Runner.load(spec.bundle, device=spec.device, threads=spec.threads)
    loaded = status_fields("VmRSS", "RssAnon")
    labeled = runner.manifest.label is not None
    before = runner.evaluate(held_out.X, held_out.y) if labeled else None
    before_logits = None if labeled else runner.predict(held_out.X)
    with measure_call(trim_heap=True) as mem:  # the measuring protocol (edgeadapt.measure)
        result, label_free = _adapt(runner, spec, adapt, labeled)
    after = runner.evaluate(held_out.X, held_out.y) if labeled else None
    if not labeled:  # label-free bundle: accuracy from the logits
        logits = runner.predict(held_out.X)
        after_acc = float((logits.argmax(1) == held_out.y).mean())
    runner.save(spec.out_dir)
    return {
        "device": runner.device,
        "backend": runner.backend,  # the training engine Runner.load chose (auto)
        "threads": spec.threads,
        "torch_imported": any(m == "torch" or m.startswith("torch.") for m in sys.modules),
        "accuracy_after": after.accuracy if labeled else after_acc,
        # a label-free bundle takes no labels: its accuracy from the logits, as after adapting
        "accuracy_before": before.accuracy if labeled else float((before_logits.argmax(1) == held_out.y).mean()),
        "loss_after": after.loss if labeled else None,
        "epoch_losses": list(result.epoch_losses),
        "steps": result.steps,
        "adapt_time_s": result.time_s,
        "job_time_s": time.perf_counter() - start,
        "heap_trimmed": mem.heap_trimmed,
        "loaded_rss_bytes": mem.baseline_rss_bytes,
        "loaded_anon_bytes": mem.baseline_anon_bytes,
        "load_rss_bytes": loaded["VmRSS"] - imported["VmRSS"],
        "load_anon_bytes": loaded["RssAnon"] - imported["RssAnon"],
        "step_peak_bytes": result.step_peak_bytes,
        "call_peak_bytes": mem.call_peak_bytes,
        "step_peak_anon_bytes": result.step_peak_anon_bytes,
        "call_peak_anon_bytes": mem.call_peak_anon_bytes,
        "trainable_numel": runner.manifest.trainable_numel,
        "n_adapt_windows": int(len(adapt.y)),
        "n_eval_windows": int(len(held_out.y)),
        "host": host_info(),
        "label_free": None if label_free is None else asdict(label_free),
    }


def _adapt(runner, spec: AdaptJobSpec, adapt, labeled: bool):
    """The measured call: ``Runner.adapt``, or ``adapt_unlabeled`` with ``spec.unlabeled``."""
    from ..runtime import AdaptResult

    if spec.unlabeled is None:
        return runner.adapt(adapt.X, adapt.y if labeled else None, epochs=spec.epochs, batch_size=spec.batch_size,
                            lr=spec.lr, schedule=spec.schedule, seed=spec.seed, progress=False), None
    from ..runtime.unlabeled import UnlabeledSettings

    label_free = runner.adapt_unlabeled(adapt.X, UnlabeledSettings.from_dict({"seed": spec.seed, **spec.unlabeled}))
    return AdaptResult(0, label_free.steps, (), label_free.time_s), label_free


def run_job_in_subprocess(spec: AdaptJobSpec, workdir: str | os.PathLike, timeout_s: float = 900) -> dict[str, Any]:
    """Run the job in a fresh torch-free interpreter; raises RuntimeError with its stderr on failure."""
    workdir = Path(workdir)
    spec_path, report_path = workdir / "adapt_job_spec.json", workdir / "adapt_job_report.json"
    spec_path.write_text(json.dumps(asdict(spec), indent=2))
    proc = subprocess.run([sys.executable, "-m", "edgeadapt.harness.adapt_job", str(spec_path), str(report_path)],
                          capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"the adaptation job failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(report_path.read_text())


def main(argv: list[str] | None = None) -> int:
    """Entry point: forbid torch, run the job from SPEC.json, write REPORT.json."""
    from .isolation import forbid_torch

    forbid_torch()
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m edgeadapt.harness.adapt_job SPEC.json REPORT.json", file=sys.stderr)
        return 2
    spec = AdaptJobSpec(**json.loads(Path(args[0]).read_text()))
    atomic_write_json(args[1], run_job(spec))
    return 0


if __name__ == "__main__":
    sys.exit(main())
