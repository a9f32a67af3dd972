"""Planner time and the rematerialisation DP against sqrt(n) checkpointing, on a long chain.

A seeded random chain (saved bytes 1-50, recompute FLOPs 1-100, transient bytes 1-60 per
element) of ``--ops`` elements; for limits between the least achievable activation peak and the
keep-everything peak, prints the DP's recompute FLOPs and planning time next to sqrt(n)
checkpointing's peak and FLOPs. Times are wall-clock and process CPU time (the CPU figure is
less sensitive to other tenants of a shared machine). The first call builds the chain's
limit-independent tables (cached for the later calls). A figure, not a timed test.

Usage::

    .venv/bin/python benchmarks/planner_time.py --ops 500
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edgeadapt.sched.remat import (Chain, chain_flops, chain_peak, min_flops_schedule,  # noqa: E402
                                   min_peak_schedule, sqrt_schedule)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ops", type=int, default=500)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--max-front", type=int, default=64)
    args = p.parse_args(argv)
    rng = random.Random(args.seed)
    m = args.ops
    chain = Chain(tuple(f"e{i}" for i in range(m)), tuple(rng.randint(1, 50) for _ in range(m)),
                  tuple(rng.randint(1, 100) for _ in range(m)), tuple(rng.randint(1, 60) for _ in range(m)),
                  tuple(rng.randint(1, 60) for _ in range(m)), rng.randint(0, 60), rng.randint(0, 60))
    keep_all = chain_peak(chain, (False,) * m)
    sq = sqrt_schedule(chain)
    t0, c0 = time.perf_counter(), time.process_time()
    low, low_schedule = min_peak_schedule(chain, args.max_front)
    t_low, c_low = time.perf_counter() - t0, time.process_time() - c0
    print(f"chain of {m} ops, seed {args.seed}, max_front {args.max_front}")
    print(f"keep everything: peak {keep_all}, recompute FLOPs 0")
    print(f"sqrt(n) checkpointing: peak {chain_peak(chain, sq)}, recompute FLOPs {chain_flops(chain, sq)}")
    print(f"least peak (bisection + DP): peak {low}, recompute FLOPs {chain_flops(chain, low_schedule)}, "
          f"{t_low:.3f} s wall, {c_low:.3f} s CPU")
    for frac in (0.9, 0.5, 0.25):
        limit = int(low + frac * (keep_all - low))
        t0, c0 = time.perf_counter(), time.process_time()
        s = min_flops_schedule(chain, limit, args.max_front)
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        print(f"limit {limit}: DP recompute FLOPs {chain_flops(chain, s)}, peak {chain_peak(chain, s)}, "
              f"{dt:.3f} s wall, {dc:.3f} s CPU")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
