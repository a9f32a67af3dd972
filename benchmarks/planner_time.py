"""Planner time and the rematerialisation DP against sqrt(n) checkpointing, on a long chain.

A seeded synthetic chain (``edgeadapt.sched.remat_timing.synthetic_chain``: saved bytes
1-63 KiB, recompute FLOPs 10^4-10^6) of ``--ops`` elements; for limits between the least
achievable activation peak and the keep-everything peak, prints the DP's recompute FLOPs and
planning time next to sqrt(n) checkpointing's peak and FLOPs. Times are wall-clock and process
CPU time (the CPU figure is less sensitive to other tenants of a shared machine). The first call
builds the chain's limit-independent tables (cached for the later calls). A figure, not a timed test.

Usage::

    .venv/bin/python benchmarks/planner_time.py --ops 500
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edgeadapt.sched.remat_timing import time_chain_planner  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ops", type=int, default=500)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--max-front", type=int, default=64)
    args = p.parse_args(argv)
    r = time_chain_planner(args.ops, args.seed, (0.9, 0.5, 0.25), args.max_front)
    print(f"chain of {r['n_ops']} ops, seed {r['seed']}, max_front {r['max_front']}")
    print(f"keep everything: peak {r['keep_all_peak_bytes']}, recompute FLOPs 0")
    print(f"sqrt(n) checkpointing: peak {r['sqrt_peak_bytes']}, recompute FLOPs {r['sqrt_recompute_flops']}")
    print(f"least peak (bisection + DP): peak {r['min_peak_bytes']}, recompute FLOPs {r['min_peak_recompute_flops']}, "
          f"{r['min_peak_s']:.3f} s wall, {r['min_peak_cpu_s']:.3f} s CPU")
    for row in r["limits"]:
        print(f"limit {row['limit_bytes']}: DP recompute FLOPs {row['min_flops_recompute_flops']}, "
              f"peak {row['min_flops_peak_bytes']}, {row['min_flops_s']:.3f} s wall, "
              f"{row['min_flops_cpu_s']:.3f} s CPU")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
