"""benchmarks/budget_table.py's report and edgeadapt.harness.budget_check.summarize: what counts
as within the budget and within tolerance, and rows without an expected figure (a bundle without
a graph) or whose export failed."""

from __future__ import annotations

import math

import pytest
from helpers import load_benchmark

from edgeadapt.harness.budget_check import CheckSettings, summarize



@pytest.fixture(scope="module")
def bt():
    return load_benchmark("budget_table")


def _row(model, budget, anon, predicted, expected):
    return {"model": model, "budget_bytes": budget, "trainable_numel": 7, "micro_batch_windows": 1,
            "predicted_bytes": predicted, "expected_bytes": expected, "call_peak_anon_bytes": anon,
            "call_peak_bytes": anon + 1000, "user_anon_bytes": anon // 2, "user_total_bytes": anon,
            "predicted_over_anon": predicted / anon,
            "expected_over_anon": math.nan if expected is None else expected / anon}


def test_counts_and_a_row_without_an_expected_figure(bt):
    rows = [_row("a", 1000, 900, 1000, 950),   # within the budget, expected within 15 %
            _row("b", 1000, 1100, 1000, 700),  # over the budget, expected 0.64x
            _row("c", 2000, 1000, 2000, None),  # no expected figure
            {"model": "d", "budget_bytes": 10, "error": "ValueError: no plan fits"}]
    s = summarize(rows)
    assert s == {"rows": 3, "within_budget": 2, "user_within_budget": 3, "within_tolerance": 1,
                 "bound_within_tolerance": 2}
    md = bt.to_markdown(rows, "budget_table.py", CheckSettings())
    assert "| c | 2 | 7 | 1 | - | 2 |" in md and "**1** (over)" in md and "failed: ValueError" in md
    assert "expected within +-15 % of it: 1 of 3 (the bound: 2)" in md
