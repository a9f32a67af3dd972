"""Adapt calls held to the bundle's memory budget (runtime.call_plan): within the plan they run as
planned; more windows or a larger micro-batch are planned again within the budget or refused."""

from __future__ import annotations

import random
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from edgeadapt.runtime.call_plan import CallPlan
from edgeadapt.sched import BudgetExceeded, minimum_budget, plan_for_budget, predict

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sched"))
from sched_testgraphs import conv_graph  # noqa: E402  (the planner tests' graphs)


def _cached_plan():
    """A conv graph and a budget plan over 16 windows (batch 8) that caches the prefix's features."""
    rng = random.Random(3)
    for _ in range(40):
        g = conv_graph(rng, 4)
        for factor in (1.2, 1.5, 2.0, 3.0):
            budget = int(minimum_budget(g, n_windows=16, batch_windows=8) * factor)
            plan = plan_for_budget(g, budget, n_windows=16, batch_windows=8)
            if plan.cache_features and plan.micro_batch_windows > 1:
                return g, plan
    pytest.skip("no cached plan with micro-batches > 1 found")


def _manifest(g, plan):
    return SimpleNamespace(plan=plan.to_dict(), graph=g.to_dict())


def test_a_call_within_the_plan_runs_as_planned():
    g, plan = _cached_plan()
    cp = CallPlan(_manifest(g, plan), "ort-training")
    m = plan.micro_batch_windows
    assert cp.micro_batch(16, 8, m, False, False) == m
    assert cp.micro_batch(10, 64, m, False, False) == m  # a larger batch only adds micro-batches
    assert cp.micro_batch(16, 8, 1, True, False) == 1


def test_more_windows_are_planned_again_within_the_budget_or_refused():
    g, plan = _cached_plan()
    cp = CallPlan(_manifest(g, plan), "ort-training")
    for n in (17, 64, 400, 40_000):
        try:
            m = cp.micro_batch(n, 8, plan.micro_batch_windows, False, False)
        except BudgetExceeded as e:
            assert e.need_bytes > e.have_bytes == plan.budget_bytes
            assert f"{n} windows" in str(e)
            continue
        assert 1 <= m <= plan.micro_batch_windows
        again = replace(plan, n_windows=n, micro_batch_windows=m, predicted=None)
        assert predict(g, again).peak_bytes <= plan.budget_bytes
    with pytest.raises(BudgetExceeded):  # the cache alone outgrows any budget
        cp.micro_batch(10**9, 8, plan.micro_batch_windows, False, False)


def test_an_explicit_micro_batch_over_the_budget_is_refused():
    g, plan = _cached_plan()
    tight = replace(plan, budget_bytes=plan.predicted.peak_bytes)  # no room above the planned micro-batch
    cp = CallPlan(_manifest(g, tight), "ort-training")
    with pytest.raises(BudgetExceeded, match="micro-batches of 8"):
        cp.micro_batch(16, 8, 8, True, False) if plan.micro_batch_windows < 8 else cp.micro_batch(16, 16, 16, True,
                                                                                                  False)


def test_bundles_without_a_budget_are_not_checked():
    cp = CallPlan(SimpleNamespace(plan=None, graph=None), "ort-training")
    assert cp.budget_bytes is None and cp.micro_batch(10**6, 512, 512, True, False) == 512


def test_calls_are_predicted_with_the_running_engines_constants():
    """A micro-batch the ONNX Runtime training engine fits exactly is over the budget on the
    portable engine, whose measured constants are larger."""
    from edgeadapt.sched import CostModel

    g, plan = _cached_plan()
    m = 2 * plan.micro_batch_windows
    trial = replace(plan, batch_windows=m, micro_batch_windows=m, predicted=None)
    ort, portable = (predict(g, trial, CostModel.default(e)).peak_bytes for e in ("ort-training", "portable"))
    assert portable > ort
    exact = replace(plan, budget_bytes=ort)
    assert CallPlan(_manifest(g, exact), "ort-training").micro_batch(16, m, m, True, False) == m
    with pytest.raises(BudgetExceeded):
        CallPlan(_manifest(g, exact), "portable").micro_batch(16, m, m, True, False)


def _label_free_peak(g, plan, passes, stats, held=10_000):
    from edgeadapt.sched import CostModel, predict_label_free

    return predict_label_free(g, plan, CostModel.default(), held_bytes=held, pass_windows=passes,
                              stats_windows=stats, view_bytes_per_window=16 * g.input_bytes).peak_bytes


@pytest.mark.parametrize("stats", [True, False])
def test_label_free_passes_are_the_largest_that_fit_or_refused(stats):
    g, plan = _cached_plan()
    held = 10_000
    for budget_factor in (0.5, 1.0, 1.5, 3.0, 10.0):
        budget = int(plan.budget_bytes * budget_factor)
        cp = CallPlan(_manifest(g, replace(plan, budget_bytes=budget)), "ort-training")
        kwargs = dict(held_bytes=held, max_pass_windows=256, max_stats_windows=64 if stats else None,
                      min_stats_windows=4, view_bytes_per_window=16 * g.input_bytes, entropy_steps=False)
        try:
            passes, stats_windows, entropy_batch, predicted = cp.label_free_passes(**kwargs)
        except BudgetExceeded as e:
            assert e.need_bytes > e.have_bytes == budget and "label-free" in str(e)
            smallest = _label_free_peak(g, plan, 1, 4 if stats else None, held)
            assert smallest > budget
            continue
        assert entropy_batch is None and (stats_windows is None) == (not stats)
        assert _label_free_peak(g, plan, passes, stats_windows, held) == predicted.peak_bytes <= budget
        if passes < 256:  # the next size up would not fit
            assert _label_free_peak(g, plan, passes * 2, stats_windows, held) > budget
        if stats and stats_windows < 64:
            assert _label_free_peak(g, plan, 1, stats_windows * 2, held) > budget


def test_label_free_passes_without_a_budget_are_the_maxima():
    cp = CallPlan(SimpleNamespace(plan=None, graph=None), "ort-training")
    assert cp.label_free_passes(held_bytes=0, max_pass_windows=256, max_stats_windows=64, min_stats_windows=4,
                                view_bytes_per_window=0, entropy_steps=True) == (256, 64, None, None)


def test_a_report_on_a_bundle_without_a_budget_predicts_but_leaves_calls_unchecked():
    """A plan without a budget (a hand-written policy) still predicts a label-free call for a
    report; its calls stay unchecked afterwards, and without a plan there is nothing to predict."""
    g, plan = _cached_plan()
    unbudgeted = replace(plan, budget_bytes=None)
    cp = CallPlan(_manifest(g, unbudgeted), "ort-training")
    assert cp.budget_bytes is None
    kwargs = dict(held_bytes=1000, pass_windows=8, stats_windows=4, view_bytes_per_window=64)
    from edgeadapt.sched import CostModel, predict_label_free

    peak = cp.predict_label_free(**kwargs)
    assert peak == predict_label_free(g, unbudgeted, CostModel.default("ort-training"), **kwargs)
    assert cp.micro_batch(10**6, 512, 512, True, False) == 512  # still not checked
    assert cp.label_free_passes(held_bytes=0, max_pass_windows=256, max_stats_windows=64, min_stats_windows=4,
                                view_bytes_per_window=0, entropy_steps=True) == (256, 64, None, None)
    assert CallPlan(SimpleNamespace(plan=None, graph=None), "ort-training").predict_label_free(**kwargs) is None
