"""The label-free methods in the study registry and the choice of their settings."""

import pytest

from edgeadapt.harness.label_free import (
    HURT_PENALTY, HURT_TOLERANCE, LABEL_FREE_DEFAULTS, LABEL_FREE_GRID, selection_score,
)
from edgeadapt.harness.study import ALL_METHODS, LABEL_FREE, METHODS
from edgeadapt.runtime.unlabeled import UnlabeledSettings


def test_registry_entries():
    for name in ("anchored-bn", "reliable-entropy", "prototypes", "label-free"):
        m = METHODS[name]
        assert name in ALL_METHODS and name in LABEL_FREE
        assert m.unlabeled is not None and not m.trains  # no learning rate selected or fixed for it
        UnlabeledSettings.from_dict(m.unlabeled)  # valid settings
        assert m.batchnorm == "batch" and m.loss == "entropy"
    assert METHODS["label-free"].unlabeled == LABEL_FREE_DEFAULTS and LABEL_FREE_DEFAULTS["gate"]
    assert LABEL_FREE_DEFAULTS in LABEL_FREE_GRID
    for name in ("bn-stats", "entropy"):  # the references stay
        assert METHODS[name].unlabeled is None


def test_selection_score_penalises_hurt_beyond_a_point():
    assert selection_score([0.02, 0.04]) == pytest.approx(0.03)
    assert selection_score([0.05, -0.005]) == pytest.approx(0.0225)  # within the tolerance: no penalty
    hurt = -0.03
    expected = (0.05 + hurt) / 2 - HURT_PENALTY * (-hurt - HURT_TOLERANCE) / 2
    assert selection_score([0.05, hurt]) == pytest.approx(expected)
    assert selection_score([0.05, hurt]) < selection_score([0.0, 0.0])


def test_loso_accepts_label_free(tmp_path):
    import subprocess
    import sys

    from tests.helpers import REPO

    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "loso.py"), "--help"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and "label-free" in proc.stdout and "--target-shift" in proc.stdout


def test_loso_reports_a_refused_export_and_the_subjects_each_row_covers():
    """A method whose export is refused for one subject (e.g. the self-check) does not run for it:
    the study goes on, that method's row covers the other subjects, and the table says which."""
    import importlib.util
    import json

    from tests.helpers import REPO

    spec = importlib.util.spec_from_file_location("loso", REPO / "benchmarks" / "loso.py")
    loso = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loso)
    result = json.loads((REPO / "benchmarks" / "results" / "loso_synthetic_cnn_label_free_gain-offset_all.json")
                        .read_text())
    methods = ["source-only", "bn-stats", "entropy", "label-free"]
    before = loso._summary(result["rows"], methods)["entropy"]["n_subjects"]
    result["rows"] = [r for r in result["rows"] if not (r["subject"] == 1 and r["method"] == "entropy")]
    result["folds"][1]["refused"] = {"entropy": "the portable step graphs do not reproduce torch on this model"}
    result["summary"] = loso._summary(result["rows"], methods)
    assert result["summary"]["entropy"]["n_subjects"] == before - 1
    md = loso._markdown(result)
    assert "Exports refused (the method did not run for that subject" in md
    assert "subject 1 entropy: the portable step graphs do not reproduce torch" in md
