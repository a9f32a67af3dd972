"""Server training with state offloaded to host memory or disk, against in-memory training.

What it measures, in one invocation on one GPT-style decoder (``build_gpt``; the shape is
printed), at budgets of its parameters + gradients + AdamW state divided by each of
``--ratios`` (default 8 and 32):

1. In ``--rounds`` interleaved rounds, each of *in-memory* (plain ``torch.optim.AdamW``,
   foreach, everything resident), then *host* and *disk*
   (``edgeadapt.server.Trainer(offload=..., memory_budget=...)``, the planner's plan) at every
   ratio, in a fresh process that builds the same seeded model, runs one warm-up step, then
   ``--steps`` timed steps on the same synthetic token batches. Per run:

   * tokens/s over the timed steps, and the ratio to the same round's in-memory run (the
     machine is shared: quote ratios, not absolute speeds; the load average before and after
     each round is printed); and tokens per CPU-second of the whole process (every thread):
     on a machine whose CPUs are contended the scheduler shares CPU time per thread, so a
     process with more runnable threads (prefetch, update, I/O) gets more of it and its
     wall-clock ratio can exceed 1; the CPU-time ratio measures the work the offload adds;
   * the plan (recomputed blocks, micro-batch windows, update chunk, how far each block's update
     overlaps the next block's backward);
   * the trainer's tracked peak of the compute tier (``Trainer.tracked_peak_bytes``: every
     byte the executor reserves for weights, prefetched weights, gradients, staged optimizer
     state and activations) next to the budget;
   * process RSS (VmRSS/VmHWM) and anonymous RSS (RssAnon; its high-water mark sampled every
     2 ms) at three points: after ``import torch`` and the project (torch alone holds ~140 MiB
     of anonymous memory), after the model and trainer were built (the *loaded baseline*; by
     default heap freed while loading is returned to the OS first, the bound for any history;
     ``--heap as-is`` takes the process as a user's is, where the steps can reuse the heap the
     trainer freed when it took the model's parameters over), and the peak over the warm-up and
     timed steps, with the peak's delta over the loaded baseline (the step's own memory). On this CPU
     machine the host tier *is* process memory, so host-tier RSS holds the whole state; the
     disk tier keeps it in files the executor reads and writes explicitly.

2. Planner: a 48-block GPT (built on the meta device, so no memory is allocated) is traced
   into a block graph and planned for a budget; the time of ``trace_graph`` and of
   ``plan_offload`` (median of repeats) and the plan (prefetch depth, recomputed blocks,
   predicted peak and where) are reported.

Threads: ``torch.set_num_threads(--threads)`` (default 1) and ``OMP_WAIT_POLICY=PASSIVE`` in
every worker (printed): on this shared 2-core machine two OpenMP threads that spin while the
other is descheduled made plain in-memory steps up to 10x slower. MiB = 2**20 bytes.
Results: a table on stdout and JSON at ``--out`` (default
``benchmarks/results/server_offload.json``).

Usage::

    .venv/bin/python benchmarks/server_offload.py --d-model 192 --n-layers 48   # the README figures, ~10 min
    .venv/bin/python benchmarks/server_offload.py --steps 1 --rounds 1 --ratios 8 --n-layers 16   # quicker
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MIB = 2 ** 20


def _gpt_kwargs(args: argparse.Namespace) -> dict:
    return dict(vocab_size=args.vocab_size, context_len=args.context_len, d_model=args.d_model,
                n_layers=args.n_layers, n_heads=args.n_heads)


# ---- worker: one mode in a fresh process ------------------------------------------------
def worker(args: argparse.Namespace) -> dict:
    import torch

    from edgeadapt.memory import AnonPeakSampler, peak_rss_bytes, reset_peak_rss, status_fields, trim_heap
    from edgeadapt.models import build_gpt, token_cross_entropy
    from edgeadapt.server.data import TokenStream

    torch.set_num_threads(args.threads)
    imported = status_fields("VmRSS", "RssAnon")
    torch.manual_seed(0)
    model = build_gpt("gpt-nano", **_gpt_kwargs(args))
    data = TokenStream(args.vocab_size, args.context_len, args.batch_size, seed=1)
    batches = [data.batch(i) for i in range(args.steps + 1)]
    n_params = sum(p.numel() for p in model.parameters())
    result: dict = {"mode": args.worker, "n_params": n_params}
    with tempfile.TemporaryDirectory(prefix="offload-", dir=args.offload_dir) as tmp:
        if args.worker == "memory":
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, foreach=True)

            def step(x, y):
                opt.zero_grad(set_to_none=True)
                loss = token_cross_entropy(model(x), y)
                loss.backward()
                opt.step()
                return float(loss.detach())
            trainer = None
        else:
            from edgeadapt.optimizer_config import OptimizerConfig
            from edgeadapt.server import Trainer

            trainer = Trainer(model, loss=token_cross_entropy,
                              optimizer=OptimizerConfig("adamw", lr=1e-3, weight_decay=0.01),
                              memory_budget=int(args.budget), offload=args.worker, offload_dir=Path(tmp) / "state",
                              device="cpu", recompute="auto", example_input=batches[0][0])
            del model

            def step(x, y):
                return float(trainer.step(x, y))
        if args.heap == "trimmed":
            trim_heap()  # the measuring protocol's bound (docs/design.md, "Measuring")
        base = status_fields("VmRSS", "RssAnon")
        reset_peak_rss()
        with AnonPeakSampler(interval_s=0.002) as anon:
            t0 = time.perf_counter()
            first_loss = step(*batches[0])
            warm_s = time.perf_counter() - t0
            times = []
            cpu0 = time.process_time()
            for x, y in batches[1:]:
                t0 = time.perf_counter()
                last_loss = step(x, y)
                times.append(time.perf_counter() - t0)
            cpu_s = time.process_time() - cpu0  # every thread of the process
        result.update(
            first_loss=first_loss, last_loss=last_loss, warmup_s=warm_s, step_s=times,
            tokens_per_s=args.batch_size * args.context_len * len(times) / sum(times), cpu_s=cpu_s,
            tokens_per_cpu_s=args.batch_size * args.context_len * len(times) / cpu_s,
            import_rss_bytes=imported["VmRSS"], import_anon_bytes=imported["RssAnon"],
            baseline_rss_bytes=base["VmRSS"], baseline_anon_bytes=base["RssAnon"],
            peak_rss_bytes=peak_rss_bytes(), peak_anon_bytes=anon.peak_bytes, anon_samples=anon.samples)
        result["peak_rss_delta_bytes"] = result["peak_rss_bytes"] - base["VmRSS"]
        result["peak_anon_delta_bytes"] = max(0, anon.peak_bytes - base["RssAnon"])
        if trainer is not None:
            result["tracked_peak_bytes"] = int(trainer.tracked_peak_bytes)
            # the trainer's own probe (RssAnon at block boundaries), against the 2-ms sampler's absolute peak
            result["trainer_sampled_peak_anon_bytes"] = trainer.process_memory.peak_bytes
            result["trainer_samples"] = trainer.process_memory.samples
            plan = trainer.plan
            result["plan"] = {"recomputed": len(plan.recomputed), "blocks": len(plan.activations),
                              "micro_batch_windows": plan.micro_batch_windows,
                              "update_chunk_numel": plan.update_chunk_numel, "prefetch_depth": plan.prefetch_depth,
                              "update_overlap": plan.update_overlap.value,
                              "predicted_peak_bytes": plan.predicted.peak_bytes}
            residency = trainer.residency()
            result["residency"] = residency if isinstance(residency, dict) else str(residency)
            close = getattr(trainer, "close", None)
            if close:
                close()
    return result


def _run_worker(mode: str, args: argparse.Namespace, budget: int | None) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = Path(f.name)
    cmd = [sys.executable, __file__, "--worker", mode, "--json", str(out), "--steps", str(args.steps),
           "--threads", str(args.threads), "--budget", str(budget or 0), "--batch-size", str(args.batch_size),
           "--vocab-size", str(args.vocab_size), "--context-len", str(args.context_len),
           "--d-model", str(args.d_model), "--n-layers", str(args.n_layers), "--n-heads", str(args.n_heads),
           "--heap", args.heap]
    if args.offload_dir:
        cmd += ["--offload-dir", args.offload_dir]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "OMP_WAIT_POLICY": "PASSIVE", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode:
        raise RuntimeError(f"{mode} worker failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    try:
        return json.loads(out.read_text())
    finally:
        out.unlink(missing_ok=True)


# ---- planner ----------------------------------------------------------------------------
def planner_figures(args: argparse.Namespace) -> dict:
    import torch

    from edgeadapt.models import build_gpt
    from edgeadapt.sched.offload import plan_offload
    from edgeadapt.units import parse_bytes
    from edgeadapt.server.trace import trace_graph

    kwargs = dict(vocab_size=args.vocab_size, context_len=args.context_len, d_model=args.d_model,
                  n_layers=48 - 3, n_heads=args.n_heads)     # embed + 45 decoder blocks + norm + head
    with torch.device("meta"):
        model = build_gpt("gpt-nano", **kwargs)
    example = torch.zeros(args.batch_size, args.context_len, dtype=torch.long)
    t0 = time.perf_counter()
    graph = trace_graph(model, example)
    trace_s = time.perf_counter() - t0
    budget = parse_bytes(args.plan_budget)
    plan_times, plan = [], None
    for _ in range(args.plan_repeats):
        t0 = time.perf_counter()
        plan = plan_offload(graph, budget, batch_windows=args.batch_size, tier="disk", recompute="auto")
        plan_times.append(time.perf_counter() - t0)
    recomputed = [name for name, action in plan.activations if str(getattr(action, "value", action)) == "recompute"]
    state_bytes = 16 * sum(p.numel() for p in model.parameters())
    return {"n_blocks": len(graph.ops), "model": kwargs, "state_bytes": state_bytes, "budget_bytes": budget,
            "trace_s": trace_s, "plan_s_median": statistics.median(plan_times), "plan_repeats": args.plan_repeats,
            "prefetch_depth": plan.prefetch_depth, "recomputed_blocks": len(recomputed),
            "predicted_peak_bytes": plan.predicted.peak_bytes, "predicted_peak_where": plan.predicted.where,
            "plan": plan.to_dict() if hasattr(plan, "to_dict") else None}


# ---- main -------------------------------------------------------------------------------
def _load() -> float:
    return os.getloadavg()[0]


def _spread(values: list[float]) -> str:
    return (f"{statistics.median(values):.2f}x ({min(values):.2f}-{max(values):.2f})" if len(values) > 1
            else f"{values[0]:.2f}x")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=3, help="timed steps per run (after one warm-up step)")
    p.add_argument("--rounds", type=int, default=2,
                   help="interleaved rounds: each round runs in-memory, then host and disk at every ratio")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (default 1: the other core is left to the prefetch thread, and "
                        "2 spinning OpenMP threads on a shared 2-core machine measured up to 10x slower)")
    p.add_argument("--ratios", default="8,32", help="state / budget ratios of the offloaded runs (comma-separated)")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--vocab-size", type=int, default=512)
    p.add_argument("--context-len", type=int, default=64)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--n-layers", type=int, default=24)
    p.add_argument("--n-heads", type=int, default=4)
    p.add_argument("--plan-repeats", type=int, default=20)
    p.add_argument("--plan-budget", default="64MiB", help="budget of the 48-block planner figure")
    p.add_argument("--heap", choices=("trimmed", "as-is"), default="trimmed",
                   help="the loaded baseline: heap freed while loading returned to the OS first (the bound, "
                        "default), or the process as a user's is (the step may reuse that freed heap)")
    p.add_argument("--offload-dir", default=None, help="folder for the disk tier's files (default: the temp dir)")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "server_offload.json"))
    p.add_argument("--worker", choices=("memory", "host", "disk"), help=argparse.SUPPRESS)
    p.add_argument("--budget", help=argparse.SUPPRESS)  # a worker's budget in bytes
    p.add_argument("--json", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        Path(args.json).write_text(json.dumps(worker(args)))
        return 0

    from edgeadapt.models import GPTConfig

    cfg = GPTConfig(**_gpt_kwargs(args))
    state = 16 * cfg.n_params             # fp32 weights + gradients + two AdamW moments
    ratios = [float(r) for r in args.ratios.split(",")]
    budgets = {r: int(state / r) for r in ratios}
    print(f"model: GPT {cfg.n_layers} blocks, d_model {cfg.d_model}, vocab {cfg.vocab_size}, context "
          f"{cfg.context_len}: {cfg.n_params:,} parameters; params+grads+AdamW state {state / MIB:.1f} MiB; budgets "
          + ", ".join(f"{budgets[r] / MIB:.2f} MiB (state {r:g}x)" for r in ratios))
    print(f"batch {args.batch_size} x {args.context_len} tokens, {args.steps} timed steps after 1 warm-up, "
          f"{args.rounds} interleaved rounds, torch threads {args.threads} (OMP_WAIT_POLICY=PASSIVE), "
          f"loaded baseline: heap {args.heap}, "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, load average {_load():.1f}")
    started = time.perf_counter()
    planner = planner_figures(args)
    print(f"planner, {planner['n_blocks']}-block GPT ({planner['state_bytes'] / MIB:.0f} MiB of state, disk tier, "
          f"budget {planner['budget_bytes'] / MIB:.0f} MiB): trace {planner['trace_s'] * 1e3:.0f} ms, "
          f"plan_offload {planner['plan_s_median'] * 1e3:.1f} ms (median of {planner['plan_repeats']}); "
          f"prefetch depth {planner['prefetch_depth']}, {planner['recomputed_blocks']} blocks recomputed, "
          f"predicted peak {planner['predicted_peak_bytes'] / MIB:.1f} MiB at {planner['predicted_peak_where']}",
          flush=True)
    rounds = []
    for k in range(args.rounds):
        load_before = _load()
        runs = {"memory": _run_worker("memory", args, None)}
        for r in ratios:
            for mode in ("host", "disk"):
                runs[f"{mode}@{r:g}x"] = _run_worker(mode, args, budgets[r])
        base = runs["memory"]["tokens_per_s"]
        base_cpu = runs["memory"]["tokens_per_cpu_s"]
        rounds.append({"load_before": load_before, "load_after": _load(), "runs": runs,
                       "ratio": {key: run["tokens_per_s"] / base for key, run in runs.items()},
                       "cpu_ratio": {key: run["tokens_per_cpu_s"] / base_cpu for key, run in runs.items()}})
        print(f"  round {k + 1}: load {load_before:.1f} -> {_load():.1f}; in-memory {base:,.0f} tokens/s; "
              + ", ".join(f"{key} {v:.2f}x" for key, v in rounds[-1]["ratio"].items() if key != "memory"), flush=True)
    rows = []
    print()
    print("| state / budget | tier | throughput vs in-memory (median, range) | tokens per CPU-second vs in-memory | "
          "plan: recomputed / micro-batch / chunk / update | tracked peak / budget | "
          "process peak RSS over loaded (anonymous) | loss first -> last |")
    print("|---|---|---|---|---|---|---|---|")
    mem = [rd["runs"]["memory"] for rd in rounds]
    print(f"| - | in-memory | 1.00x ({statistics.median(r['tokens_per_s'] for r in mem):,.0f} tokens/s) | 1.00x | - | "
          f"everything resident | +{max(r['peak_rss_delta_bytes'] for r in mem) / MIB:.0f} MiB "
          f"(+{max(r['peak_anon_delta_bytes'] for r in mem) / MIB:.0f}) | "
          f"{mem[0]['first_loss']:.3f} -> {mem[0]['last_loss']:.3f} |")
    for r in ratios:
        for mode in ("host", "disk"):
            key = f"{mode}@{r:g}x"
            runs = [rd["runs"][key] for rd in rounds]
            ratio = [rd["ratio"][key] for rd in rounds]
            cpu_ratio = [rd["cpu_ratio"][key] for rd in rounds]
            plan = runs[0]["plan"]
            row = {"ratio": r, "mode": mode, "throughput_vs_memory": ratio, "cpu_throughput_vs_memory": cpu_ratio,
                   "budget_bytes": budgets[r],
                   "tracked_peak_bytes": [x["tracked_peak_bytes"] for x in runs],
                   "peak_rss_delta_bytes": [x["peak_rss_delta_bytes"] for x in runs],
                   "peak_anon_delta_bytes": [x["peak_anon_delta_bytes"] for x in runs],
                   "trainer_peak_anon_delta_bytes": [max(0, x["trainer_sampled_peak_anon_bytes"]
                                                         - x["baseline_anon_bytes"]) for x in runs], "plan": plan}
            rows.append(row)
            print(f"| {r:g}x | {mode} | {_spread(ratio)} | {_spread(cpu_ratio)} | "
                  f"{plan['recomputed']}/{plan['blocks']} blocks, "
                  f"{plan['micro_batch_windows']} of {args.batch_size} windows, {plan['update_chunk_numel']:,}"
                  f"{'' if plan['update_overlap'] == 'backward' else ', update overlap: ' + plan['update_overlap']} | "
                  f"{max(row['tracked_peak_bytes']) / MIB:.2f} / {budgets[r] / MIB:.2f} MiB | "
                  f"+{max(row['peak_rss_delta_bytes']) / MIB:.1f} MiB "
                  f"(+{max(row['peak_anon_delta_bytes']) / MIB:.1f}) | "
                  f"{runs[0]['first_loss']:.3f} -> {runs[0]['last_loss']:.3f} |")
    print("\nThe trainer's own figure (Trainer.process_peak_bytes: RssAnon sampled at block boundaries), over "
          "the same loaded baseline, against the 2-ms sampler's: "
          + "; ".join(f"{row['mode']} {row['ratio']:g}x +{max(row['trainer_peak_anon_delta_bytes']) / MIB:.1f} vs "
                      f"+{max(row['peak_anon_delta_bytes']) / MIB:.1f} MiB" for row in rows))
    total_s = time.perf_counter() - started
    print(f"benchmark time {total_s:.0f} s, load average at the end {_load():.1f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": {**vars(args), "n_params": cfg.n_params, "state_bytes": state,
                                          "budgets": {f"{r:g}": b for r, b in budgets.items()}},
                               "rounds": rounds, "table": rows, "planner": planner, "total_s": total_s},
                              indent=2, default=str) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
