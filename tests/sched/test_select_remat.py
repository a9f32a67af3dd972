"""Update selection (MILP vs greedy vs brute force) and rematerialisation (DP vs brute force)."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from sched_testgraphs import random_graph

from edgeadapt.sched import CostModel, Op, Param, Graph
from edgeadapt.sched.remat import (Chain, brute_force_schedule, chain_flops, chain_from_graph, chain_peak,
                                   min_flops_schedule, min_peak_schedule, sqrt_schedule)
from edgeadapt.sched.select import (build_problem, candidate_units, select_brute_force, select_greedy,
                                    select_milp, selection_peak)
from edgeadapt.sched.cost import activation_arrays, predict
from edgeadapt.sched.plan import Plan, ParamPlan, Action

COST = CostModel(session_overhead_bytes=50, per_window_bytes=2, grad_op_bytes=8)
RECURRENT_COST = CostModel(session_overhead_bytes=50, per_window_bytes=2, grad_op_bytes=8, recurrent_layer_bytes=300)


def _problem(rng, n_ops=6, m=2):
    g = random_graph(rng, n_ops)
    importance = {p.name: rng.choice([0.0, rng.random() * 10]) for p in g.params}
    units = candidate_units(g, importance)
    return g, build_problem(g, units[:10], COST, micro_batch_windows=m, n_windows=rng.randint(1, 20),
                            optimizer=rng.choice(["adamw", "sgd"]))


def _peak_range(problem) -> tuple[float, float]:
    """The smallest single-unit peak and three times the largest: budgets from tight to loose."""
    peaks = [selection_peak(problem, (u,), j) for u in range(len(problem.units))
             for j in range(len(problem.configs))]
    peaks = [p for p in peaks if p != float("inf")]
    return min(peaks), max(peaks) * 3


def _compare_solvers(problem, budget: int, abs_tol: float):
    """Brute force, MILP and greedy at ``budget``: all infeasible together, else MILP equals brute
    force, fits the budget and is never below greedy. Returns ``(exact, milp, greedy)``, or
    ``None`` when nothing fits."""
    exact = select_brute_force(problem, budget)
    milp = select_milp(problem, budget)
    greedy = select_greedy(problem, budget)
    if exact is None:
        assert milp is None and greedy is None
        return None
    assert milp.importance == pytest.approx(exact.importance, rel=1e-9, abs=abs_tol)
    assert selection_peak(problem, milp.units, milp.config) <= budget
    assert greedy is not None and greedy.importance <= milp.importance + 1e-9
    return exact, milp, greedy


def test_milp_matches_brute_force_and_beats_greedy():
    rng = random.Random(3)
    checked = 0
    for _ in range(40):
        g, problem = _problem(rng, rng.randint(2, 7), rng.randint(1, 3))
        lo, hi = _peak_range(problem)
        for budget in (int(lo), int((lo + hi) / 2), int(hi)):
            checked += _compare_solvers(problem, budget, abs_tol=1e-9) is not None
    assert checked > 40


def test_greedy_equals_milp_with_uniform_costs():
    # Eight equal units on one op: activations do not depend on the choice, so taking the most
    # important units first is optimal.
    ops = (Op("a", "Linear", tuple(f"w{i}" for i in range(8)), (), 40, 20),)
    g = Graph(ops, tuple(Param(f"w{i}", (4,), module="a") for i in range(8)), 16, "uniform")
    rng = random.Random(5)
    for _ in range(20):
        importance = {f"w{i}": rng.random() for i in range(8)}
        problem = build_problem(g, candidate_units(g, importance), COST, micro_batch_windows=1, n_windows=4,
                                optimizer="adamw")
        one = selection_peak(problem, (0,), 0)
        for k in range(1, 9):
            budget = int(one + (k - 1) * problem.train_factor * 16) + 1
            greedy, milp = select_greedy(problem, budget), select_milp(problem, budget)
            assert len(greedy.units) == len(milp.units) == k
            assert greedy.importance == pytest.approx(milp.importance)


def test_channel_groups_follow_importance():
    g = Graph((Op("conv", "Conv", ("conv.weight",), (), 10, 10),),
              (Param("conv.weight", (32, 4, 3), module="conv"),), 8, "c")
    per_channel = [float(c % 7) for c in range(32)]
    units = candidate_units(g, {"conv.weight": per_channel}, channel_groups=4)
    assert len(units) == 4 and sum(len(u.channels) for u in units) == 32
    assert units[0].importance == max(u.importance for u in units)
    assert all(u.trained_bytes == len(u.channels) * 4 * 3 * 4 for u in units)
    with pytest.raises(ValueError, match="one per output channel"):
        candidate_units(g, {"conv.weight": [1.0, 2.0]})


def _random_chain(rng, m):
    return Chain(tuple(f"e{i}" for i in range(m)), tuple(rng.randint(1, 50) for _ in range(m)),
                 tuple(rng.randint(1, 100) for _ in range(m)), tuple(rng.randint(1, 60) for _ in range(m)),
                 tuple(rng.randint(1, 60) for _ in range(m)), rng.randint(0, 60), rng.choice([-1, rng.randint(0, 60)]))


def test_remat_dp_matches_brute_force():
    rng = random.Random(11)
    for _ in range(150):
        chain = _random_chain(rng, rng.randint(0, 10))
        keep_all = chain_peak(chain, (False,) * len(chain))
        limit = rng.randint(0, keep_all + 5)
        exact, dp = brute_force_schedule(chain, limit), min_flops_schedule(chain, limit, max_front=None)
        assert (exact is None) == (dp is None)
        if exact is not None:
            assert chain_peak(chain, dp) <= limit
            assert chain_flops(chain, dp) == chain_flops(chain, exact)
        low, schedule = min_peak_schedule(chain, max_front=None)
        brute_low = min(chain_peak(chain, tuple(bool(mask >> e & 1) for e in range(len(chain))))
                        for mask in range(1 << len(chain)))
        assert low == brute_low == chain_peak(chain, schedule)
        assert low <= chain_peak(chain, sqrt_schedule(chain))


def test_capped_front_stays_within_limit_on_long_chains():
    rng = random.Random(2)
    chain = _random_chain(rng, 120)
    low, schedule = min_peak_schedule(chain)  # capped fronts: the least-memory point always survives
    assert chain_peak(chain, schedule) == low
    limit = (low + chain_peak(chain, (False,) * 120)) // 2
    s = min_flops_schedule(chain, limit)
    assert chain_peak(chain, s) <= limit


def test_chain_peak_equals_predict_activation_peak():
    rng = random.Random(7)
    for _ in range(100):
        g = random_graph(rng, rng.randint(2, 10))
        trained = {g.params[-1].name, rng.choice(g.params).name}
        arr = activation_arrays(g, trained, 0)
        chain = chain_from_graph(g, arr)
        rec = tuple(rng.random() < 0.5 for _ in range(len(chain)))
        params = tuple(ParamPlan(p.name, "full" if p.name in trained else "frozen") for p in g.params)
        first = min(g.owner_index(n) for n in trained)
        acts = tuple((n, Action.RECOMPUTE) for n, r in zip(chain.names, rec) if r)
        plan = Plan(g.name, params, first - 1, 1, 1, 1, False, acts)
        peak = predict(g, plan, CostModel())
        held = peak.phases_bytes["rollback"]
        act = max(peak.phases_bytes["forward"], peak.phases_bytes.get("backward", 0)) - held
        assert act == chain_peak(chain, rec)


SPLIT_COST = CostModel(session_overhead_bytes=50, per_window_bytes=2, grad_op_bytes=8, graph_op_bytes=3,
                       channel_weight_factor=1.7)


def _split_problem(rng, m=1, n_ops=None):
    """A random graph whose weights form channel groups (2 per weight), costed with whole-weight
    copies of channel-split parameters (``channel_weight_factor``)."""
    g = random_graph(rng, n_ops or rng.randint(2, 5))
    importance = {p.name: [rng.random() ** 3 for _ in range(p.out_channels)] for p in g.params}
    units = candidate_units(g, importance, channel_groups=2, min_group_channels=1)[:12]
    problem = build_problem(g, units, SPLIT_COST, micro_batch_windows=m, n_windows=rng.randint(1, 20),
                            optimizer=rng.choice(["adamw", "sgd"]), allow_remat=False)
    return g, problem


def test_milp_counts_channel_weight_copies_exactly():
    """The whole-weight copies of a channel-split parameter (some but not all of its groups) are in
    the MILP exactly: it equals brute force and is never below greedy on problems where the term
    decides."""
    rng = random.Random(21)
    checked = split_chosen = decided = 0
    for _ in range(40):
        g, problem = _split_problem(rng, rng.randint(1, 3))
        if not problem.splits:  # no weight with two or more output channels
            continue
        lo, hi = _peak_range(problem)
        for budget in (int(lo), int(lo * 1.3), int((lo + hi) / 2), int(hi)):
            solved = _compare_solvers(problem, budget, abs_tol=1e-12)
            if solved is None:
                continue
            exact, milp, greedy = solved
            checked += 1
            assert selection_peak(problem, greedy.units, greedy.config) <= budget
            split_chosen += problem.split_bytes(milp.units) > 0
            free = select_brute_force(replace(problem, splits=()), budget)  # the copies not counted
            decided += free.importance > exact.importance + 1e-9
    assert checked > 60 and split_chosen > 0 and decided > 5


def _covered_selections(rng, g, problem, cost, n_windows: int, tries: int = 10) -> int:
    """For ``tries`` random selections of ``problem``'s units (built for ``n_windows``) under a
    random configuration they fit: ``predict`` of the plan made from it is at most ``selection_peak`` (up to rounding).
    Returns how many were checked."""
    from edgeadapt.sched.batching import _plan_from_selection
    from edgeadapt.sched.select import Selection

    base = Plan(g.name, tuple(ParamPlan(p.name, "frozen") for p in g.params), batch_windows=4,
                micro_batch_windows=problem.micro_batch_windows, n_windows=n_windows, optimizer="adamw")
    checked = 0
    for _ in range(tries):
        chosen = tuple(sorted(rng.sample(range(len(problem.units)), rng.randint(1, len(problem.units)))))
        configs = [j for j in range(len(problem.configs)) if selection_peak(problem, chosen, j) != float("inf")]
        if not configs:
            continue
        j = rng.choice(configs)
        plan, _ = _plan_from_selection(g, problem, Selection(chosen, j, 0.0), base)
        assert predict(g, plan, cost).peak_bytes <= selection_peak(problem, chosen, j) + 2
        checked += 1
    return checked


def test_selection_peak_covers_predict_with_channel_splits():
    """``selection_peak`` bounds ``predict`` from above (up to rounding) for any selection and
    configuration, channel-split parameters included: the solvers never accept what predict refuses."""
    rng = random.Random(8)
    checked = 0
    for _ in range(60):
        g, problem = _split_problem(rng, rng.randint(1, 4))
        n_windows = rng.randint(1, 20)
        problem = build_problem(g, problem.units, SPLIT_COST, micro_batch_windows=problem.micro_batch_windows,
                                n_windows=n_windows, optimizer="adamw", allow_remat=False)
        checked += _covered_selections(rng, g, problem, SPLIT_COST, n_windows)
    assert checked > 200


def test_selection_peak_covers_predict_with_parameter_copies():
    """Ops reading copies of their parameters (``Op.param_copy_bytes`` / ``param_grad_bytes``) and
    recurrent layers with a fixed cost (``recurrent_layers``): ``selection_peak`` still bounds
    ``predict`` from above for any selection and configuration."""
    rng, sizes = random.Random(9), random.Random(10)
    checked = 0
    for _ in range(60):
        g = random_graph(rng, rng.randint(1, 6))
        g = replace(g, ops=tuple(replace(o, param_copy_bytes=sizes.choice([0, sizes.randint(1, 400)]),
                                         param_grad_bytes=sizes.choice([0, sizes.randint(1, 1200)]),
                                         recurrent_layers=sizes.choice([0, 0, 1]))
                                 for o in g.ops))
        importance = {p.name: rng.random() for p in g.params}
        n_windows = rng.randint(1, 20)
        problem = build_problem(g, candidate_units(g, importance)[:10], RECURRENT_COST,
                                micro_batch_windows=rng.randint(1, 3), n_windows=n_windows, optimizer="adamw",
                                allow_remat=False)
        checked += _covered_selections(rng, g, problem, RECURRENT_COST, n_windows)
    assert checked > 200
