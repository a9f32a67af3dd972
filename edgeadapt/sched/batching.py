"""``plan_for_budget``: the one entry point that turns a graph and a budget into a verified plan.

It picks, in this order of concern:

1. the updates -- a given :class:`UpdatePolicy` is resolved and kept; otherwise
   :mod:`.select` maximises importance within the budget (exact MILP, greedy fallback);
2. the micro-batch -- the largest that fits, to keep steps fast (with a selection: the largest
   among those whose selection is the most important, within ``importance_tolerance``, 0 by default);
3. the prefix -- cache its features once per call when that fits (the prefix then runs once,
   not every epoch; with a selection: when the importance stays within the tolerance), else
   run it with every micro-batch;
4. rematerialisation -- none when everything fits, else the least recompute FLOPs that fit.

The selection bounds activations from above, so near the smallest budget it may find nothing
that fits; the smallest updates (one unit alone, in every cut, cache and recompute form) are
then costed exactly with :func:`predict`, and the most important one that fits is taken.
:func:`minimum_budget` is the least predicted peak over those same plans, so
:func:`plan_for_budget` succeeds at that budget and fails below it, and its
:class:`NoFeasiblePlan` names it.

The result carries ``predicted`` and ``budget_bytes`` and has passed :func:`verify`.
:func:`replan` re-plans a made plan for another window count (the device's real data) keeping
its updates, cut and recompute choices: a cheap, pure call. :func:`refit` plans a made plan's
updates again under a constraint the exporter meets while carrying it out (an activation that
cannot be recomputed, a prefix that cannot run on its own): the fallbacks are planned here, and
the exporter records only plans this module made and verified.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, replace

import numpy as np

from ..units import parse_bytes
from .cost import CostModel, activation_arrays, clean_cut, predict
from .errors import NoFeasiblePlan
from .ir import Graph
from .plan import Action, Mode, ParamPlan, Peak, Plan
from .policy import UpdatePolicy
from .remat import chain_from_graph, min_flops_schedule, min_peak_schedule
from .resolve import cut_of, plan_from_policy
from .select import build_problem, candidate_units, select_greedy, select_milp
from .verify import verify

__all__ = ["plan_for_budget", "replan", "refit", "micro_batch_sizes", "minimum_budget"]

log = logging.getLogger(__name__)


def micro_batch_sizes(batch_windows: int) -> list[int]:
    """Micro-batch sizes tried, largest first: the batch halved (rounding up) down to 1."""
    sizes, m = [], batch_windows
    while True:
        sizes.append(m)
        if m == 1:
            return sizes
        m = math.ceil(m / 2)


def _activation_limit(cost: CostModel, budget: int, held: int, m: int) -> int:
    """The largest per-window activation total ``x`` with ``held + cost.activation_bytes(m, x) <= budget``."""
    room = budget - held - m * cost.per_window_bytes
    if room < 0:
        return -1
    x = int(room // (cost.activation_factor * m)) if cost.activation_factor > 0 else room
    while x > 0 and cost.activation_bytes(m, x) + held > budget:
        x -= 1
    return x


def _with_remat(graph: Graph, plan: Plan, cost: CostModel, budget: int | None, minimal: bool,
                keep: frozenset[str] = frozenset()) -> Plan | None:
    """``plan`` with recompute actions: least FLOPs within ``budget`` or, ``minimal``, least memory;
    the ops in ``keep`` keep their saved activations (``None`` when no such choice exists)."""
    trained = {p.name for p in plan.params if p.trains}
    start = plan.cut + 1 if plan.cache_features and plan.cut >= 0 else 0
    chain = chain_from_graph(graph, activation_arrays(graph, trained, start))
    if not len(chain):
        return None
    if keep:  # recomputing a kept op costs more than every other choice together: taken only if forced
        never = sum(chain.flops) + 1
        chain = replace(chain, flops=tuple(never if n in keep else f for n, f in zip(chain.names, chain.flops)))
    if minimal:
        schedule = min_peak_schedule(chain)[1]
    else:
        base = predict(graph, replace(plan, activations=()), cost)
        held = base.phases_bytes["rollback"]
        limit = _activation_limit(cost, budget, held, plan.micro_batch_windows)
        if limit < 0:
            return None
        schedule = min_flops_schedule(chain, limit)
        if schedule is None:
            return None
    actions = tuple((name, Action.RECOMPUTE) for name, r in zip(chain.names, schedule) if r)
    if not actions or keep & {name for name, _ in actions}:
        return None
    return replace(plan, activations=actions)


def _variants(graph: Graph, plan: Plan, allow_cache: bool | None) -> list[Plan]:
    """The cache / no-cache forms of ``plan`` (cache first when its cut allows it); ``allow_cache``
    ``None``: ``plan``'s own form only."""
    if allow_cache is None:
        return [plan]
    out = []
    if allow_cache and plan.cut >= 0:
        cut = plan.cut
        while cut >= 0 and not clean_cut(graph, cut):
            cut -= 1
        if cut >= 0:
            out.append(replace(plan, cut=cut, cache_features=True))
    out.append(replace(plan, cut=cut_of(graph, plan.params), cache_features=False))
    return out


def _fit_fixed_updates(graph: Graph, plan: Plan, budget: int, cost: CostModel, allow_cache: bool | None,
                       allow_remat: bool, micro_sizes: list[int], keep: frozenset[str] = frozenset()) -> Plan:
    """The fastest form of ``plan`` (updates fixed) within ``budget``, or :class:`NoFeasiblePlan`
    (``allow_cache`` as in :func:`_variants`; ``keep`` as in :func:`_with_remat`)."""
    smallest: tuple[int, str] | None = None
    for m in micro_sizes:
        base = replace(plan, micro_batch_windows=m, activations=(), predicted=None, budget_bytes=None)
        for variant in _variants(graph, base, allow_cache):
            peak = predict(graph, variant, cost)
            if peak.peak_bytes <= budget:
                return _finish(graph, variant, budget, cost)
            if allow_remat:
                remat = _with_remat(graph, variant, cost, budget, minimal=False, keep=keep)
                if remat is not None and predict(graph, remat, cost).peak_bytes <= budget:
                    return _finish(graph, remat, budget, cost)
    # Nothing fits: the smallest budget over every form at the smallest micro-batch.
    m = min(micro_sizes)
    base = replace(plan, micro_batch_windows=m, activations=(), predicted=None, budget_bytes=None)
    for variant in _variants(graph, base, allow_cache):
        forms = [variant]
        if allow_remat:
            low = _with_remat(graph, variant, cost, None, minimal=True, keep=keep)
            if low is not None:
                forms.append(low)
        for form in forms:
            peak = predict(graph, form, cost)
            if smallest is None or peak.peak_bytes < smallest[0]:
                smallest = (peak.peak_bytes, peak.where)
    raise NoFeasiblePlan(smallest[0], budget, smallest[1])


def _finish(graph: Graph, plan: Plan, budget: int, cost: CostModel) -> Plan:
    plan = replace(plan, budget_bytes=budget, predicted=None)
    peak = verify(graph, plan, budget, cost=cost)
    return replace(plan, predicted=peak)


def _plan_from_selection(graph: Graph, problem, selection, base: Plan) -> Plan:
    chosen: dict[str, set[int] | None] = {}
    for u in selection.units:
        unit = problem.units[u]
        if unit.channels is None:
            chosen[unit.param] = None
        elif unit.param not in chosen or chosen[unit.param] is not None:
            chosen.setdefault(unit.param, set()).update(unit.channels)
    params = []
    for p in graph.params:
        if p.name not in chosen:
            params.append(ParamPlan(p.name, Mode.FROZEN))
        elif chosen[p.name] is None or len(chosen[p.name]) == p.out_channels:
            params.append(ParamPlan(p.name, Mode.FULL))
        else:
            params.append(ParamPlan(p.name, Mode.CHANNELS, tuple(sorted(chosen[p.name]))))
    config = problem.configs[selection.config]
    params_t = tuple(params)
    cut = config.cut if config.cache_features else cut_of(graph, params_t)
    return replace(base, params=params_t, cut=cut, cache_features=config.cache_features,
                   micro_batch_windows=problem.micro_batch_windows), config.remat


@dataclass(frozen=True)
class _Single:
    """One of the smallest updates a plan can make: one selection unit alone, or one parameter
    whose units are channel groups trained whole (every group: no channel split).

    Attributes:
        params: the plan's per-parameter decisions (every other parameter frozen).
        op_index: the op owning the trained parameter.
        importance: the selection's importance of what trains.
    """

    params: tuple[ParamPlan, ...]
    op_index: int
    importance: float


def _singles(graph: Graph, units) -> list[_Single]:
    """Every single update of ``units`` (see :class:`_Single`), by decreasing importance.

    Any plan the selection makes trains at least one of them at its earliest trained op, in the
    same cut and cache form, and is predicted at least as high (every phase grows with the
    trained set); so the least predicted peak over singles is the smallest feasible budget.
    """
    frozen = [ParamPlan(p.name, Mode.FROZEN) for p in graph.params]
    index = {p.name: i for i, p in enumerate(graph.params)}

    def with_(name: str, plan: ParamPlan) -> tuple[ParamPlan, ...]:
        params = list(frozen)
        params[index[name]] = plan
        return tuple(params)

    out, grouped = [], defaultdict(float)
    for u in units:
        param = graph.param(u.param)
        if u.channels is None or len(u.channels) == param.out_channels:
            out.append(_Single(with_(u.param, ParamPlan(u.param, Mode.FULL)), u.op_index, u.importance))
        else:
            out.append(_Single(with_(u.param, ParamPlan(u.param, Mode.CHANNELS, u.channels)), u.op_index,
                               u.importance))
            grouped[u.param] += u.importance
    for name, importance in grouped.items():
        out.append(_Single(with_(name, ParamPlan(name, Mode.FULL)), graph.owner_index(name), importance))
    return sorted(out, key=lambda s: -s.importance)


def _activation_bound(peak: Peak) -> bool:
    """Whether ``peak`` is set by the activations (recompute could lower it)."""
    return peak.where.startswith(("forward", "backward"))


def _floor_bytes(peak: Peak) -> int:
    """The peak of the phases that recompute does not change: a lower bound of any recompute form."""
    return max(v for phase, v in peak.phases_bytes.items() if phase not in ("forward", "backward"))


class _Forms:
    """The forms the planner gives a single update (features cached at any clean cut before its
    op, or the prefix run every step), each with a lower bound of its predicted peak.

    The bound is the peak of the same form training nothing (predicted peaks grow with the
    trained set), shared by every single of that cut; it lets the searches skip most forms.
    """

    def __init__(self, graph: Graph, cost: CostModel, base: Plan, allow_cache: bool):
        self.graph, self.cost = graph, cost
        self.base = replace(base, params=tuple(ParamPlan(p.name, Mode.FROZEN) for p in graph.params),
                            activations=(), predicted=None, budget_bytes=None)
        self.clean_cuts = [c for c in range(len(graph.ops)) if clean_cut(graph, c)] if allow_cache else []
        self._floors: dict[tuple[int, bool, int], int] = {}

    def of(self, single: _Single, micro_batch_windows: int) -> list[tuple[int, Plan]]:
        """(lower bound of the peak in bytes, plan) of each form of ``single``, no recompute:
        cached features (the latest cut first), then the prefix run every step."""
        base = replace(self.base, micro_batch_windows=micro_batch_windows)
        cuts = [(c, True) for c in reversed(self.clean_cuts) if c < single.op_index]
        cuts.append((single.op_index - 1, False))
        out = []
        for cut, cache in cuts:
            key = (cut, cache, micro_batch_windows)
            if key not in self._floors:
                empty = replace(base, cut=cut, cache_features=cache)
                self._floors[key] = predict(self.graph, empty, self.cost).peak_bytes
            out.append((self._floors[key], replace(base, params=single.params, cut=cut, cache_features=cache)))
        return out


def _smallest_plan(graph: Graph, singles: list[_Single], forms: _Forms, allow_remat: bool) -> tuple[Plan, Peak]:
    """The plan of least predicted peak over every single update and form at micro-batch 1
    (recompute at least memory where that lowers it): its peak is the smallest feasible budget."""
    cost = forms.cost
    candidates = [form for s in singles for form in forms.of(s, 1)]
    todo = sorted(((floor, i, plan) for i, (floor, plan) in enumerate(candidates)), key=lambda t: t[:2])
    best: tuple[Plan, Peak] | None = None
    for floor, _, plan in todo:  # lowest bound first: stop once no form can beat the best
        if best is not None and floor >= best[1].peak_bytes:
            break
        peak = predict(graph, plan, cost)
        if best is None or peak.peak_bytes < best[1].peak_bytes:
            best = plan, peak
        if allow_remat and _activation_bound(peak) and _floor_bytes(peak) < best[1].peak_bytes:
            low = _with_remat(graph, plan, cost, None, minimal=True)
            if low is not None and (low_peak := predict(graph, low, cost)).peak_bytes < best[1].peak_bytes:
                best = low, low_peak
    if best is None:
        raise ValueError(f"graph {graph.name!r} has no parameter to train")
    return best


def _fit_single(graph: Graph, single: _Single, forms: _Forms, budget: int, allow_remat: bool,
                micro_sizes: list[int]) -> Plan | None:
    """``single``'s fastest plan within ``budget``: the largest micro-batch, then cached features
    (the latest cut first), then no recompute before the least recompute FLOPs that fit."""
    cost = forms.cost
    for m in micro_sizes:
        for floor, plan in forms.of(single, m):
            if floor > budget:
                continue
            peak = predict(graph, plan, cost)
            if peak.peak_bytes <= budget:
                return plan
            if allow_remat and _activation_bound(peak) and _floor_bytes(peak) <= budget:
                for minimal in (False, True):
                    remat = _with_remat(graph, plan, cost, budget, minimal=minimal)
                    if remat is not None and predict(graph, remat, cost).peak_bytes <= budget:
                        return remat
    return None


def _best_single(graph: Graph, singles: list[_Single], forms: _Forms, budget: int, allow_remat: bool,
                 micro_sizes: list[int], above: float) -> tuple[float, Plan] | None:
    """The most important single update whose importance exceeds ``above`` (by more than
    rounding) that fits ``budget``, in its fastest form; ``None`` when none does."""
    for single in singles:  # by decreasing importance
        if single.importance <= above + 1e-9 * max(1.0, abs(above)):
            return None
        # Fits at all <=> fits at micro-batch 1 (every phase grows with the micro-batch).
        if _fit_single(graph, single, forms, budget, allow_remat, [1]) is not None:
            return single.importance, _fit_single(graph, single, forms, budget, allow_remat, micro_sizes)
    return None


def minimum_budget(graph: Graph, *, n_windows: int = 128, batch_windows: int = 32, optimizer: str = "adamw",
                   cost: CostModel | None = None, importance: dict | None = None, allow_cache: bool = True,
                   allow_remat: bool = True) -> int:
    """The smallest budget for which :func:`plan_for_budget` (selecting updates) finds a plan.

    It is the least predicted peak over the smallest updates (one selection unit, or one
    channel-grouped parameter whole) in every form the planner makes (features cached at any
    clean cut before the update, or the prefix run every step; recompute at least memory) at
    micro-batch 1: :func:`plan_for_budget` succeeds at this budget and fails one byte below.
    """
    cost = cost or CostModel.default()
    base = Plan(graph=graph.name, params=tuple(ParamPlan(p.name, Mode.FROZEN) for p in graph.params),
                batch_windows=batch_windows, micro_batch_windows=1, n_windows=n_windows, optimizer=optimizer)
    singles = _singles(graph, candidate_units(graph, importance))
    return _smallest_plan(graph, singles, _Forms(graph, cost, base, allow_cache), allow_remat)[1].peak_bytes


def plan_for_budget(graph: Graph, budget_bytes: int | str, *, importance: dict | None = None, n_windows: int = 128,
                    batch_windows: int = 32, optimizer: str = "adamw", cost: CostModel | None = None,
                    policy: UpdatePolicy | None = None, weights: dict[str, np.ndarray] | None = None,
                    allow_cache: bool = True, allow_remat: bool = True, importance_tolerance: float = 0.0,
                    solver: str = "milp") -> Plan:
    """A verified plan for ``graph`` within ``budget_bytes`` for a whole device ``adapt`` call.

    Args:
        graph: the model's IR.
        budget_bytes: bytes, or a string such as ``"512KiB"``.
        importance: per parameter (a float or one value per output channel) for the selection;
            ``None``: every trained element counts the same.
        n_windows: adaptation windows planned for (the feature cache holds their features).
        batch_windows: windows per optimizer step.
        optimizer: ``"adamw"`` or ``"sgd"``.
        cost: cost-model constants (default: the calibrated ones).
        policy: a hand-written policy to check and fit instead of selecting updates.
        weights: parameter arrays, for policies with channel ratios.
        allow_cache: may cache the prefix's features.
        allow_remat: may recompute activations.
        importance_tolerance: a smaller micro-batch, or recomputing the prefix every epoch
            instead of caching its features, is taken only if it raises the selected importance
            by more than this fraction. The default 0 takes the most important selection, the
            largest micro-batch and cached features only among equally important ones, so the
            chosen importance never decreases as the budget grows; a positive tolerance trades
            importance for speed and loses that guarantee (a larger budget can make a faster,
            less important form acceptable).
        solver: ``"milp"`` (exact; greedy if the solver fails) or ``"greedy"``.

    Raises:
        NoFeasiblePlan: nothing fits; ``need_bytes`` is the smallest budget that would.
        ValueError: bad arguments.
    """
    budget = parse_bytes(budget_bytes)
    cost = cost or CostModel.default()
    if solver not in ("milp", "greedy"):
        raise ValueError(f"solver must be 'milp' or 'greedy', got {solver!r}")
    sizes = micro_batch_sizes(batch_windows)
    if policy is not None:
        plan = plan_from_policy(graph, policy, weights=weights, batch_windows=batch_windows,
                                n_windows=n_windows, optimizer=optimizer)
        return _fit_fixed_updates(graph, plan, budget, cost, allow_cache, allow_remat, sizes)

    blocked = graph.gradient_blocked()
    if blocked:
        log.info("not training %d parameter(s) whose gradient would flow through an op without a gradient "
                 "(%s): %s", len(blocked), ", ".join(sorted({op.name for op in graph.ops if not op.differentiable})),
                 ", ".join(sorted(blocked)))
    units = candidate_units(graph, importance)
    base = Plan(graph=graph.name, params=tuple(ParamPlan(p.name, Mode.FROZEN) for p in graph.params),
                batch_windows=batch_windows, micro_batch_windows=batch_windows, n_windows=n_windows,
                optimizer=optimizer)
    chains: dict = {}

    def solve(m: int, cache_only: bool = False):
        problem = build_problem(graph, units, cost, micro_batch_windows=m, n_windows=n_windows, optimizer=optimizer,
                                allow_cache=allow_cache, allow_remat=allow_remat, _chain_cache=chains)
        if cache_only:
            keep = [j for j, c in enumerate(problem.configs) if c.cache_features]
            problem = replace(problem, configs=tuple(problem.configs[j] for j in keep),
                              opt_fixed=tuple(problem.opt_fixed[j] for j in keep))
        for slack in (0, 8, 64):  # the solvers see real-valued byte sums; predict rounds up
            sel = select_milp(problem, budget - slack) if solver == "milp" else None
            if sel is None:
                sel = select_greedy(problem, budget - slack)
            if sel is None:
                return None
            plan, remat = _plan_from_selection(graph, problem, sel, base)
            if remat:
                plan = _with_remat(graph, plan, cost, budget, minimal=False) or plan
            if predict(graph, plan, cost).peak_bytes <= budget:
                return sel.importance, plan
        return None

    results = [(r[0], m, r[1]) for m in sizes if (r := solve(m)) is not None]
    best = max((r[0] for r in results), default=-math.inf)
    # The selection bounds a configuration's activations by training everything after its first
    # op, so near the smallest budget it can miss plans that fit: a single update, costed
    # exactly, that beats its best is taken (and is the answer when the selection finds none).
    singles, forms = _singles(graph, units), _Forms(graph, cost, base, allow_cache)
    single = _best_single(graph, singles, forms, budget, allow_remat, sizes, above=best)
    if single is not None:
        return _finish(graph, single[1], budget, cost)
    if not results:
        _, smallest = _smallest_plan(graph, singles, forms, allow_remat)
        raise NoFeasiblePlan(smallest.peak_bytes, budget, smallest.where)
    # Within rounding of the best (and of the tolerance): importance is compared, never a speed
    # preference, so the chosen importance is the best over every form and grows with the budget.
    floor = (1.0 - importance_tolerance) * best - 1e-9 * max(1.0, abs(best))
    value, m, plan = next(r for r in results if r[0] >= floor)  # largest micro first
    if allow_cache and not plan.cache_features:
        # Caching runs the prefix once per call instead of every epoch: taken at equal importance.
        cached = solve(m, cache_only=True)
        if cached is not None and cached[0] >= floor:
            plan = cached[1]
    return _finish(graph, plan, budget, cost)


def replan(graph: Graph, plan: Plan, n_windows: int, budget_bytes: int | None = None, *,
           cost: CostModel | None = None, allow_cache: bool | None = None) -> Plan:
    """Re-plan ``plan`` for ``n_windows`` windows (the device's real count), keeping its updates,
    cut and recompute actions; the micro-batch and feature caching are chosen again.

    Args:
        graph: the model's IR (the bundle's manifest "graph").
        plan: the exported plan.
        n_windows: the real number of adaptation windows.
        budget_bytes: default: the plan's own budget.
        cost: cost constants (default: the calibrated ones).
        allow_cache: default: whether the plan caches (a bundle without a prefix model cannot).

    Raises:
        NoFeasiblePlan: no micro-batch / caching choice fits; ``need_bytes`` is the smallest budget.
    """
    cost = cost or CostModel.default()
    budget = plan.budget_bytes if budget_bytes is None else parse_bytes(budget_bytes)
    if budget is None:
        raise ValueError("the plan has no budget; pass budget_bytes")
    cache_options = [plan.cache_features] if allow_cache is None else ([True, False] if allow_cache else [False])
    if not plan.cache_features:
        cache_options = [False]
    best_fail: tuple[int, str] | None = None
    for m in micro_batch_sizes(plan.batch_windows):
        for cache in cache_options:
            trial = replace(plan, n_windows=n_windows, micro_batch_windows=m, cache_features=cache,
                            predicted=None, budget_bytes=budget)
            peak = predict(graph, trial, cost)
            if peak.peak_bytes <= budget:
                return _finish(graph, trial, budget, cost)
            if best_fail is None or peak.peak_bytes < best_fail[0]:
                best_fail = (peak.peak_bytes, peak.where)
    raise NoFeasiblePlan(best_fail[0], budget, best_fail[1],
                         detail=f"no micro-batch fits {n_windows} windows; the smallest budget that fits is "
                                f"{best_fail[0]} bytes: raise the budget or adapt on fewer windows")


def refit(graph: Graph, plan: Plan, *, keep_activations: Iterable[str] = (), cache_features: bool | None = None,
          allow_remat: bool = True, cost: CostModel | None = None) -> Plan:
    """Plan ``plan``'s updates again under a constraint met while carrying the plan out.

    The trained parameters stay. The saved activations of the ops in ``keep_activations`` are
    kept (never recomputed); with ``cache_features=False`` the prefix's features are not cached
    (the prefix runs with every micro-batch); without ``allow_remat`` nothing is recomputed. With
    a budget, the fastest plan under these constraints within it is chosen again (the largest
    micro-batch, then no recompute before the least recompute FLOPs) and verified; without one,
    the plan takes the constraints and is predicted.

    Raises:
        NoFeasiblePlan: nothing under these constraints fits the plan's budget; ``need_bytes``
            is the smallest budget that would.
    """
    cost = cost or CostModel.default()
    keep = frozenset(keep_activations)
    form = replace(plan, predicted=None)
    if cache_features is False and plan.cache_features:
        form = replace(form, cut=cut_of(graph, plan.params), cache_features=False)
    if plan.budget_bytes is None:
        form = replace(form, activations=tuple((n, Action.KEEP if n in keep or not allow_remat else a)
                                               for n, a in form.activations))
        return replace(form, predicted=predict(graph, form, cost))
    return _fit_fixed_updates(graph, form, plan.budget_bytes, cost, None, allow_remat,
                              micro_batch_sizes(plan.batch_windows), keep=keep)
