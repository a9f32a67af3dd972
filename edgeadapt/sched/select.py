"""Update selection under a budget: which parameters and channel groups train.

Candidates (*units*) are whole small tensors (biases, norm affines, the head's) and groups of
output channels of larger weights. Each has an importance (given, or measured at export by
:mod:`edgeadapt.export.importance`) and a cost: its trained bytes times the per-byte state of the
cost model (gradient, optimizer state, rollback copy). Activation memory depends on the earliest
trained op, so the selection also picks a *configuration*: the first trained op ``k`` and how the
frozen prefix and saved activations are handled (features cached or not, activations kept or
recomputed at least memory). :func:`select_milp` solves this exactly with
``scipy.optimize.milp`` (binary unit variables plus one binary per configuration; a unit can
train only if the chosen configuration's first op is at or before its op);
:func:`select_greedy` adds units by importance per byte while they fit. Both work on a
:class:`SelectionProblem` whose constants come from :func:`build_problem`.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
import tempfile
from dataclasses import dataclass

import numpy as np

from .cost import CostModel, activation_arrays, clean_cut, live_bytes
from .ir import Graph
from .remat import chain_from_graph, chain_peak, min_peak

__all__ = ["Unit", "Config", "Selection", "SelectionProblem", "candidate_units", "build_problem", "select_milp",
           "select_greedy",
           "select_brute_force", "selection_peak"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Unit:
    """One candidate update.

    Attributes:
        param: the parameter name.
        channels: the output channels it trains (``None``: the whole tensor).
        op_index: the op owning the parameter.
        trained_bytes: bytes of the trained elements.
        importance: the objective weight (>= 0).
    """

    param: str
    channels: tuple[int, ...] | None
    op_index: int
    trained_bytes: int
    importance: float

    @property
    def label(self) -> str:
        if self.channels is None:
            return self.param
        return f"{self.param}[{self.channels[0]}..{self.channels[-1]}]" if len(self.channels) > 1 else \
            f"{self.param}[{self.channels[0]}]"


@dataclass(frozen=True)
class Config:
    """A first trained op plus how the prefix and the activations are handled.

    Attributes:
        first_op: the earliest op allowed to train.
        cut: the plan's cut (``first_op - 1``, or the clean cut below it when caching).
        cache_features: whether the prefix's output is cached.
        remat: whether saved activations are recomputed (at least memory).
        fixed_bytes: bytes that do not scale with trained bytes in the training phases
            (session overhead, feature cache, activations of one micro-batch).
        features_bytes: the same for the features phase (0 when not caching).
        penalty: a small cost preferring faster configurations at equal importance.
    """

    first_op: int
    cut: int
    cache_features: bool
    remat: bool
    fixed_bytes: int
    features_bytes: int
    penalty: float


@dataclass(frozen=True)
class SelectionProblem:
    """Units, configurations and the per-trained-byte factors of one micro-batch size.

    Attributes:
        units: the candidates.
        configs: the configurations.
        train_factor: bytes per trained byte in the training phases (gradient, state, rollback,
            optimizer workspace where it exceeds activations is covered by ``opt_factor``).
        opt_factor: bytes per trained byte in the optimizer phase.
        session_factor: bytes per trained byte in the features phase (gradient and state).
        opt_fixed: per configuration, the fixed bytes of the optimizer phase.
        micro_batch_windows: the micro-batch size the constants are for.
        splits: per parameter whose units are channel groups, ``(name, bytes, unit indices)``:
            ``bytes`` = ``channel_weight_factor x`` its whole bytes, the whole-weight copies held
            in every phase when some but not all of its groups train (the parameter is then
            channel-split; with every group it trains whole, without copies).
    """

    units: tuple[Unit, ...]
    configs: tuple[Config, ...]
    train_factor: float
    opt_factor: float
    session_factor: float
    opt_fixed: tuple[int, ...]
    micro_batch_windows: int
    splits: tuple[tuple[str, float, tuple[int, ...]], ...] = ()

    def split_bytes(self, chosen) -> float:
        """Whole-weight copy bytes of the parameters that units ``chosen`` (indices) channel-split."""
        chosen = set(chosen)
        total = 0.0
        for _, nbytes, members in self.splits:
            n = sum(1 for u in members if u in chosen)
            if 0 < n < len(members):
                total += nbytes
        return total


def candidate_units(graph: Graph, importance: dict | None = None, channel_groups: int = 4,
                    min_group_channels: int = 8) -> tuple[Unit, ...]:
    """Units of ``graph``: channel groups of weights with at least ``channel_groups *
    min_group_channels`` output channels and more than one axis, whole tensors otherwise.

    Args:
        graph: the model's IR.
        importance: parameter name -> a float (the tensor's importance, spread evenly over its
            channels) or a sequence with one value per output channel. ``None``: every trained
            element counts 1 (more trained elements are better). Parameters it omits get 0.
        channel_groups: groups per large weight; with per-channel importance the groups are
            formed from the channels ranked by importance (the first group holds the best).
        min_group_channels: smallest group.

    Parameters whose gradient would flow through an op without a gradient
    (:meth:`Graph.gradient_blocked`) are no candidates.
    """
    units = []
    blocked = graph.gradient_blocked()
    for p in graph.params:
        if p.name in blocked:
            continue
        op = graph.owner_index(p.name)
        per_row = p.numel // max(1, p.out_channels) * p.dtype_bytes
        if importance is None:
            per_channel = np.full(p.out_channels, p.numel / max(1, p.out_channels))
        else:
            raw = importance.get(p.name, 0.0)
            per_channel = (np.full(p.out_channels, float(raw) / p.out_channels) if np.ndim(raw) == 0
                           else np.asarray(raw, dtype=np.float64).reshape(-1))
            if per_channel.shape != (p.out_channels,):
                raise ValueError(f"importance of {p.name}: expected one value or {p.out_channels} values "
                                 f"(one per output channel), got shape {per_channel.shape}")
            if (per_channel < 0).any() or not np.isfinite(per_channel).all():
                raise ValueError(f"importance of {p.name} must be finite and >= 0")
        if len(p.shape) >= 2 and p.out_channels >= channel_groups * min_group_channels:
            order = np.argsort(-per_channel, kind="stable") if importance is not None else np.arange(p.out_channels)
            for group in np.array_split(order, channel_groups):
                chans = tuple(sorted(int(c) for c in group))
                units.append(Unit(p.name, chans, op, per_row * len(chans), float(per_channel[list(chans)].sum())))
        else:
            units.append(Unit(p.name, None, op, p.param_bytes, float(per_channel.sum())))
    return tuple(units)


def _largest_clean_cut(graph: Graph, below: int) -> int:
    for c in range(below, -1, -1):
        if clean_cut(graph, c):
            return c
    return -1


def build_problem(graph: Graph, units: tuple[Unit, ...], cost: CostModel, *, micro_batch_windows: int,
                  n_windows: int, optimizer: str, allow_cache: bool = True, allow_remat: bool = True,
                  _chain_cache: dict | None = None) -> SelectionProblem:
    """The constants of the selection for one micro-batch size.

    A configuration's activation bytes are computed as if every parameter from its first op on
    trained (an upper bound: activations only grow with the trained set), so any selection the
    solvers accept also fits under :func:`edgeadapt.sched.predict`.
    """
    m = micro_batch_windows
    state = cost.state_factor(optimizer)
    session_factor = cost.gradient_factor + state
    roll = cost.rollback_factor + cost.rollback_state_factor * state
    live = live_bytes(graph)
    configs: list[Config] = []
    opt_fixed: list[int] = []
    chain_cache = {} if _chain_cache is None else _chain_cache
    for k in sorted({u.op_index for u in units}):
        later = {p for op in graph.ops[k:] for p in op.params}
        variants = [(k - 1, False)]
        clean = _largest_clean_cut(graph, k - 1)
        if allow_cache and clean >= 0:
            variants.insert(0, (clean, True))
        for cut, cache in variants:
            start = cut + 1 if cache else 0
            key = (k, start)
            if key not in chain_cache:
                arr = activation_arrays(graph, later, start)
                chain = chain_from_graph(graph, arr)
                keep = chain_peak(chain, (False,) * len(chain))
                # A feasible limit within 2% of the least (the table is an upper bound anyway).
                low = min_peak(chain, rel_tol=0.02) if allow_remat and len(chain) else keep
                chain_cache[key] = (keep, low, sum(arr.grad), arr.grad)
            keep, low, n_grad, grad = chain_cache[key]
            session_fixed = (cost.session_overhead_bytes + cost.grad_op_bytes * n_grad
                             + cost.graph_op_bytes * (len(graph.ops) - start)
                             + cost.batch_norm_bytes(graph, start, m, grad)
                             + cost.recurrent_bytes(graph))  # as predict's session
            cache_bytes = n_windows * graph.ops[cut].output_bytes if cache else 0
            # Parameter copies, bounded over every trained subset: all copies of the training
            # graph kept, plus the largest gradient buffers of an op that may train.
            copies = (sum(op.param_copy_bytes for op in graph.ops[start:])
                      + max((op.param_grad_bytes for op in graph.ops[k:]), default=0))
            features = (session_fixed + cost.prefix_session_overhead_bytes + cache_bytes
                        + cost.activation_bytes(m, max(live[: cut + 1]), inference=True)) if cache else 0
            for remat, act in ((False, keep), (True, low)):
                if remat and (not allow_remat or low >= keep):
                    continue
                configs.append(Config(k, cut, cache, remat, session_fixed + cache_bytes + copies
                                      + cost.activation_bytes(m, act), features,
                                      (0.0 if cache else 1.0) + (2.0 if remat else 0.0)))
                opt_fixed.append(session_fixed + cache_bytes)
    members: dict[str, list[int]] = {}
    for i, u in enumerate(units):
        if u.channels is not None:
            members.setdefault(u.param, []).append(i)
    splits = tuple((name, cost.channel_weight_factor * graph.param(name).param_bytes, tuple(idx))
                   for name, idx in members.items() if len(idx) > 1 and cost.channel_weight_factor > 0)
    return SelectionProblem(tuple(units), tuple(configs), session_factor + roll,
                            session_factor + roll + cost.optimizer_workspace_factor, session_factor,
                            tuple(opt_fixed), m,
                            splits)


def selection_peak(problem: SelectionProblem, chosen: tuple[int, ...], config: int) -> float:
    """Peak bytes (as the solvers see it) of units ``chosen`` under configuration ``config``;
    ``inf`` when a unit lies before the configuration's first op."""
    c = problem.configs[config]
    if any(problem.units[u].op_index < c.first_op for u in chosen):
        return math.inf
    t = sum(problem.units[u].trained_bytes for u in chosen)
    split = problem.split_bytes(chosen)
    peaks = [c.fixed_bytes + problem.train_factor * t + split,
             problem.opt_fixed[config] + problem.opt_factor * t + split]
    if c.cache_features:
        peaks.append(c.features_bytes + problem.session_factor * t + split)
    return max(peaks)


def _best_config(problem: SelectionProblem, chosen: tuple[int, ...], budget: float) -> int | None:
    best = None
    for j, c in enumerate(problem.configs):
        if selection_peak(problem, chosen, j) <= budget and (best is None or c.penalty < problem.configs[best].penalty):
            best = j
    return best


@dataclass(frozen=True)
class Selection:
    """A solver's answer: unit indices, the configuration index and the total importance."""

    units: tuple[int, ...]
    config: int
    importance: float


def select_greedy(problem: SelectionProblem, budget_bytes: int) -> Selection | None:
    """Add units by importance per byte (ties: earlier op last, then order) while some
    configuration still fits; ``None`` when not even one unit fits."""
    order = sorted(range(len(problem.units)),
                   key=lambda u: (-problem.units[u].importance / max(1, problem.units[u].trained_bytes), u))
    chosen: list[int] = []
    for u in order:
        trial = tuple(chosen + [u])
        if _best_config(problem, trial, budget_bytes) is not None:
            chosen.append(u)
    if not chosen:
        return None
    chosen_t = tuple(sorted(chosen))
    return Selection(chosen_t, _best_config(problem, chosen_t, budget_bytes),
                     sum(problem.units[u].importance for u in chosen_t))


@contextlib.contextmanager
def _native_stdout_to_log():
    """Route what the HiGHS C++ solver prints on file descriptor 1 into this module's debug log
    (some HiGHS builds print internal diagnostics even with output switched off)."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # no real stdout (captured): nothing to route
        yield
        return
    sys.stdout.flush()
    saved = os.dup(fd)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), fd)
        try:
            yield
        finally:
            os.dup2(saved, fd)
            os.close(saved)
            sink.seek(0)
            text = sink.read().decode(errors="replace").strip()
            if text:
                log.debug("HiGHS output: %s", text)


def select_milp(problem: SelectionProblem, budget_bytes: int, time_limit_s: float = 10.0) -> Selection | None:
    """Maximise total importance within ``budget_bytes`` exactly (``scipy.optimize.milp``).

    Variables: ``x_u`` (unit trains), ``z_j`` (configuration ``j`` chosen) and, per parameter of
    ``problem.splits``, ``s_p`` (it is channel-split) and ``a_p`` (all its groups train); one
    configuration; ``x_u <= sum of z_j over configurations whose first op is at or before u's
    op``; at least one unit; ``a_p <= x_g`` and ``s_p >= x_g - a_p`` for each group ``g`` of
    ``p`` (so ``s_p`` is 1 when some but not all groups train: the exact whole-weight copy term
    of :func:`selection_peak`); for the chosen configuration the training, optimizer and
    features phases within budget. Ties in importance prefer the configuration with the smaller
    penalty.

    Returns:
        The selection, or ``None`` when no unit fits.
    """
    # imported on use: the device runner re-plans with sched (cost, replan) without scipy's ~20 MiB
    from scipy.optimize import Bounds, LinearConstraint, milp

    nu, nc, ns = len(problem.units), len(problem.configs), len(problem.splits)
    if nu == 0 or nc == 0:
        return None
    nv = nu + nc + 2 * ns
    tb = np.array([u.trained_bytes for u in problem.units], dtype=np.float64)
    imp = np.array([u.importance for u in problem.units], dtype=np.float64)
    pen = np.array([c.penalty for c in problem.configs], dtype=np.float64)
    copies = np.array([b for _, b, _ in problem.splits], dtype=np.float64)
    # Importance scaled to a total of 1e6: HiGHS also stops within an absolute gap of 1e-6, which
    # on raw importances would drop units of tiny importance (and break exactness).
    unit = 1e6 / max(imp.sum(), 1e-300)
    eps = 1e-7 * 1e6 / max(1.0, pen.max(initial=1.0))
    c_obj = np.concatenate([-imp * unit, eps * pen, np.zeros(2 * ns)])
    rows, lb, ub = [], [], []

    def row(units=0.0, configs=0.0, split=0.0) -> np.ndarray:
        r = np.zeros(nv)
        r[:nu], r[nu:nu + nc], r[nu + nc:nu + nc + ns] = units, configs, split
        return r

    def constrain(r: np.ndarray, lower: float, upper: float) -> None:
        rows.append(r)
        lb.append(lower)
        ub.append(upper)

    constrain(row(configs=1.0), 1, 1)
    constrain(row(units=1.0), 1, np.inf)
    big = float(budget_bytes)
    fixed = np.array([c.fixed_bytes for c in problem.configs], dtype=np.float64)
    feat = np.array([c.features_bytes if c.cache_features else 0 for c in problem.configs], dtype=np.float64)
    constrain(row(problem.train_factor * tb, fixed, copies), -np.inf, big)
    constrain(row(problem.opt_factor * tb, np.array(problem.opt_fixed, dtype=np.float64), copies), -np.inf, big)
    constrain(row(problem.session_factor * tb, feat, copies), -np.inf, big)
    first = np.array([c.first_op for c in problem.configs])
    for i, u in enumerate(problem.units):
        r = row(configs=-(first <= u.op_index).astype(np.float64))
        r[i] = 1.0
        constrain(r, -np.inf, 0.0)
    for k, (_, _, members) in enumerate(problem.splits):
        s_k, a_k = nu + nc + k, nu + nc + ns + k
        for g in members:
            r = np.zeros(nv)
            r[a_k], r[g] = 1.0, -1.0  # a_p <= x_g
            constrain(r, -np.inf, 0.0)
            r = np.zeros(nv)
            r[g], r[a_k], r[s_k] = 1.0, -1.0, -1.0  # x_g - a_p <= s_p
            constrain(r, -np.inf, 0.0)
    with _native_stdout_to_log():
        res = milp(c_obj, constraints=LinearConstraint(np.array(rows), lb, ub),
                   integrality=np.ones(nv), bounds=Bounds(0, 1),
                   options={"time_limit": time_limit_s, "mip_rel_gap": 1e-9})
    if res.x is None:
        if res.status not in (2,):  # 2: infeasible
            log.warning("MILP update selection stopped without a solution (%s)", res.message)
        return None
    x = np.round(res.x).astype(int)
    chosen = tuple(int(i) for i in np.nonzero(x[:nu])[0])
    config = int(np.nonzero(x[nu:nu + nc])[0][0])
    return Selection(chosen, config, float(imp[list(chosen)].sum()))


def select_brute_force(problem: SelectionProblem, budget_bytes: int) -> Selection | None:
    """Exhaustive search over unit subsets (tests, up to ~14 units)."""
    nu = len(problem.units)
    best = None
    for mask in range(1, 1 << nu):
        chosen = tuple(u for u in range(nu) if mask >> u & 1)
        j = _best_config(problem, chosen, budget_bytes)
        if j is None:
            continue
        value = sum(problem.units[u].importance for u in chosen)
        if best is None or value > best.importance + 1e-9:
            best = Selection(chosen, j, value)
    return best
