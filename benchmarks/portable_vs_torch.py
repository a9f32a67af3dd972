"""Portable step graphs vs torch eager vs onnxruntime-training: step time and whole-call memory.

One invocation, on the reference models (``edgeadapt.models``: cnn, mobilenet, transformer) x
update policies (full, channel subset, last layer), each exported once with both engines
(``export_bundle(..., backend="both")``), batch ``--batch-size`` x 8 channels x
``--time-steps``, cross-entropy, AdamW (lr 1e-3, weight decay 0.01), ``--threads`` threads:

1. **Step time.** A fresh process per (model, policy, engine) loads its engine and times
   ``Runner.train_step`` (portable or ort-training backend, torch blocked in that process) or a
   torch eager step (same weights, BatchNorm frozen like the bundle's, ``requires_grad`` only on
   what the policy trains, ``torch.optim.AdamW``; channel subsets train the whole tensors with a
   gradient mask) on one fixed batch: ``--warmup`` steps, then the median of at least
   ``--steps`` steps and ``--min-time-s`` seconds. The process also records the share of the
   CPUs that other processes took while it timed (from /proc/stat).
2. **Whole adapt call.** :func:`edgeadapt.measure.measure_in_fresh_process` (the project's one
   measuring protocol: torch-free fresh process, baseline just before ``adapt``, heap trimmed
   first) for the portable and the ort-training backend of the same bundle, i.e. the same plan:
   anonymous and total peak of the call, beside the plan's ``predicted_peak_bytes``.

Rounds are interleaved: every round runs every (model, policy) for every engine in an order that
rotates from round to round, so the other tenants' load hits all engines alike. Figures are
medians over the rounds (speed: over the rounds where others took < 50% of the CPUs when there
are such, else all rounds, flagged). Markdown table on stdout, JSON at ``--out``; KiB = 1024 bytes.

Usage::

    .venv/bin/python benchmarks/portable_vs_torch.py                      # 32 x 8 x 1024, 1 thread
    .venv/bin/python benchmarks/portable_vs_torch.py --time-steps 256 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from edgeadapt.versions import cpu_jiffies, host_info  # noqa: E402  (stdlib only)

log = logging.getLogger("portable_vs_torch")

N_CHANNELS, N_CLASSES = 8, 6
MODELS = ("cnn", "mobilenet", "transformer")
ENGINES = ("portable", "torch", "ort-training")
BACKENDS = ("portable", "ort-training")
CONTENDED_SHARE = 0.5
KiB = 1024


def channel_rules(model: str):
    """The channel-subset policy of each reference model (the parity tests' choice)."""
    from edgeadapt.export import Rule

    return {
        "cnn": (Rule("blocks.0.conv", "channels", ratio=0.5), Rule("blocks.3.conv", "channels", ratio=0.25),
                Rule("head", "full")),
        "mobilenet": (Rule("stem.conv", "channels", ratio=0.5), Rule("blocks.*.project.conv", "channels", ratio=0.25),
                      Rule("head", "full")),
        "transformer": (Rule("patch_embed", "channels", ratio=0.5), Rule("layers.*.attn.q", "channels", ratio=0.25),
                        Rule("head", "full")),
    }[model]


def make_policy(model: str, name: str):
    from edgeadapt.export import UpdatePolicy

    if name == "full":
        return UpdatePolicy.full()
    if name == "last_layer":
        return UpdatePolicy.last_layer("head")
    return UpdatePolicy(rules=channel_rules(model))


POLICIES = ("full", "channels", "last_layer")


# ---- worker side ----------------------------------------------------------------------------


def _runner_step(spec: dict):
    from edgeadapt.runtime import Runner

    runner = Runner.load(spec["bundle"], device="cpu", threads=spec["threads"], backend=spec["engine"])
    assert runner.backend == spec["engine"], runner.backend
    return runner.train_step


def _torch_step(spec: dict):
    import numpy as np
    import torch

    from edgeadapt.bundle import read_manifest
    from edgeadapt.models import build_model

    torch.set_num_threads(spec["threads"])
    manifest = read_manifest(spec["bundle"], verify=False)
    masks = np.load(Path(spec["bundle"]) / manifest.files["masks"])
    model = build_model(spec["model"], N_CHANNELS, N_CLASSES, spec["time_steps"])
    model.load_state_dict(torch.load(spec["state_dict"], weights_only=True))
    model.eval()  # BatchNorm on running statistics, as the bundle's frozen BatchNorm
    params = dict(model.named_parameters())
    trained = []
    for e in manifest.parameters:
        p = params[e.name]
        p.requires_grad_(e.trainable_numel > 0)
        if e.trainable_numel:
            trained.append(p)
            if e.mode == "channels":
                mask = torch.from_numpy(masks[e.name]).to(p.dtype).reshape(-1, *([1] * (p.dim() - 1)))
                p.register_hook(lambda g, m=mask: g * m)
    o = manifest.optimizer
    opt = torch.optim.AdamW(trained, lr=o["lr"], betas=tuple(o["betas"]), eps=o["eps"], weight_decay=o["weight_decay"])
    loss_fn = torch.nn.CrossEntropyLoss()

    def step(x, y):
        loss = loss_fn(model(torch.from_numpy(x)), torch.from_numpy(y))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss)

    return step


def worker_step(spec: dict) -> dict:
    import numpy as np

    if spec["engine"] != "torch":
        from edgeadapt.harness.isolation import forbid_torch

        forbid_torch()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((spec["batch_size"], N_CHANNELS, spec["time_steps"]), dtype=np.float32)
    y = rng.integers(0, N_CLASSES, spec["batch_size"]).astype(np.int64)
    step = _torch_step(spec) if spec["engine"] == "torch" else _runner_step(spec)
    losses = [step(x, y) for _ in range(spec["warmup"])]
    times: list[float] = []
    busy0, own0 = cpu_jiffies()
    t_loop = time.perf_counter()
    while len(times) < spec["steps"] or sum(times) < spec["min_time_s"]:
        t0 = time.perf_counter()
        losses.append(step(x, y))
        times.append(time.perf_counter() - t0)
    wall_s = time.perf_counter() - t_loop
    busy1, own1 = cpu_jiffies()
    foreign = max(0.0, (busy1 - busy0) - (own1 - own0)) / os.sysconf("SC_CLK_TCK") / (wall_s * os.cpu_count())
    return {"median_step_s": statistics.median(times), "steps": len(times), "foreign_cpu_share": foreign,
            "first_loss": losses[0], "loss_after_warmup": losses[spec["warmup"]]}


def run_step_worker(spec: dict, timeout_s: float = 900) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["OMP_NUM_THREADS"] = str(spec["threads"])
    proc = subprocess.run([sys.executable, os.fspath(Path(__file__).resolve()), "--worker", json.dumps(spec)],
                          capture_output=True, text=True, cwd=REPO, env=env, timeout=timeout_s)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"worker {spec['engine']} {spec['bundle']} failed (rc={proc.returncode}):\n"
                           f"{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


# ---- parent side ----------------------------------------------------------------------------


def export_all(args, tmp: Path) -> dict:
    import torch

    from edgeadapt.export import OptimizerConfig, export_bundle
    from edgeadapt.harness.pretrained_like import as_if_pretrained
    from edgeadapt.models import build_model, count_parameters

    cases = {}
    for model_name in args.models:
        torch.manual_seed(0)
        model = as_if_pretrained(build_model(model_name, N_CHANNELS, N_CLASSES, args.time_steps))
        state_path = tmp / f"{model_name}_state.pt"
        torch.save(model.state_dict(), state_path)
        example = torch.randn(args.batch_size, N_CHANNELS, args.time_steps)
        for pol in args.policies:
            out = tmp / f"{model_name}-{pol}"
            t0 = time.perf_counter()
            m = export_bundle(model, example, out, policy=make_policy(model_name, pol), loss="cross_entropy",
                              optimizer=OptimizerConfig("adamw", lr=1e-3, weight_decay=0.01),
                              batch_windows=args.batch_size, n_windows=args.n_windows, backend="both")
            plan = m.plan or {}
            cases[f"{model_name}/{pol}"] = {
                "model": model_name, "policy": pol, "bundle": os.fspath(out), "state_dict": os.fspath(state_path),
                "total_numel": count_parameters(model), "trainable_numel": m.trainable_numel,
                "predicted_peak_bytes": plan.get("predicted_peak_bytes"), "plan": plan}
            log.info("exported %s/%s in %.0f s: %d of %d elements train, predicted peak %s KiB", model_name, pol,
                     time.perf_counter() - t0, m.trainable_numel, m.total_numel,
                     None if plan.get("predicted_peak_bytes") is None else plan["predicted_peak_bytes"] // KiB)
    return cases


def measure_memory(case: dict, backend: str, args) -> dict:
    from edgeadapt.measure import MeasureSpec, measure_in_fresh_process

    spec = MeasureSpec(bundle=case["bundle"], backend=backend, threads=args.threads, trim_heap=True, seed=0)
    r = measure_in_fresh_process(spec, env={"OMP_NUM_THREADS": str(args.threads)})
    keep = ("backend", "steps", "n_windows", "batch_windows", "adapt_time_s", "predicted_peak_bytes",
            "call_peak_bytes", "call_peak_anon_bytes", "baseline_rss_bytes", "baseline_anon_bytes",
            "load_rss_bytes", "load_anon_bytes", "peak_reset_ok", "heap_trimmed", "epoch_losses")
    return {k: r[k] for k in keep}


def summarise(case: dict) -> dict:
    out = {}
    for eng, rounds in case["step_rounds"].items():
        clean = [r for r in rounds if r["foreign_cpu_share"] < CONTENDED_SHARE]
        use = clean or rounds
        out[eng] = {"median_step_s": statistics.median(r["median_step_s"] for r in use),
                    "clean_rounds": len(clean), "contended": not clean}
    for b, rounds in case["memory_rounds"].items():
        out[f"mem:{b}"] = {k: int(statistics.median(r[k] for r in rounds))
                           for k in ("call_peak_bytes", "call_peak_anon_bytes")}
    return out


def kib(b) -> str:
    return "-" if b is None else f"{b / KiB:.0f}"


def report(res: dict) -> str:
    cfg, host = res["config"], res["host"]
    lines = [
        f"Batch {cfg['batch_size']} x {N_CHANNELS} ch x {cfg['time_steps']} steps, cross-entropy, AdamW, "
        f"{cfg['threads']} thread(s), {cfg['rounds']} interleaved fresh-process rounds; step time = median over "
        f"rounds of the median of >= {cfg['steps']} steps / {cfg['min_time_s']:g} s after {cfg['warmup']} warm-up; "
        f"memory: edgeadapt.measure (whole adapt call over {cfg['n_windows']} windows, heap trimmed), KiB.",
        f"Load average (1 min) {host['loadavg_at_start'][0]:.1f} at start, {host['loadavg_at_end'][0]:.1f} at end, "
        f"on {host['cpu_count']} CPUs.",
        "",
        "| model | policy | trained | step ms portable / torch / ort-tr | portable speed vs torch | vs ort-tr "
        "| anon KiB portable / ort-tr | total KiB portable / ort-tr | predicted KiB | portable anon / predicted |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for key, c in res["cases"].items():
        s = c["summary"]
        p, t, o = (s[e]["median_step_s"] * 1e3 for e in ENGINES)
        flag = " (contended)" if any(s[e]["contended"] for e in ENGINES) else ""
        mp, mo = s["mem:portable"], s["mem:ort-training"]
        pred = c["predicted_peak_bytes"]
        ratio = "-" if not pred else f"{mp['call_peak_anon_bytes'] / pred:.2f}"
        lines.append(f"| {c['model']} | {c['policy']} | {c['trainable_numel']} | {p:.1f} / {t:.1f} / {o:.1f}{flag} | "
                     f"{t / p:.2f}x | {o / p:.2f}x | "
                     f"{kib(mp['call_peak_anon_bytes'])} / {kib(mo['call_peak_anon_bytes'])} | "
                     f"{kib(mp['call_peak_bytes'])} / {kib(mo['call_peak_bytes'])} | {kib(pred)} | {ratio} |")
    lines.append("")
    lines.append("Per round (step ms, share of the CPUs other processes took):")
    for key, c in res["cases"].items():
        cells = [f"{e} " + ", ".join(f"{r['median_step_s'] * 1e3:.1f} ({r['foreign_cpu_share']:.2f})"
                                     for r in c["step_rounds"][e]) for e in ENGINES]
        lines.append(f"  {key:22s} " + " | ".join(cells))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--time-steps", type=int, default=1024)
    ap.add_argument("--n-windows", type=int, default=128, help="windows of the measured adapt call (default 128)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=10, help="timed steps per worker, at least (default 10)")
    ap.add_argument("--min-time-s", type=float, default=1.0)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-memory", action="store_true", help="skip the whole-call memory measurements")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "portable_vs_torch.json")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print("RESULT " + json.dumps(worker_step(json.loads(args.worker))))
        return 0
    if min(args.steps, args.warmup, args.rounds, args.threads) < 1:
        ap.error("--steps, --warmup, --rounds and --threads must be >= 1")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    t_start, load_start = time.perf_counter(), list(os.getloadavg())
    with tempfile.TemporaryDirectory(prefix="portable_vs_torch-") as tmp:
        cases = export_all(args, Path(tmp))
        for c in cases.values():
            c["step_rounds"] = {e: [] for e in ENGINES}
            c["memory_rounds"] = {b: [] for b in BACKENDS}
        for rnd in range(args.rounds):
            for i, (key, c) in enumerate(cases.items()):
                k = (rnd + i) % len(ENGINES)
                for engine in ENGINES[k:] + ENGINES[:k]:  # rotating order
                    spec = {"engine": engine, "model": c["model"], "bundle": c["bundle"], "state_dict": c["state_dict"],
                            "batch_size": args.batch_size, "time_steps": args.time_steps, "threads": args.threads,
                            "warmup": args.warmup, "steps": args.steps, "min_time_s": args.min_time_s}
                    r = run_step_worker(spec)
                    c["step_rounds"][engine].append(r)
                    log.info("round %d %-22s %-12s %.1f ms/step, others %.0f%% CPU", rnd + 1, key, engine,
                             r["median_step_s"] * 1e3, 100 * r["foreign_cpu_share"])
                if not args.no_memory:
                    for b in (BACKENDS if (rnd + i) % 2 == 0 else BACKENDS[::-1]):
                        m = measure_memory(c, b, args)
                        c["memory_rounds"][b].append(m)
                        log.info("round %d %-22s %-12s call anon %s KiB, total %s KiB (predicted %s)", rnd + 1, key, b,
                                 kib(m["call_peak_anon_bytes"]), kib(m["call_peak_bytes"]),
                                 kib(m["predicted_peak_bytes"]))
        for c in cases.values():
            if args.no_memory:
                c["memory_rounds"] = {b: [{"call_peak_bytes": 0, "call_peak_anon_bytes": 0}] for b in BACKENDS}
            c["summary"] = summarise(c)
            c.pop("bundle"), c.pop("state_dict")
    res = {
        "benchmark": "portable_vs_torch",
        "config": {"batch_size": args.batch_size, "time_steps": args.time_steps, "n_windows": args.n_windows,
                   "threads": args.threads, "steps": args.steps, "min_time_s": args.min_time_s, "warmup": args.warmup,
                   "rounds": args.rounds, "contended_share": CONTENDED_SHARE, "models": args.models,
                   "policies": args.policies, "memory": not args.no_memory},
        "host": {"platform": platform.platform(), "cpu_count": os.cpu_count(), **host_info(),
                 "loadavg_at_start": load_start, "loadavg_at_end": list(os.getloadavg())},
        "command": " ".join([".venv/bin/python", os.path.relpath(__file__, REPO),
                             *(argv if argv is not None else sys.argv[1:])]),
        "cases": cases,
    }
    print(report(res))
    res["wall_s"] = time.perf_counter() - t_start
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp_out = args.out.with_suffix(".json.tmp")
    tmp_out.write_text(json.dumps(res, indent=2) + "\n")
    tmp_out.replace(args.out)
    log.info("wrote %s in %.0f s", args.out, res["wall_s"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
