"""How much anonymous memory an inference pass holds per window, against the graph IR's live bytes.

The device cost model counts activations as the graph IR's bytes times a fitted factor. This
script measures where that factor comes from: for each reference model (8 x 256 windows, the
whole model as one ONNX Runtime inference session, memory arena and memory pattern off, as the
runner's feature session runs it), one pass over 4 and over 30 windows in a fresh process, freed
heap returned to the OS before each pass; the anonymous peak (sampled RssAnon) per extra window,
``(peak(30) - peak(4)) / 26``, over the IR's largest live bytes per window. Run once with the C
library's default heap and once with a fixed mmap threshold (``--mmap-threshold``, glibc's
``mallopt(M_MMAP_THRESHOLD)``: every larger request mapped and unmapped on its own), which tells
how much of the factor is the heap's fragmentation rather than tensors alive. (A sampled peak can
miss a short-lived mapping: the fixed-threshold figures are lower bounds.)

Usage::

    .venv/bin/python benchmarks/inference_heap.py [--models cnn mobilenet transformer]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MODELS = ("cnn", "mobilenet", "transformer")
CHANNELS, CLASSES, TIME_STEPS = 8, 7, 256
SMALL, LARGE = 4, 30


def measure(model_name: str, mmap_threshold: int | None) -> dict:
    """One model in this process: (IR live bytes per window, anonymous peak of a pass at SMALL
    and LARGE windows)."""
    import numpy as np
    import onnxruntime as ort
    import torch

    from edgeadapt.export.onnx_export import to_onnx
    from edgeadapt.export.prepare import prepare_model
    from edgeadapt.export.sched_graph import graph_from_onnx
    from edgeadapt.memory import measure_peak, trim_heap
    from edgeadapt.models import build_model
    from edgeadapt.sched import UpdatePolicy
    from edgeadapt.sched.cost import live_bytes
    from edgeadapt.server.allocator import set_mmap_threshold

    if mmap_threshold is not None and not set_mmap_threshold(mmap_threshold):
        raise SystemExit("this C library has no mallopt(M_MMAP_THRESHOLD)")
    torch.manual_seed(0)
    prepared = prepare_model(build_model(model_name, CHANNELS, CLASSES, TIME_STEPS).eval(), UpdatePolicy.full())
    example = torch.randn(2, CHANNELS, TIME_STEPS)
    proto, entries = to_onnx(prepared.module, example, prepared.entries)
    graph = graph_from_onnx(proto, entries, example.shape)
    live = live_bytes(graph)
    options = ort.SessionOptions()
    options.enable_cpu_mem_arena = False
    options.enable_mem_pattern = False
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    rng = np.random.default_rng(0)
    session.run(None, {name: rng.standard_normal((1, CHANNELS, TIME_STEPS), dtype=np.float32)})  # kernels loaded
    peaks = {}
    for windows in (SMALL, LARGE):
        batch = rng.standard_normal((windows, CHANNELS, TIME_STEPS), dtype=np.float32)
        trim_heap()
        with measure_peak(anon_interval_s=0.0005) as m:
            session.run(None, {name: batch})
        peaks[windows] = m.anon_peak_bytes - m.anon_baseline_bytes
    return {"model": model_name, "ir_live_bytes_per_window": max(live), "anon_peak_bytes": peaks,
            "anon_bytes_per_window": (peaks[LARGE] - peaks[SMALL]) / (LARGE - SMALL)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    p.add_argument("--mmap-threshold", type=int, default=128 * 1024,
                   help="the fixed threshold of the second run, bytes (default 131072)")
    p.add_argument("--one", help=argparse.SUPPRESS)  # worker: one model, JSON on stdout
    p.add_argument("--fixed", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(measure(args.one, args.fixed)))
        return 0
    print("| model | heap | IR live / window | measured / window | measured / IR |")
    print("|---|---|---:|---:|---:|")
    for model_name in args.models:
        for label, fixed in (("default", None), (f"mmap threshold {args.mmap_threshold}", args.mmap_threshold)):
            cmd = [sys.executable, __file__, "--one", model_name] + ([] if fixed is None else ["--fixed", str(fixed)])
            r = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
            per = r["anon_bytes_per_window"]
            print(f"| {model_name} | {label} | {r['ir_live_bytes_per_window'] / 1024:.0f} KiB | {per / 1024:.0f} KiB "
                  f"| {per / r['ir_live_bytes_per_window']:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
