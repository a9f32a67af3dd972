"""What the planner accepts, the step holds: on seeded random models (plain residual MLPs with a
wide or narrow head, a model with parameters and dropout in its own code, a CNN), tiers and
recompute settings, at the smallest budget the planner names and just above it, the trainer's
tracked peak never exceeds the plan's prediction (nor the budget: no BudgetExceeded)."""

from __future__ import annotations

import random

import pytest
import torch
from server_helpers import make_cnn, make_mlp, make_root

from edgeadapt.sched import NoFeasiblePlan
from edgeadapt.server import Trainer
from edgeadapt.server.trainer import plan_training


def _case(rng: random.Random):
    batch = rng.randint(2, 12)
    kind = rng.choice(["mlp", "root", "cnn"])
    if kind == "mlp":
        kw = dict(width=rng.choice([16, 32, 64]), depth=rng.randint(1, 4), n_classes=rng.choice([5, 64, 300]))
        return (lambda: make_mlp(**kw)), torch.randn(batch, 12), torch.randint(0, kw["n_classes"], (batch,))
    if kind == "root":
        width = rng.choice([16, 32])
        return (lambda: make_root(width=width)), torch.randn(batch, 12), torch.randint(0, 5, (batch,))
    return make_cnn, torch.randn(batch, 4, 16), torch.randint(0, 3, (batch,))


@pytest.mark.parametrize("seed", range(6))
def test_budgets_the_planner_accepts_hold_in_the_step(seed, tmp_path):
    rng = random.Random(seed)
    for case in range(4):
        make, x, y = _case(rng)
        offload, recompute = rng.choice(["host", "disk"]), rng.choice([True, False, "auto"])
        with pytest.raises(NoFeasiblePlan) as e:
            plan_training(make(), x, offload=offload, memory_budget=100, device="cpu", recompute=recompute,
                          example_target=y)
        need = e.value.need_bytes
        for budget in (need, need + rng.randint(1, 2000), int(need * 1.3)):
            t = Trainer(make(), optimizer={"name": "adamw", "lr": 1e-3}, memory_budget=budget, offload=offload,
                        offload_dir=tmp_path / f"{case}-{budget}", device="cpu", recompute=recompute,
                        example_input=x)
            t.step(x, y)
            assert t.tracked_peak_bytes <= t.plan.predicted.peak_bytes <= budget, (offload, recompute, budget)
            t.close()
