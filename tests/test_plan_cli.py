"""``edgeadapt plan``: the plan a bundle carries, measured in a fresh torch-free process, drawn;
``edgeadapt export --memory-budget``."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch
from helpers import make_cnn, strip_plan

from edgeadapt.bundle import read_manifest
from edgeadapt.cli import main
from edgeadapt.export import Rule, UpdatePolicy, export_bundle
from edgeadapt.cli.plan import draw_timeline, plan_report
from edgeadapt.runtime.call_plan import CallPlan
from edgeadapt.sched import BudgetExceeded

EXAMPLE = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(0))
PHASES = ("session", "features", "rollback", "forward", "backward", "optimizer")


@pytest.fixture(scope="module")
def planned_bundle(tmp_path_factory):
    out = tmp_path_factory.mktemp("plan") / "cnn"
    export_bundle(make_cnn(), EXAMPLE, out, policy=UpdatePolicy(rules=(Rule("head", "full"), Rule("dw", "full"))),
                  cache_features=True, n_windows=40, batch_windows=8)
    return out


def test_plan_prints_what_trains_cut_batch_and_phases(planned_bundle, capsys):
    assert main(["plan", str(planned_bundle)]) == 0
    text = capsys.readouterr().out
    for needle in ("trains", "head.weight", "dw.bias", "cut          after op", "prefix runs once per adapt call",
                   "expected     ", "point estimate",
                   "8 windows per step, micro-batches of 8", "planned for 40 adaptation windows",
                   "recompute", "predicted peak per phase", "<- peak"):
        assert needle in text, needle
    assert all(f"  {phase}" in text for phase in PHASES)


def test_plan_json_matches_the_manifest(planned_bundle, capsys):
    assert main(["plan", str(planned_bundle), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    manifest = read_manifest(planned_bundle)
    assert report["predicted"]["peak_bytes"] == manifest.plan["predicted_peak_bytes"]
    # the planner predicts the same peak again from the stored graph and plan
    assert report["predicted_now"]["peak_bytes"] == manifest.plan["predicted_peak_bytes"]
    assert report["cut"]["feature_cache_bytes"] == 40 * report["cut"]["features_bytes_per_window"] > 0
    assert {t["name"] for t in report["trains"]} == {"dw.weight", "dw.bias", "head.weight", "head.bias"}
    assert report["measured"] is None
    # the point estimate per engine the bundle holds, as the manifest stores it, never over the bound
    assert report["expected_bytes"] == manifest.plan["expected_peak_bytes"]
    assert set(report["expected_bytes"]) == set(manifest.backends)
    assert all(0 < v <= report["predicted_now"]["peak_bytes"] for v in report["expected_bytes"].values())


def test_plan_for_another_window_count_predicts_again(planned_bundle):
    small, large = (plan_report(planned_bundle, n_windows=n) for n in (10, 400))
    assert small["cut"]["feature_cache_bytes"] < large["cut"]["feature_cache_bytes"]
    assert small["predicted_now"]["peak_bytes"] < large["predicted_now"]["peak_bytes"]


@pytest.fixture(scope="module")
def budget_bundle(tmp_path_factory):
    """A 2 MiB budget for 40 windows, the head trained behind a cached prefix: the feature cache
    grows with the windows, past the budget at tens of thousands of them."""
    out = tmp_path_factory.mktemp("plan") / "budget"
    export_bundle(make_cnn(), EXAMPLE, out, policy=UpdatePolicy(rules=(Rule("head", "full"),)), memory_budget="2MiB",
                  n_windows=40, batch_windows=8)
    return out


def test_plan_for_more_windows_than_the_budget_allows_says_so_and_exits_2(budget_bundle, capsys):
    assert main(["plan", str(budget_bundle), "--n-windows", "200"]) == 0
    assert "OVER BUDGET" not in capsys.readouterr().out
    assert main(["plan", str(budget_bundle), "--n-windows", "100000", "--json"]) == 2
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert report["within_budget"] is False and report["need_bytes"] > report["budget_bytes"] == 2 * 2**20
    assert captured.err.startswith(f"error: plan needs {report['need_bytes']} bytes")
    assert "an adapt call over 100000 windows would be refused before any work" in captured.err
    assert main(["plan", str(budget_bundle), "--n-windows", "100000"]) == 2
    assert "OVER BUDGET  an adapt call over 100000 windows needs at least" in capsys.readouterr().out


def test_plan_agrees_with_the_adapt_call_on_what_fits(budget_bundle):
    """Around the window count where the plan's micro-batch leaves the budget: the report's verdict
    and micro-batch are the adapt call's (a smaller micro-batch chosen again, or refused)."""
    call = CallPlan(read_manifest(budget_bundle), "ort-training")
    base = plan_report(budget_bundle)
    crossing = 40 + (base["budget_bytes"] - base["predicted_now"]["peak_bytes"]) // base["cut"][
        "features_bytes_per_window"]
    seen = set()
    for n in (crossing - 100, crossing + 50, crossing + 200, crossing + 400, crossing + 800, crossing + 1600):
        report = plan_report(budget_bundle, n_windows=n)
        try:
            micro = call.micro_batch(n, 8, 8, explicit=False, fixed=False)
        except BudgetExceeded as e:
            assert report["within_budget"] is False and report["need_bytes"] == e.need_bytes, n
            seen.add("refused")
        else:
            assert report["within_budget"] is True and report["micro_batch_windows"] == micro, n
            seen.add("replanned" if report["replanned"] else "as planned")
    assert seen == {"as planned", "replanned", "refused"}


def test_measure_runs_a_torch_free_adapt_and_draws_the_timeline(planned_bundle, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "timeline.png"
    assert main(["plan", str(planned_bundle), "--measure", "--json", "--png", str(png)]) == 0
    report = json.loads(capsys.readouterr().out)
    m = report["measured"]
    assert m["torch_imported"] is False and m["n_windows"] == 40 and m["steps"] == 5
    assert m["call_peak_bytes"] > 0 and m["call_peak_anon_bytes"] > 0 and len(m["timeline"]) == m["samples"] >= 2
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_png_without_matplotlib_is_a_clear_error(planned_bundle, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(ImportError, match="pip install matplotlib"):
        draw_timeline(plan_report(planned_bundle), None, tmp_path / "t.png")


def test_a_bundle_without_a_plan_is_refused_with_the_fix(cnn_bundle, tmp_path, capsys):
    strip_plan(cnn_bundle, tmp_path / "old")
    assert main(["plan", str(tmp_path / "old")]) == 2
    err = capsys.readouterr().err
    assert "carries no memory plan" in err and "re-export" in err


def _export_cli(out, *extra: str) -> int:
    return main(["export", "helpers:make_cnn", "--input-shape", "4,16", "--out", str(out), "--n-windows", "32",
                 "--batch-windows", "8", *extra])


def test_export_with_a_budget_picks_a_plan_that_fits(tmp_path, capsys):
    assert _export_cli(tmp_path / "roomy", "--memory-budget", "64MiB") == 0
    assert "predicted peak of an adapt call over 32 windows" in capsys.readouterr().out
    plan = read_manifest(tmp_path / "roomy").plan
    assert plan["budget_bytes"] == 64 * 2**20 and 0 < plan["predicted_peak_bytes"] <= 64 * 2**20


def test_no_feasible_budget_names_the_smallest_that_fits(tmp_path, capsys):
    assert _export_cli(tmp_path / "tiny", "--memory-budget", "1KiB") == 2
    err = capsys.readouterr().err
    assert "smallest budget that fits is" in err and not (tmp_path / "tiny").exists()
    smallest = int(err.split("smallest budget that fits is ")[1].split(" ")[0])
    assert smallest > 1024
    # ... and that budget does fit
    assert _export_cli(tmp_path / "just", "--memory-budget", str(smallest)) == 0
    assert read_manifest(tmp_path / "just").plan["predicted_peak_bytes"] <= smallest


def test_a_given_policy_over_the_budget_is_refused_with_the_numbers(tmp_path, capsys):
    assert _export_cli(tmp_path / "full", "--policy", "full", "--memory-budget", "4KiB") == 2
    err = capsys.readouterr().err
    assert "bytes" in err and "budget" in err and not (tmp_path / "full").exists()


def test_plan_unlabeled_reports_the_label_free_call_within_the_budget(tmp_path, capsys):
    out = tmp_path / "lf"
    assert _export_cli(out, "--loss", "entropy", "--batchnorm", "batch", "--policy", "bias-norm",
                       "--memory-budget", "16MiB", "--backend", "ort-training") == 0
    capsys.readouterr()
    assert main(["plan", str(out), "--unlabeled", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["n_windows"] == 32 and report["gate_windows"] == 8 and report["budget_bytes"] == 16 * 2**20
    assert report["stages"] == ["stats", "prototypes"] and report["stats_windows"] >= 4
    assert 0 < report["predicted"]["peak_bytes"] <= report["budget_bytes"]
    assert report["measured"] is None
    # the same passes the call itself takes
    from edgeadapt.runtime import Runner
    from edgeadapt.runtime.unlabeled import UnlabeledAdapter

    adapter = UnlabeledAdapter(Runner.load(out, device="cpu", threads=1), gate_rows=8)
    assert (adapter.plan()["pass_windows"], adapter.plan()["stats_windows"]) == (report["pass_windows"],
                                                                              report["stats_windows"])
    assert main(["plan", str(out), "--unlabeled", "--measure"]) == 0
    text = capsys.readouterr().out
    assert "label-free   adapt_unlabeled over 32 windows" in text and "anonymous (RssAnon)" in text
    assert main(["plan", str(out), "--unlabeled", "--batch-windows", "4"]) == 2  # adapt's option: refused


def test_plan_unlabeled_predicts_the_call_of_a_bundle_without_a_budget(tmp_path, capsys):
    """Without a budget nothing is fitted, but the bundle's plan and graph still predict the call
    at its default passes, as `plan` predicts `adapt` without a budget."""
    out = tmp_path / "lf"
    assert _export_cli(out, "--loss", "entropy", "--batchnorm", "batch", "--policy", "bias-norm",
                       "--backend", "ort-training") == 0
    capsys.readouterr()
    assert main(["plan", str(out), "--unlabeled", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["budget_bytes"] is None
    peak = report["predicted"]
    assert peak is not None and peak["peak_bytes"] > report["held_bytes"]
    assert peak["peak_bytes"] == max(peak["phases_bytes"].values())  # the largest phase is the peak
    from edgeadapt import sched
    from edgeadapt.runtime.unlabeled import VIEW_BYTES_PER_INPUT_BYTE

    manifest = read_manifest(out, verify=False)

    window_bytes = int(np.prod(manifest.input.shape[1:])) * 4
    # cross-fitted: the call ends adapting on all 32 windows (8 held back at a time before that),
    # so no pass is larger than 32
    assert report["cross_fit"]
    adapted = report["n_windows"]

    def predicted(passes: int, stats: int) -> int:
        return sched.predict_label_free(
            sched.Graph.from_dict(manifest.graph), sched.Plan.from_dict(manifest.plan),
            sched.CostModel.default("ort-training"), held_bytes=report["held_bytes"], pass_windows=passes,
            stats_windows=stats, view_bytes_per_window=VIEW_BYTES_PER_INPUT_BYTE * window_bytes).peak_bytes

    assert adapted < report["pass_windows"]
    stats = min(adapted, report["stats_windows"])
    assert peak["peak_bytes"] == predicted(adapted, stats)  # the planner's figure at the call's passes
    assert peak["peak_bytes"] < predicted(report["pass_windows"], report["stats_windows"])
    assert main(["plan", str(out), "--unlabeled"]) == 0
    assert "  predicted  " in capsys.readouterr().out
