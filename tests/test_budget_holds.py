"""The memory budget binds the whole adapt call's anonymous memory in the user's own process.

Each reference model and each of four user-style nets (GRU, GroupNorm, Conv2d, MLP; none of
them fitted by the cost model) is exported at three budgets from its smallest feasible one to
full fine-tuning's predicted peak; one adapt call (progress bar on) is measured by the project's
measuring protocol in two fresh torch-free processes: a user's (bundle loaded, a prediction
made, heap as it is) and the bound (bundle loaded, freed heap returned to the OS before the
call: every page the call touches counts). Both must stay within the budget.
"""

from __future__ import annotations

import pytest

from edgeadapt.harness.budget_check import (REFERENCE_MODELS, USER_MODELS, CheckSettings, build, check_budget,
                                            model_budgets)

SETTINGS = CheckSettings(n_windows=24, batch_windows=8, epochs=2, channels=8, time_steps=64, classes=5)


@pytest.mark.slow
@pytest.mark.parametrize("name", REFERENCE_MODELS + USER_MODELS)
def test_the_budget_holds_in_a_users_process(name, tmp_path, one_torch_thread):
    model, example = build(name, SETTINGS)
    budgets = model_budgets(model, example, SETTINGS, 3)
    assert len(budgets) == 3
    for budget in budgets:
        row = check_budget(name, budget, tmp_path, SETTINGS)
        assert row["steps"] == 2 * 3 and row["predicted_bytes"] <= budget
        assert row["call_peak_anon_bytes"] <= budget, row
        assert row["user_anon_bytes"] <= budget, row
