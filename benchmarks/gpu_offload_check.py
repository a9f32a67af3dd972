"""GPU check of the streaming trainer: state >= 4x the GPU budget, throughput vs in-memory training.

Meant for a short run on a lent CUDA machine (an H200 in the project's device pool); on a
machine without CUDA it prints why and exits 0 without measuring anything.

What it measures, in one process, on one seeded GPT-style decoder (``build_gpt``) whose
parameters + gradients + AdamW state (16 bytes per parameter) are at least ``--min-ratio``
(4) times ``--budget``:

1. For each offload tier in ``--tiers`` (host: pinned host memory; disk: files under
   ``--offload-dir``): ``Trainer(device="cuda", memory_budget=budget, offload=tier,
   recompute="auto")``, ``--warmup`` steps, then ``--steps`` timed steps (CUDA synchronised);
   tokens/s, ``Trainer.tracked_peak_bytes`` and ``torch.cuda.max_memory_allocated`` (reset
   before the timed steps; what the CUDA caching allocator handed out: everything the trainer
   and torch allocated on the GPU) against the budget.
2. In-memory baseline: the same model and batches entirely on the GPU with
   ``torch.optim.AdamW(fused=True)``; tokens/s and max_memory_allocated.
3. Ratios: offloaded tokens/s over in-memory tokens/s.

Output: a table on stdout and ``gpu_offload_check.json`` in ``$OUT`` when that is set (else
``benchmarks/results/``). Typical run: 1-3 minutes on an H200 (most of it building the model
and the disk tier's writes).

Needs torch (a CUDA build), numpy and scipy; not onnx or onnxruntime. Usage (from the
repository root; the script puts the repository on ``sys.path``)::

    python benchmarks/gpu_offload_check.py                       # defaults: 320M params (5.1 GB of state), 1 GiB budget
    python benchmarks/gpu_offload_check.py --tiers host --steps 3 --n-layers 12
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
GIB = 2 ** 30


def _batches(args, n: int):
    import torch

    g = torch.Generator().manual_seed(1)
    seq = [torch.randint(0, args.vocab_size, (args.batch_size, args.context_len + 1), generator=g) for _ in range(n)]
    return [(s[:, :-1].contiguous(), s[:, 1:].contiguous()) for s in seq]


def _model(args):
    import torch

    from edgeadapt.models import build_gpt

    torch.manual_seed(0)
    return build_gpt("gpt-small", vocab_size=args.vocab_size, context_len=args.context_len,
                     d_model=args.d_model, n_layers=args.n_layers, n_heads=args.n_heads)


def _cuda(args) -> bool:
    return args.device == "cuda"


def _timed(args, step, batches, warmup: int):
    import torch

    for x, y in batches[:warmup]:
        step(x, y)
    if _cuda(args):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    losses = [step(x, y) for x, y in batches[warmup:]]
    if _cuda(args):
        torch.cuda.synchronize()
    return time.perf_counter() - t0, losses


def _max_allocated(args) -> int:
    import torch

    return int(torch.cuda.max_memory_allocated()) if _cuda(args) else 0


def _trainer_step(trainer, x, y) -> float:
    return float(trainer.step(x, y))


def _in_memory_step(model, opt, device: str, x, y) -> float:
    from edgeadapt.models import token_cross_entropy

    opt.zero_grad(set_to_none=True)
    loss = token_cross_entropy(model(x.to(device, non_blocking=True)), y.to(device, non_blocking=True))
    loss.backward()
    opt.step()
    return float(loss.detach())


def run_offloaded(args, tier: str, batches) -> dict:
    import torch

    from edgeadapt.models import token_cross_entropy
    from edgeadapt.server import Trainer

    with tempfile.TemporaryDirectory(prefix="gpu-offload-", dir=args.offload_dir) as tmp:
        t0 = time.perf_counter()
        trainer = Trainer(_model(args), loss=token_cross_entropy,
                          optimizer={"name": "adamw", "lr": 1e-4, "weight_decay": 0.01},  # no onnx import
                          memory_budget=args.budget, offload=tier, offload_dir=Path(tmp) / "state",
                          device=args.device, recompute="auto", example_input=batches[0][0])
        setup_s = time.perf_counter() - t0
        time_s, losses = _timed(args, functools.partial(_trainer_step, trainer), batches, args.warmup)
        plan = trainer.plan
        out = {"tier": tier, "setup_s": setup_s, "time_s": time_s, "losses": losses,
               "tokens_per_s": args.steps * args.batch_size * args.context_len / time_s,
               "tracked_peak_bytes": int(trainer.tracked_peak_bytes),
               "predicted_peak_bytes": int(plan.predicted.peak_bytes), "predicted_where": plan.predicted.where,
               "micro_batch_windows": plan.micro_batch_windows, "recomputed_blocks": len(plan.recomputed),
               "max_memory_allocated_bytes": _max_allocated(args)}
        close = getattr(trainer, "close", None)
        if close:
            close()
        del trainer
    if _cuda(args):
        torch.cuda.empty_cache()
    return out


def run_in_memory(args, batches) -> dict:
    import torch

    model = _model(args).to(args.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=_cuda(args))
    step = functools.partial(_in_memory_step, model, opt, args.device)
    time_s, losses = _timed(args, step, batches, args.warmup)
    out = {"tier": "in-memory", "time_s": time_s, "losses": losses,
           "tokens_per_s": args.steps * args.batch_size * args.context_len / time_s,
           "max_memory_allocated_bytes": _max_allocated(args)}
    del model, opt, step
    if _cuda(args):
        torch.cuda.empty_cache()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--budget", default="1GiB", help="GPU memory budget of the offloaded runs")
    p.add_argument("--tiers", default="host,disk", help="comma-separated offload tiers to run")
    p.add_argument("--steps", type=int, default=5, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--context-len", type=int, default=512)
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--n-layers", type=int, default=24)
    p.add_argument("--n-heads", type=int, default=16)
    p.add_argument("--min-ratio", type=float, default=4.0, help="required state / budget")
    p.add_argument("--offload-dir", default=None, help="folder for the disk tier (default: a temp dir)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="cpu: a dry run of this script's code on the CPU (pass tiny sizes); figures mean nothing")
    args = p.parse_args()

    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else REPO / "benchmarks" / "results"
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("SKIP: torch sees no CUDA device (torch.cuda.is_available() is False); "
              "this check only runs on a machine with a GPU. Nothing was measured.")
        return 0
    from edgeadapt.models import GPTConfig
    from edgeadapt.units import parse_bytes

    cfg = GPTConfig(vocab_size=args.vocab_size, context_len=args.context_len, d_model=args.d_model,
                    n_layers=args.n_layers, n_heads=args.n_heads)
    budget = parse_bytes(args.budget)
    state = 16 * cfg.n_params
    if state < args.min_ratio * budget:
        print(f"error: the model's state ({state / GIB:.2f} GiB) is under {args.min_ratio}x the budget "
              f"({budget / GIB:.2f} GiB); raise --n-layers/--d-model or lower --budget", file=sys.stderr)
        return 2
    gpu = torch.cuda.get_device_name(0) if _cuda(args) else "cpu (dry run)"
    print(f"{gpu}; torch {torch.__version__}; GPT {cfg.n_layers} blocks x d_model {cfg.d_model}, "
          f"vocab {cfg.vocab_size}: "
          f"{cfg.n_params:,} parameters, state {state / GIB:.2f} GiB = {state / budget:.1f}x the budget "
          f"{budget / GIB:.2f} GiB; batch {args.batch_size} x {args.context_len} tokens, "
          f"{args.warmup} warm-up + {args.steps} timed steps")
    batches = _batches(args, args.warmup + args.steps)
    runs = []
    for tier in [t for t in args.tiers.split(",") if t]:
        try:
            runs.append(run_offloaded(args, tier, batches))
        except Exception as e:  # keep the other measurements of a scarce GPU run
            runs.append({"tier": tier, "error": f"{type(e).__name__}: {e}"})
        print(json.dumps({k: v for k, v in runs[-1].items() if k != "losses"}), flush=True)
    try:
        base = run_in_memory(args, batches)
    except torch.OutOfMemoryError as e:
        base = {"tier": "in-memory", "error": f"OutOfMemoryError: {e}"}
    runs.append(base)
    print()
    print("| run | tokens/s | vs in-memory | plan: micro-batch, recomputed, predicted peak | tracked peak "
          "| max_memory_allocated | budget |")
    print("|---|---|---|---|---|---|---|")
    for r in runs:
        if "error" in r:
            print(f"| {r['tier']} | failed: {r['error'][:120]} | | | | | |")
            continue
        ratio = (f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if "tokens_per_s" in base else "n/a")
        tracked = f"{r['tracked_peak_bytes'] / GIB:.3f} GiB" if "tracked_peak_bytes" in r else "-"
        plan = "-"
        if "predicted_where" in r:
            plan = (f"{r['micro_batch_windows']} windows, {r['recomputed_blocks']} blocks, "
                    f"{r['predicted_peak_bytes'] / GIB:.3f} GiB at {r['predicted_where']}")
        print(f"| {r['tier']} | {r['tokens_per_s']:,.0f} | {ratio} | {plan} | {tracked} | "
              f"{r['max_memory_allocated_bytes'] / GIB:.3f} GiB | {budget / GIB:.2f} GiB |")
        if "tokens_per_s" in base:
            r["ratio_vs_in_memory"] = r["tokens_per_s"] / base["tokens_per_s"]
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "gpu_offload_check.json"
    path.write_text(json.dumps({"gpu": gpu, "torch": torch.__version__, "config": vars(args),
                                "n_params": cfg.n_params, "state_bytes": state, "budget_bytes": budget,
                                "runs": runs}, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
