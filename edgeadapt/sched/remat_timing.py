"""Planner time: the rematerialisation DP on a seeded synthetic chain, next to sqrt(n) checkpointing.

One measurement shared by ``benchmarks/planner_time.py`` (several limits, printed) and
``benchmarks/budget_sweep.py`` (one limit, in its report). Times are wall-clock and process CPU
time (the CPU figure is less sensitive to other tenants of a shared machine); the first DP call
builds the chain's limit-independent tables, cached for the later calls. A figure, not a test:
nothing here compares a time against a bound.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from .remat import Chain, chain_flops, chain_peak, min_flops_schedule, min_peak_schedule, sqrt_schedule

__all__ = ["synthetic_chain", "time_chain_planner"]


def synthetic_chain(n_ops: int = 500, seed: int = 0) -> Chain:
    """A seeded chain of ``n_ops`` elements: saved bytes 1-63 KiB, recompute FLOPs 10^4-10^6,
    forward/backward transient bytes of one to two times the saved bytes plus up to 31 KiB."""
    rng = np.random.default_rng(seed)
    saved = rng.integers(1, 64, n_ops) * 1024
    flops = rng.integers(1, 100, n_ops) * 10_000
    fwd = saved + rng.integers(0, 32, n_ops) * 1024
    bwd = 2 * saved + rng.integers(0, 32, n_ops) * 1024
    return Chain(tuple(f"op{i}" for i in range(n_ops)), tuple(int(v) for v in saved), tuple(int(v) for v in flops),
                 tuple(int(v) for v in fwd), tuple(int(v) for v in bwd), tail_fwd=4096, tail_bwd=8192)


def time_chain_planner(n_ops: int = 500, seed: int = 0, limit_fractions: Sequence[float] = (0.5,),
                       max_front: int | None = 64) -> dict[str, Any]:
    """Time the remat DP on :func:`synthetic_chain` ``(n_ops, seed)``.

    First the least peak (``min_peak_schedule``, a bisection), then for each fraction ``f`` of
    ``limit_fractions`` the least recompute FLOPs (``min_flops_schedule``) under the limit
    ``least peak + f * (keep-everything peak - least peak)``.

    Returns:
        ``n_ops``, ``seed``, ``max_front``; the keep-everything peak; the least peak with its
        recompute FLOPs and times (``min_peak_s`` wall, ``min_peak_cpu_s``); sqrt(n)
        checkpointing's peak and FLOPs; and ``limits``: one row per fraction with ``limit_bytes``,
        ``min_flops_s``, ``min_flops_cpu_s`` and the schedule's recompute FLOPs and peak
        (``None`` where no schedule meets the limit).
    """
    chain = synthetic_chain(n_ops, seed)
    keep_all = chain_peak(chain, (False,) * n_ops)
    t0, c0 = time.perf_counter(), time.process_time()
    low, low_schedule = min_peak_schedule(chain, max_front)
    t_peak, c_peak = time.perf_counter() - t0, time.process_time() - c0
    sq = sqrt_schedule(chain)
    limits = []
    for fraction in limit_fractions:
        limit = low + int(fraction * (keep_all - low))
        t0, c0 = time.perf_counter(), time.process_time()
        schedule = min_flops_schedule(chain, limit, max_front)
        limits.append({
            "fraction": fraction, "limit_bytes": limit,
            "min_flops_s": time.perf_counter() - t0, "min_flops_cpu_s": time.process_time() - c0,
            "min_flops_recompute_flops": None if schedule is None else chain_flops(chain, schedule),
            "min_flops_peak_bytes": None if schedule is None else chain_peak(chain, schedule),
        })
    return {
        "n_ops": n_ops, "seed": seed, "max_front": max_front, "keep_all_peak_bytes": keep_all,
        "min_peak_bytes": low, "min_peak_recompute_flops": chain_flops(chain, low_schedule),
        "min_peak_s": t_peak, "min_peak_cpu_s": c_peak,
        "sqrt_peak_bytes": chain_peak(chain, sq), "sqrt_recompute_flops": chain_flops(chain, sq),
        "limits": limits,
    }
