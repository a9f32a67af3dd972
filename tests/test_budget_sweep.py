"""benchmarks/budget_sweep.py: its helpers, and a smoke run of its measuring workers at the smallest sizes."""

from __future__ import annotations

import json

import pytest
from helpers import load_benchmark

from edgeadapt.harness.budget_check import budget_ladder



@pytest.fixture(scope="module")
def bs():
    return load_benchmark("budget_sweep")


def test_ladder_is_geometric_and_keeps_both_ends():
    ladder = budget_ladder(1000, 64000, 7)
    assert ladder[0] == 1000 and ladder[-1] == 64000 and len(ladder) == 7
    steps = [b / a for a, b in zip(ladder, ladder[1:])]
    assert all(s == pytest.approx(2.0, rel=1e-3) for s in steps)


def test_ladder_adds_extra_budgets_inside_only():
    ladder = budget_ladder(1000, 8000, 2, extra=(500, 3000, 8000, 9000))
    assert ladder == [1000, 3000, 8000]
    # 4000 (the ladder's middle point) is within 10 % of 3700: the extra value takes its place.
    assert budget_ladder(1000, 16000, 5, extra=(3700,)) == [1000, 2000, 3700, 8000, 16000]
    assert budget_ladder(5, 5, 3) == [5]
    with pytest.raises(ValueError, match="count"):
        budget_ladder(1, 2, 1)
    with pytest.raises(ValueError, match="low_bytes"):
        budget_ladder(0, 2, 3)


def test_pareto_front_drops_dominated_points(bs):
    points = [(10.0, 0.80), (5.0, 0.90), (20.0, 0.95), (7.0, 0.85), (30.0, 0.95)]
    # (10, .80) and (7, .85) are dominated by (5, .90); (30, .95) by (20, .95).
    assert bs.pareto_front(points) == [1, 2]


def test_summary_ratios_and_points_vs_full(bs):
    rows = [{"subject": s, "method": m, "accuracy": a, "call_peak_bytes": c, "call_peak_anon_bytes": c // 2,
             "trainable_numel": n}
            for s, m, a, c, n in ((1, "full", 0.90, 8000, 100), (2, "full", 0.80, 8000, 100),
                                  (1, "budget 1 KiB", 0.88, 400, 5), (2, "budget 1 KiB", 0.80, 200, 5))]
    rows.append({"subject": 3, "method": "budget 1 KiB", "error": "boom"})
    summ = bs.loso_summary(rows, ["full", "budget 1 KiB"], {"call_peak_bytes": 6000, "call_peak_anon_bytes": 3000})
    b = summ["budget 1 KiB"]
    assert b["mean_accuracy"] == pytest.approx(0.84) and b["worst_subject"] == 2
    assert b["median_call_peak_bytes"] == 300 and b["torch_over_runner"] == pytest.approx(20.0)
    assert b["torch_over_runner_anon"] == pytest.approx(3000 / 150)
    assert b["vs_full_points"] == pytest.approx(-1.0) and b["errors"] == ["boom"]


@pytest.mark.slow
def test_workers_measure_a_budget_bundle_and_torch_eager(bs, tmp_path):
    """Export the CNN at its smallest feasible budget (8 x 32 input), adapt it in the torch-free
    worker and run torch eager full fine-tuning in the other: both report their peaks."""
    import torch

    model = bs.reference_model("cnn", 8, 7, 32, seed=0)
    example = torch.zeros(2, 8, 32)
    ladder = bs.model_ladder(model, example, n_windows=14, batch_windows=8, count=2)
    low = ladder["budgets"][0]
    assert low == ladder["minimum_budget_bytes"] < ladder["full_predicted_bytes"]
    manifest, _ = bs.export_bundle_at(model, example, tmp_path / "bundle", lr=1e-3, budget=low, n_windows=14,
                                      batch_windows=8)
    assert manifest["plan"]["predicted_peak_bytes"] <= low
    spec = {"bundle": str(tmp_path / "bundle"), "n_windows": 14, "batch_windows": 8, "epochs": 1, "threads": 1,
            "seed": 0, "lr": 1e-3}
    run = bs.run_worker("runner", spec, tmp_path / "run")
    assert run["torch_imported"] is False
    assert run["trainable_numel"] == bs.manifest_trainable(manifest) > 0
    assert run["steps"] == 2 and len(run["epoch_losses"]) == 1
    # the call opens the training session (> 0 bytes); one step lies inside the whole call
    assert 0 < run["step_peak_bytes"] <= run["call_peak_bytes"]
    assert 0 < run["step_peak_anon_bytes"] <= run["call_peak_anon_bytes"]
    state = tmp_path / "state.pt"
    torch.save(model.state_dict(), state)
    eager = bs.run_worker("torch", {"model": "cnn", "state_dict": str(state), "n_channels": 8, "n_classes": 7,
                                    "time_steps": 32, "n_windows": 14, "batch_windows": 8, "epochs": 1,
                                    "threads": 1, "seed": 0, "lr": 1e-3}, tmp_path / "torch")
    assert eager["steps"] == 2 and eager["total_numel"] == sum(p.numel() for p in model.parameters())
    assert 0 <= eager["step_peak_bytes"] <= eager["call_peak_bytes"]
    assert 0 <= eager["step_peak_anon_bytes"] <= eager["call_peak_anon_bytes"]
    assert json.loads((tmp_path / "run" / "runner_report.json").read_text()) == run


def test_study_budget_method_exports_the_planners_choice(tmp_path):
    """The budget method of quickstart/LOSO (``--memory-budget``): the planner picks what trains
    within the budget, for the adaptation set's size and the job's batch."""
    import numpy as np
    import torch

    from edgeadapt.harness import study
    from edgeadapt.models import build_model

    name = study.budget_method("600KiB")
    try:
        assert study.budget_method("600KiB") == name and study.METHODS[name].memory_budget == "600KiB"
        torch.manual_seed(0)
        model = build_model("cnn", 6, 7, 100).eval()
        X = np.random.default_rng(0).standard_normal((21, 6, 100)).astype(np.float32)
        recipe = study.export_method(name, model, "cnn", X, tmp_path / "bundle", batch_windows=8)
        plan = json.loads((tmp_path / "bundle" / "manifest.json").read_text())["plan"]
        assert recipe["policy"] == "planned within 600KiB"
        assert (plan["budget_bytes"], plan["n_windows"], plan["batch_windows"]) == (600 * 1024, 21, 8)
        assert 0 < plan["predicted_peak_bytes"] <= 600 * 1024
        assert any(p["mode"] != "frozen" for p in plan["params"])
    finally:
        study.METHODS.pop(name, None)


def test_study_budget_method_fits_a_given_policy(tmp_path):
    """A budget method given a policy (the validated choice) exports that policy within its budget."""
    import numpy as np
    import torch

    from edgeadapt.export import UpdatePolicy
    from edgeadapt.harness import study
    from edgeadapt.models import build_model

    name = study.budget_method("900KiB")
    try:
        torch.manual_seed(0)
        model = build_model("cnn", 6, 7, 100).eval()
        X = np.random.default_rng(0).standard_normal((21, 6, 100)).astype(np.float32)
        recipe = study.export_method(name, model, "cnn", X, tmp_path / "bundle", batch_windows=8,
                                     policy=UpdatePolicy.parse("head=full,blocks.3.bn=full"))
        plan = json.loads((tmp_path / "bundle" / "manifest.json").read_text())["plan"]
        assert recipe["policy"].startswith("planned within 900KiB: ")
        assert {p["name"] for p in plan["params"] if p["mode"] != "frozen"} == {
            "head.weight", "head.bias", "blocks.3.bn.weight", "blocks.3.bn.bias"}
        assert plan["budget_bytes"] == 900 * 1024 and 0 < plan["predicted_peak_bytes"] <= 900 * 1024
    finally:
        study.METHODS.pop(name, None)


def test_loso_budget_method_is_chosen_on_source_subjects():
    import argparse

    import torch

    from edgeadapt.datasets import SyntheticConfig, make_synthetic
    from edgeadapt.harness import study
    from helpers import load_benchmark

    loso = load_benchmark("loso")
    ds = make_synthetic(SyntheticConfig(n_subjects=3, windows_per_subject=40, n_time_steps=64))
    split = study.make_split(ds, 2, 2, 0)
    torch.manual_seed(0)
    model = study.pretrain_source("cnn", split, epochs=1, seed=0)
    name = study.budget_method("2MiB")
    try:
        args = argparse.Namespace(epochs=1, k_per_class=2, pretrain_epochs=1, selection_subjects=1, seed=0,
                                  threads=1, model="cnn")
        choice = loso.validated_update(args, ds, 2, model, split, name, 3e-3)
        assert choice.budget_bytes == 2 * 1024 * 1024
        assert choice.chosen.plan is not None and choice.chosen.predicted_peak_bytes <= choice.budget_bytes
        assert all(len(c.gains) == 1 for c in choice.candidates if c.plan is not None)
    finally:
        study.METHODS.pop(name, None)
