"""The measuring protocol: the memory of one ``Runner.adapt`` call in a process as a user has it.

One place owns how the project measures a device adaptation (docs/design.md, "Measuring");
``edgeadapt plan --measure``, the harness's adaptation job, the benchmarks and the tests all
call it:

1. a **fresh interpreter** where ``import torch`` fails (:func:`measure_in_fresh_process`,
   ``python -m edgeadapt.measure SPEC.json REPORT.json``), as on a device without torch;
2. the process does what a user's does, in order: import the runner, load the bundle, load or
   make the data, then one ``adapt`` call (progress bar on by default). **Nothing the runner
   does lazily is warmed up** (imports, tqdm's lock, first-use caches): what the call allocates
   on its first use shows. This plain history is the bound a budget must hold: a ``predict``
   first (:attr:`MeasureSpec.predict_first`) makes the call cheaper, not dearer (measured: the
   inference path's freed buffers are reused by the call);
3. **baseline**: RssAnon and VmRSS just before the call (VmHWM reset there). Freed heap may
   be returned to the OS first (:attr:`MeasureSpec.trim_heap`, glibc ``malloc_trim``): then
   every page the call touches counts, and the figure is what the call itself allocates, the
   bound for any history of the process. Without it the figure is what this history gets: the
   call reuses heap that loading freed (measured on a 10 k-parameter MLP bundle: 264 KiB
   untrimmed, 740 KiB trimmed), an amount that depends on the bundle and on what ran before.
   Budgets and the cost model are held to the trimmed figure; a user's process stays at or
   below it;
4. **figures** over the baseline, for the *whole* call as the caller sees it (the bar, the
   runner's own probes and everything else ``adapt`` does): ``call_peak_anon_bytes``, the
   sampled high-water mark of RssAnon (heap, arenas, stacks; what a memory budget bounds) and
   ``call_peak_bytes``, VmHWM (file-backed library code paged in on first use included).
   The runner's own figures (:class:`~edgeadapt.runtime.AdaptResult`, taken inside the call)
   are reported beside them: ``step_peak_*`` (its largest optimizer step) and ``runner_call_*``.

Torch-free; the runner is imported only inside the measuring process.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from . import memory

__all__ = ["MEASURE_SAMPLE_INTERVAL_S", "MeasureSpec", "CallMemory", "measure_call", "synthetic_data",
           "run_measurement", "measure_in_fresh_process", "main"]

# RssAnon/VmRSS are sampled this often during a measured call.
MEASURE_SAMPLE_INTERVAL_S = 0.001
# The runner calls the protocol measures (MeasureSpec.method).
MEASURED_METHODS = ("adapt", "bn-stats", "unlabeled")


@dataclass(frozen=True)
class MeasureSpec:
    """One measurement (JSON-able: it travels to the fresh process as a file).

    Attributes:
        bundle: the bundle to load.
        n_windows: adaptation windows; default: the plan's ``n_windows`` (else 32). Ignored with
            ``adapt_data``.
        batch_windows: windows per step; default: the plan's ``batch_windows`` (else 32).
        micro_batch: passed to ``Runner.adapt`` (``None``: the plan's micro-batch).
        epochs, lr, seed: passed to ``Runner.adapt`` (``lr=None``: the bundle's).
        threads, device, backend: passed to ``Runner.load``.
        progress: the adapt call's progress bar (on, as a user runs it).
        predict_first: ``predict`` on the adaptation windows before adapting, as a user
            checking the model first would (off by default: the plain history, see above).
        trim_heap: return freed heap to the OS just before the baseline (see the module doc).
        adapt_data: a ``WindowDataset.save_npz`` file to adapt on; default: seeded synthetic
            windows of the bundle's input shape and labels.
        eval_data: a ``WindowDataset.save_npz`` file evaluated after adapting (``accuracy``).
        timeline: also return the sampled series ``[seconds, VmRSS - base, RssAnon - base]``.
        method: the call measured: ``"adapt"`` (``Runner.adapt``), ``"bn-stats"``
            (``Runner.update_bn_statistics`` in batches of ``batch_windows``) or ``"unlabeled"``
            (``Runner.adapt_unlabeled`` with ``unlabeled`` settings, a dict of
            :class:`~edgeadapt.runtime.unlabeled.UnlabeledSettings`; default: the recommended ones).
    """

    bundle: str
    n_windows: int | None = None
    batch_windows: int | None = None
    micro_batch: int | None = None
    epochs: int = 1
    lr: float | None = None
    seed: int = 0
    threads: int | None = 1
    device: str = "cpu"
    backend: str = "auto"
    progress: bool = True
    predict_first: bool = False
    trim_heap: bool = False
    adapt_data: str | None = None
    eval_data: str | None = None
    timeline: bool = False
    method: str = "adapt"
    unlabeled: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.method not in MEASURED_METHODS:
            raise ValueError(f"method must be one of {MEASURED_METHODS}, got {self.method!r}")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MeasureSpec:
        return cls(**d)


@dataclass
class CallMemory:
    """Filled in by :func:`measure_call`: the baseline and the peaks over it (bytes)."""

    baseline_rss_bytes: int = 0
    baseline_anon_bytes: int = 0
    peak_rss_bytes: int = 0
    peak_anon_bytes: int = 0
    peak_reset_ok: bool = False
    heap_trimmed: bool = False
    samples: int = 0
    timeline: list[list[float]] = field(default_factory=list)

    @property
    def call_peak_bytes(self) -> int:
        """Total: VmHWM over VmRSS at the baseline (file-backed pages included)."""
        return max(0, self.peak_rss_bytes - self.baseline_rss_bytes)

    @property
    def call_peak_anon_bytes(self) -> int:
        """Anonymous only: sampled peak RssAnon over RssAnon at the baseline (a lower bound)."""
        return max(0, self.peak_anon_bytes - self.baseline_anon_bytes)

    def figures(self) -> dict[str, Any]:
        """The JSON form reported by every measuring job."""
        return {"baseline_rss_bytes": self.baseline_rss_bytes, "baseline_anon_bytes": self.baseline_anon_bytes,
                "call_peak_bytes": self.call_peak_bytes, "call_peak_anon_bytes": self.call_peak_anon_bytes,
                "peak_reset_ok": self.peak_reset_ok, "heap_trimmed": self.heap_trimmed, "samples": self.samples}


class _Sampler(memory.AnonPeakSampler):
    """:class:`~edgeadapt.memory.AnonPeakSampler` that can also keep the (time, VmRSS, RssAnon) series."""

    def __init__(self, interval_s: float, keep_series: bool):
        super().__init__(interval_s)
        self.series: list[tuple[float, int, int]] | None = [] if keep_series else None

    def _read(self) -> int:
        if self.series is None:
            return super()._read()
        text = os.pread(self._fd, 8192, 0).decode()
        values = []
        for key in ("VmRSS:", "RssAnon:"):
            i = text.index(key)
            values.append(int(text[i + len(key):text.index("kB", i)]) * 1024)
        self.series.append((time.perf_counter(), values[0], values[1]))
        return values[1]


@contextlib.contextmanager
def measure_call(*, trim_heap: bool = False, interval_s: float = MEASURE_SAMPLE_INTERVAL_S,
                 timeline: bool = False) -> Iterator[CallMemory]:
    """Measure the body (one call) over a baseline taken just before it, as the protocol says.

    Args:
        trim_heap: return freed heap to the OS before the baseline (:func:`edgeadapt.memory.trim_heap`).
        interval_s: RssAnon sampling interval.
        timeline: keep the sampled series in :attr:`CallMemory.timeline`.
    """
    m = CallMemory()
    if trim_heap:
        m.heap_trimmed = memory.trim_heap()
    sampler = _Sampler(interval_s, timeline)
    m.peak_reset_ok = memory.reset_peak_rss()
    m.baseline_rss_bytes = memory.rss_bytes()
    try:
        with sampler:
            yield m
    finally:
        m.peak_rss_bytes = memory.peak_rss_bytes()
        m.baseline_anon_bytes, m.peak_anon_bytes = sampler.baseline_bytes, sampler.peak_bytes
        m.samples = sampler.samples
        if sampler.series:
            t0 = sampler.series[0][0]
            m.timeline = [[round(t - t0, 6), rss - m.baseline_rss_bytes, anon - m.baseline_anon_bytes]
                          for t, rss, anon in sampler.series]


def synthetic_data(manifest, n_windows: int, seed: int):
    """Seeded windows of the bundle's input shape and labels its loss takes (``None`` if label-free)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    X = rng.standard_normal((n_windows, *manifest.input.shape[1:])).astype(np.float32)
    spec = manifest.label
    if spec is None:
        return X, None
    if manifest.loss == "cross_entropy":
        return X, (np.arange(n_windows) % int(spec["n_classes"])).astype(np.int64)
    return X, rng.uniform(0.0, 1.0, [n_windows, *spec["shape"][1:]]).astype(np.float32)


def run_measurement(spec: MeasureSpec) -> dict[str, Any]:
    """The measuring process's body (steps 2-4 of the module doc), in this process; the report.

    Run it in a fresh process (:func:`measure_in_fresh_process`): in a process that already
    adapted, the runner's first-use costs are paid and no longer show.
    """
    from .runtime import Runner

    imported = memory.status_fields("VmRSS", "RssAnon")
    runner = Runner.load(spec.bundle, device=spec.device, threads=spec.threads, backend=spec.backend)
    loaded = memory.status_fields("VmRSS", "RssAnon")
    m = runner.manifest
    plan = m.plan or {}
    if spec.adapt_data:
        from .datasets import WindowDataset

        data = WindowDataset.load_npz(spec.adapt_data)
        X, y = data.X, (data.y if m.label is not None else None)
    else:
        X, y = synthetic_data(m, spec.n_windows or plan.get("n_windows") or 32, spec.seed)
    batch = spec.batch_windows or plan.get("batch_windows") or 32
    if spec.predict_first:
        runner.predict(X)
    settings = None
    if spec.method == "unlabeled":  # built (and its module imported) before the baseline, as a user's script does
        from .runtime.unlabeled import UnlabeledSettings

        settings = UnlabeledSettings.from_dict(spec.unlabeled or {})
    with measure_call(trim_heap=spec.trim_heap, timeline=spec.timeline) as call:
        result = _measured_call(runner, spec, X, y, batch, settings)
    report = {
        "spec": asdict(spec), "device": runner.device, "backend": runner.backend,
        "torch_imported": any(k == "torch" or k.startswith("torch.") for k in sys.modules),
        "n_windows": int(len(X)), "budget_bytes": plan.get("budget_bytes"), **call.figures(),
        # the runner's own view of the call from inside
        "runner_call_peak_bytes": result.call_peak_bytes, "runner_call_peak_anon_bytes": result.call_peak_anon_bytes,
        "timeline": call.timeline,
    }
    if spec.method == "unlabeled":
        report.update(kept=result.kept, stages=list(result.stages), time_s=result.time_s)
    else:
        report.update({
            "batch_windows": batch, "epochs": spec.epochs, "steps": result.steps,
            "epoch_losses": list(result.epoch_losses), "adapt_time_s": result.time_s,
            "trainable_numel": m.trainable_numel, "total_numel": m.total_numel,
            "predicted_peak_bytes": plan.get("predicted_peak_bytes"),
            "load_rss_bytes": loaded["VmRSS"] - imported["VmRSS"],
            "load_anon_bytes": loaded["RssAnon"] - imported["RssAnon"],
            # the runner's largest step
            "step_peak_bytes": result.step_peak_bytes, "step_peak_anon_bytes": result.step_peak_anon_bytes,
        })
    if spec.eval_data:
        from .datasets import WindowDataset

        ev = WindowDataset.load_npz(spec.eval_data)
        report["accuracy"] = runner.evaluate(ev.X, ev.y).accuracy
        report["n_eval_windows"] = int(len(ev.y))
    return report


def _measured_call(runner, spec: MeasureSpec, X, y, batch: int, settings):
    """The one call the protocol measures (:attr:`MeasureSpec.method`; ``settings``: label-free's)."""
    if spec.method == "bn-stats":
        return runner.update_bn_statistics(X, y, epochs=spec.epochs, batch_size=batch, seed=spec.seed,
                                           progress=spec.progress)
    if spec.method == "unlabeled":
        return runner.adapt_unlabeled(X, settings)
    return runner.adapt(X, y, epochs=spec.epochs, batch_size=batch, lr=spec.lr, seed=spec.seed,
                        progress=spec.progress, micro_batch=spec.micro_batch)


def measure_in_fresh_process(spec: MeasureSpec, *, timeout_s: float = 900,
                             env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run :func:`run_measurement` in a fresh interpreter where torch cannot be imported.

    Args:
        spec: what to measure.
        timeout_s: wall-clock limit of the process.
        env: extra environment variables (e.g. ``OMP_NUM_THREADS``).

    Raises:
        RuntimeError: the process failed (its stderr's end in the message) or imported torch.
    """
    with tempfile.TemporaryDirectory(prefix="edgeadapt-measure-") as scratch:
        spec_path, report_path = Path(scratch) / "spec.json", Path(scratch) / "report.json"
        spec_path.write_text(json.dumps(asdict(spec)))
        child_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        child_env.update(env or {})
        proc = subprocess.run([sys.executable, "-m", "edgeadapt.measure", str(spec_path), str(report_path)],
                              capture_output=True, text=True, timeout=timeout_s, env=child_env)
        if proc.returncode != 0:
            raise RuntimeError(f"the measuring process failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        report = json.loads(report_path.read_text())
    if report["torch_imported"]:
        raise RuntimeError("internal: the measuring process imported torch")
    return report


def main(argv: list[str] | None = None) -> int:
    """``python -m edgeadapt.measure SPEC.json REPORT.json``: forbid torch, measure, write the report."""
    from .harness.isolation import forbid_torch

    forbid_torch()  # before anything of the runner is imported
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m edgeadapt.measure SPEC.json REPORT.json", file=sys.stderr)
        return 2
    from .atomic import atomic_write_json

    spec = MeasureSpec.from_dict(json.loads(Path(args[0]).read_text()))
    atomic_write_json(args[1], run_measurement(spec))
    return 0


if __name__ == "__main__":
    sys.exit(main())
