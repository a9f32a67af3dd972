"""Rematerialisation for a chain: which saved activations to keep and which to recompute.

The chain is the training graph's *candidates* (ops that need a gradient and save bytes), each
with the ops of its chunk (see :mod:`.cost`). Recomputing candidate ``e`` frees its saved bytes
during the forward and costs the FLOPs of its chunk once more; in the backward a run of
consecutive recomputed candidates is rebuilt at once, so the run's bytes are live together.
With ``K`` the kept bytes before an element, the per-window activation peak is the largest of

* forward at element ``e``: ``K + fwd[e]``; after the last element: ``K_all + tail_fwd``;
* backward at element ``e``: ``K + (saved[e] if kept else run sum up to e) + bwd[e]``;
  after the last element: ``K_all + tail_bwd``.

:func:`min_flops_schedule` finds the keep/recompute choice of least recompute FLOPs whose peak
is within a limit, exactly, by dynamic programming over kept elements with a Pareto front of
(kept bytes, FLOPs) per element; :func:`min_peak_schedule` finds the smallest feasible peak (a
bisection over the limit on a feasibility DP) and the cheapest schedule at it;
:func:`sqrt_schedule` is Chen et al.'s sqrt(n) checkpointing for comparison.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from .cost import ActivationArrays, activation_arrays
from .ir import Graph

__all__ = ["Chain", "chain_from_graph", "chain_peak", "chain_flops", "min_flops_schedule", "min_peak",
           "min_peak_schedule",
           "sqrt_schedule", "brute_force_schedule"]

_NONE = -1  # tail_bwd when no op after the last candidate needs a gradient


@dataclass(frozen=True)
class Chain:
    """Per-element quantities of a chain (bytes per window; FLOPs per window).

    Attributes:
        names: op name of each element (the candidate op).
        saved: saved bytes per element.
        flops: recompute FLOPs per element (its chunk's forward FLOPs).
        fwd: largest forward live bytes over the element's chunk.
        bwd: largest backward transient bytes over the chunk's ops that need a gradient.
        tail_fwd: largest forward live bytes after the last element (0 if none).
        tail_bwd: largest backward transient after the last element (-1 if none).
    """

    names: tuple[str, ...]
    saved: tuple[int, ...]
    flops: tuple[int, ...]
    fwd: tuple[int, ...]
    bwd: tuple[int, ...]
    tail_fwd: int = 0
    tail_bwd: int = _NONE

    def __len__(self) -> int:
        return len(self.saved)


def chain_from_graph(graph: Graph, arr: ActivationArrays | None = None, trained_params: set[str] | None = None,
                     start: int = 0) -> Chain:
    """The chain of a training graph (its candidates and their chunks)."""
    if arr is None:
        arr = activation_arrays(graph, trained_params or set(), start)
    names, saved, flops, fwd, bwd = [], [], [], [], []
    prev = arr.start - 1
    for i in arr.candidates:
        chunk = range(max(prev + 1, arr.start), i + 1)
        names.append(graph.ops[i].name)
        saved.append(arr.saved[i])
        flops.append(sum(graph.ops[j].flops for j in chunk))
        fwd.append(max(arr.live[j] for j in chunk))
        bwd.append(max(arr.grad_transient[j] for j in chunk if arr.grad[j]))
        prev = i
    tail = range(max(prev + 1, arr.start), len(graph.ops))
    tail_fwd = max((arr.live[j] for j in tail), default=0)
    tail_bwd = max((arr.grad_transient[j] for j in tail if arr.grad[j]), default=_NONE)
    return Chain(tuple(names), tuple(saved), tuple(flops), tuple(fwd), tuple(bwd), tail_fwd, tail_bwd)


def chain_peak(chain: Chain, recompute: tuple[bool, ...]) -> int:
    """The per-window activation peak of a keep/recompute choice (see the module docstring)."""
    k, run, peak = 0, 0, 0
    for e in range(len(chain)):
        peak = max(peak, k + chain.fwd[e])
        if recompute[e]:
            run += chain.saved[e]
            peak = max(peak, k + run + chain.bwd[e])
        else:
            run = 0
            peak = max(peak, k + chain.saved[e] + chain.bwd[e])
            k += chain.saved[e]
    return max(peak, k + chain.tail_fwd, k + chain.tail_bwd)


def chain_flops(chain: Chain, recompute: tuple[bool, ...]) -> int:
    return sum(f for f, r in zip(chain.flops, recompute) if r)


@functools.lru_cache(maxsize=8)
def _tables(chain: Chain) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per kept element ``b`` (``len(chain)``: the end), for every previous kept ``a`` (-1: none)
    in ascending order with ``a+1..b-1`` recomputed: the largest per-window value the step
    reaches beyond the kept bytes after ``a`` (negated, so ascending), and the run's FLOPs.
    Independent of the limit, so bisections over the limit reuse them."""
    m = len(chain)
    neg_worst, flops = [], []
    for b in range(m + 1):
        own = max(chain.fwd[b], chain.saved[b] + chain.bwd[b]) if b < m else max(chain.tail_fwd, chain.tail_bwd)
        # Run q = a+1..b-1. Backward at q' in the run: S(a+1..q') + bwd[q'] = (P[q'+1] + bwd[q']) - P[a+1]
        # with P the prefix sums of saved bytes; maxima over the run by reverse cumulative maxima.
        saved = np.asarray(chain.saved[:b], dtype=np.int64)
        prefix = np.concatenate([[0], np.cumsum(saved)])
        run_fwd = np.concatenate([[0], np.maximum.accumulate(np.asarray(chain.fwd[:b], dtype=np.int64)[::-1])])
        bwd_abs = np.asarray(chain.bwd[:b], dtype=np.int64) + prefix[1:]
        run_bwd = np.concatenate([[np.iinfo(np.int64).min // 4], np.maximum.accumulate(bwd_abs[::-1])])
        a_vals = b - 1 - np.arange(b + 1)  # run length r -> a = b-1-r
        worst = np.maximum(np.maximum(own, run_fwd), run_bwd - prefix[a_vals + 1])
        fl = np.concatenate([[0], np.cumsum(np.asarray(chain.flops[:b], dtype=np.int64)[::-1])])
        neg_worst.append(-worst[::-1])  # a ascending: worst falls, -worst rises
        flops.append(fl[::-1])
    return neg_worst, flops


def _thresholds(chain: Chain, limit: int, b: int) -> tuple[int, np.ndarray, np.ndarray]:
    """For kept element ``b`` and every previous kept ``a``: the largest kept bytes after ``a``
    that stay within ``limit``, and the run's FLOPs. Returns ``(a_lo, thresholds, run_flops)``
    for ``a = a_lo..b-1``; thresholds only fall as the run grows, so the feasible ``a`` form a
    range ending at ``b-1``."""
    neg_worst, flops = _tables(chain)
    nw = neg_worst[b]
    first = int(np.searchsorted(nw, -limit, side="left"))  # entries with worst > limit come first
    return first - 1, limit + nw[first:], flops[b][first:]


def _bucketed_min_flops(chain: Chain, limit: int, buckets: int) -> tuple[bool, ...] | None:
    """:func:`min_flops_schedule` on dense arrays: per kept element and per range of kept bytes
    (``buckets`` equal ranges up to ``limit``), the least-FLOPs point. Every answer fits
    ``limit`` exactly; merging points of one range can lose optimality, or (rarely, at limits
    near the least feasible peak) every feasible point, in which case it returns ``None``."""
    m = len(chain)
    q = max(1, -(-(limit + 1) // buckets))
    nb = limit // q + 1
    inf = np.iinfo(np.int64).max // 4
    cost = np.full((m + 2, nb), inf, dtype=np.int64)
    kval = np.full((m + 2, nb), inf, dtype=np.int64)
    back = np.full((m + 2, nb, 2), -1, dtype=np.int64)
    cost[0, 0] = kval[0, 0] = 0
    cols = np.arange(nb)
    for b in range(m + 1):
        add = chain.saved[b] if b < m else 0
        a_lo, thresholds, run_flops = _thresholds(chain, limit, b)
        if a_lo >= b:
            continue
        block_c = cost[a_lo + 1:b + 1] + run_flops[:, None]
        block_k = kval[a_lo + 1:b + 1]
        block_c = np.where(block_k <= thresholds[:, None], block_c, inf)
        best = np.argmin(block_c, axis=0)
        c = block_c[best, cols]
        k = block_k[best, cols] + add
        ok = (c < inf) & (k <= limit)
        if not ok.any():
            continue
        c, k, src_row, src_col = c[ok], k[ok], best[ok] + a_lo + 1, cols[ok]
        bucket = k // q
        order = np.lexsort((k, c, bucket))
        first = order[np.unique(bucket[order], return_index=True)[1]]
        tb = bucket[first]
        cost[b + 1, tb], kval[b + 1, tb] = c[first], k[first]
        back[b + 1, tb, 0], back[b + 1, tb, 1] = src_row[first], src_col[first]
    end = cost[m + 1]
    if end.min() >= inf:
        return None
    pos = int(np.argmin(end))
    recompute = [True] * m
    r = m + 1
    while r > 0:
        if r - 1 < m:
            recompute[r - 1] = False
        r, pos = int(back[r, pos, 0]), int(back[r, pos, 1])
    return tuple(recompute)


def min_flops_schedule(chain: Chain, limit: int, max_front: int | None = 64,
                       buckets: int | None = 256) -> tuple[bool, ...] | None:
    """The keep/recompute choice of least recompute FLOPs with ``chain_peak <= limit``.

    Args:
        chain: the chain.
        limit: the per-window activation limit.
        max_front: cap on the Pareto points kept per element (``None``: exact). When a front is
            longer it is thinned to the least-FLOPs point of each of ``max_front`` equal ranges of
            kept bytes; every schedule returned still fits ``limit`` exactly, only optimality can
            suffer (never on fronts within the cap).
        buckets: chains longer than ``buckets / 4`` elements are first solved on dense arrays
            with this many ranges of kept bytes (fast; optimal up to the merging of points
            within a range); the Pareto DP runs only when that finds nothing. ``None``: never.

    Returns:
        ``recompute`` flags per element, or ``None`` when no choice fits ``limit``.
    """
    m = len(chain)
    if buckets is not None and max_front is not None and m * 4 > buckets:
        fast = _bucketed_min_flops(chain, limit, buckets)
        if fast is not None:
            return fast
    big = np.iinfo(np.int64).max // 4
    # Front of kept element a (row a+1; row 0 = the start), padded to a common width: kept bytes K
    # (ascending; ``big`` pads), FLOPs (strictly falling), back-pointer (row, column).
    width = 8
    fk = np.full((m + 2, width), big, dtype=np.int64)
    ff = np.full((m + 2, width), big, dtype=np.int64)
    back_row = np.full((m + 2, width), -1, dtype=np.int64)
    back_col = np.full((m + 2, width), -1, dtype=np.int64)
    fk[0, 0] = ff[0, 0] = 0
    for b in range(m + 1):
        add = chain.saved[b] if b < m else 0
        a_lo, thresholds, run_flops = _thresholds(chain, limit, b)
        if a_lo >= b:
            continue
        block_k = fk[a_lo + 1:b + 1]
        valid = block_k <= thresholds[:, None]
        if not valid.any():
            continue
        r_idx, c_idx = np.nonzero(valid)
        k = block_k[r_idx, c_idx] + add
        f = ff[a_lo + 1:b + 1][r_idx, c_idx] + run_flops[r_idx]
        row, col = r_idx + a_lo + 1, c_idx
        order = np.lexsort((f, k))
        k, f, row, col = k[order], f[order], row[order], col[order]
        keep = np.ones(len(f), dtype=bool)
        keep[1:] = f[1:] < np.minimum.accumulate(f)[:-1]
        k, f, row, col = k[keep], f[keep], row[keep], col[keep]
        if max_front is not None and len(k) > max_front:
            span = int(k[-1] - k[0]) + 1
            bucket = (k - k[0]) * max_front // span
            last = np.ones(len(k), dtype=bool)  # f falls with k: the last point of a bucket is its cheapest
            last[:-1] = bucket[1:] != bucket[:-1]
            last[0] = True  # the least kept bytes: keeps every feasible limit feasible
            k, f, row, col = k[last], f[last], row[last], col[last]
        if len(k) > width:
            grow = len(k) - width
            fk, ff = (np.pad(a, ((0, 0), (0, grow)), constant_values=big) for a in (fk, ff))
            back_row, back_col = (np.pad(a, ((0, 0), (0, grow)), constant_values=-1) for a in (back_row, back_col))
            width = len(k)
        n = len(k)
        fk[b + 1, :n], ff[b + 1, :n], back_row[b + 1, :n], back_col[b + 1, :n] = k, f, row, col
    end = ff[m + 1]
    if end[0] >= big:
        return None
    pos = int(np.argmin(end))  # ties: the first has the fewest kept bytes
    recompute = [True] * m
    r = m + 1
    while r > 0:
        if r - 1 < m:
            recompute[r - 1] = False
        r, pos = int(back_row[r, pos]), int(back_col[r, pos])
    return tuple(recompute)


def _feasible(chain: Chain, limit: int) -> bool:
    m = len(chain)
    best = [math.inf] * (m + 2)  # least kept bytes after each kept element; slot 0 = start
    best[0] = 0
    for b in range(m + 1):
        add = chain.saved[b] if b < m else 0
        a_lo, thresholds, _ = _thresholds(chain, limit, b)
        prev = np.asarray(best[a_lo + 1:b + 1])
        valid = prev <= thresholds
        if valid.any():
            best[b + 1] = float(prev[valid].min() + add)
    return best[m + 1] < math.inf


def min_peak(chain: Chain, rel_tol: float = 0.0) -> int:
    """The smallest achievable peak (bisection over the limit with a feasibility DP); with
    ``rel_tol`` > 0 a feasible limit at most that fraction above it (fewer bisection steps)."""
    m = len(chain)
    lo = max([chain.tail_fwd, chain.tail_bwd, *chain.fwd, *(s + b for s, b in zip(chain.saved, chain.bwd))], default=0)
    hi = chain_peak(chain, (False,) * m)
    while lo < hi and hi - lo > rel_tol * hi:
        mid = (lo + hi) // 2
        if _feasible(chain, mid):
            hi = mid
        else:
            lo = mid + 1
    return hi


def min_peak_schedule(chain: Chain, max_front: int | None = 64) -> tuple[int, tuple[bool, ...]]:
    """The smallest achievable peak and the least-FLOPs choice that reaches it (see
    :func:`min_flops_schedule` for ``max_front``)."""
    low = min_peak(chain)
    schedule = min_flops_schedule(chain, low, max_front, None)
    assert schedule is not None  # low is feasible by construction
    return low, schedule


def sqrt_schedule(chain: Chain) -> tuple[bool, ...]:
    """Chen et al.'s sqrt(n) checkpointing: keep every ceil(sqrt(n))-th element, recompute the rest."""
    m = len(chain)
    if m == 0:
        return ()
    k = max(1, math.ceil(math.sqrt(m)))
    return tuple((e % k) != k - 1 for e in range(m))


def brute_force_schedule(chain: Chain, limit: int) -> tuple[bool, ...] | None:
    """Exhaustive search (for tests on small chains): least FLOPs, then least peak, within ``limit``."""
    m = len(chain)
    best = None
    for mask in range(1 << m):
        rec = tuple(bool(mask >> e & 1) for e in range(m))
        peak = chain_peak(chain, rec)
        if peak <= limit:
            key = (chain_flops(chain, rec), peak)
            if best is None or key < best[0]:
                best = (key, rec)
    return None if best is None else best[1]
