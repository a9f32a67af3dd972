"""`edgeadapt quickstart` end to end: small setting in the default run, full size marked slow."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from edgeadapt.datasets import WindowDataset
from edgeadapt.harness.quickstart import COMPARED, MAIN, quickstart_command, readme_table
from edgeadapt.runtime import Runner


def _run(out, *args: str) -> subprocess.CompletedProcess:
    """Run the CLI in a fresh interpreter."""
    proc = subprocess.run([sys.executable, "-m", "edgeadapt", "quickstart", "--out", str(out), *args],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _quickstart(out, *args: str) -> dict:
    """Run the CLI in a fresh interpreter; returns its report."""
    _run(out, *args)
    return json.loads((out / "report.json").read_text())


def _figures(report: dict) -> dict:
    """Everything a rerun must reproduce exactly: accuracies, losses, what was trained (not memory or time)."""
    rows = [r for r in (report["main"], *report["compared"]) if r["feasible"]]
    keys = ("method", "policy", "lr", "accuracy_before", "accuracy_after", "loss_after", "epoch_losses",
            "steps", "trainable_numel")
    return {"per_subject_source_only": report["per_subject_source_only"],
            "rows": [{k: r[k] for k in keys} for r in rows]}


def test_small_quickstart_end_to_end_and_reproducible_in_fresh_processes(tmp_path):
    # a budget below the smallest plan: known before pretraining, reported as an infeasible row
    proc = _run(tmp_path / "a", "--small", "--memory-budget", "1KiB")
    first = json.loads((tmp_path / "a" / "report.json").read_text())
    out = proc.stdout
    assert out.index("--memory-budget 1KiB is below the smallest plan") < out.index("pretrained cnn")
    budget_row = first["compared"][-1]
    assert budget_row["method"] == "budget-1KiB" and budget_row["feasible"] is False
    assert budget_row["minimum_budget_bytes"] > 1024
    assert f"{-(-budget_row['minimum_budget_bytes'] // 1024)}KiB or more runs it" in out
    # progress on stderr: pretraining epochs and every export's stages
    assert "pretrain" in proc.stderr and "export: self-check" in proc.stderr
    # the README's table is printed, from the report
    table = readme_table(first)
    assert table in out
    assert quickstart_command(first["config"]) == "edgeadapt quickstart --small --memory-budget 1KiB"
    assert ("| `--memory-budget 1KiB` (the planner's choice: no plan fits) | "
            "infeasible: the smallest plan needs") in table
    assert first["target_subject"] == 3
    assert (tmp_path / "a" / "accuracy.png").stat().st_size > 1000
    assert (tmp_path / "a" / "memory.png").stat().st_size > 1000
    rows = [first["main"], *first["compared"][:-1]]
    assert [r["method"] for r in rows] == [MAIN, *COMPARED]
    held_out = WindowDataset.load_npz(tmp_path / "a" / "work" / "target_eval.npz")
    for r, folder in zip(rows, ["main", *COMPARED]):
        assert f"| {r['accuracy_before']:.3f} → " in table and f"| {r['trainable_numel']:,} |" in table
        assert r["torch_imported"] is False and r["device"] == "cpu" and r["threads"] == 1
        # the reported accuracy is the adapted bundle's, computed here again from its logits
        adapted = Runner.load(tmp_path / "a" / "work" / folder / "adapted", device="cpu")
        assert r["n_eval_windows"] == len(held_out.y)
        assert r["accuracy_after"] == pytest.approx(float((adapted.predict(held_out.X).argmax(1) == held_out.y).mean()))
        # one step's peak lies inside the whole adapt call's, for total and anonymous memory
        assert 0 < r["step_peak_bytes"] <= r["call_peak_bytes"]
        assert 0 < r["step_peak_anon_bytes"] <= r["call_peak_anon_bytes"]
    trained = {r["method"]: r["trainable_numel"] for r in rows}
    assert trained["last-layer"] < trained["sparse"] < trained["full"]
    settings = first["settings"]
    assert settings["fixed_in_advance"] and settings["pretrain_threads"] == settings["adapt_threads"] == 1
    assert first["host"]["versions"]["onnxruntime"] and first["host"]["torch_cpu_capability"]
    # a second run, in another fresh process, into the same report folder (it replaces its own
    # work directory) gives the same figures to the last bit
    second = _quickstart(tmp_path / "a", "--small", "--memory-budget", "1KiB", "--no-progress")
    assert _figures(second) == _figures(first)
    assert second["compared"][-1] == budget_row


@pytest.mark.slow
def test_quickstart_default_improves_the_new_subject(tmp_path):
    main = _quickstart(tmp_path / "qs")["main"]
    # require a clear gain, not the exact figure (it depends on the CPU's kernels)
    assert main["accuracy_after"] >= main["accuracy_before"] + 0.1
