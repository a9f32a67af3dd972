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
    for candidate in LABEL_FREE_GRID:  # every candidate valid, gated, statistics weighted by the evidence
        settings = UnlabeledSettings.from_dict(candidate)
        assert settings.gate and settings.stats_weighting == "shrinkage"
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


def _study_row(subject: int, method: str, accuracy: float) -> dict:
    """One per-subject row as ``benchmarks/loso.py`` writes it (the fields its summary reads)."""
    return {"subject": subject, "method": method, "accuracy": accuracy, "accuracy_source_only": 0.80,
            "lr": None if method == "source-only" else 3e-3, "trainable_numel": 500, "trained_bytes": 2000,
            "grad_adamw_bytes": 6000, "step_peak_bytes": 2**21, "call_peak_bytes": 2**21 + 4096,
            "step_peak_anon_bytes": 2**20, "call_peak_anon_bytes": 2**20 + 4096, "loaded_rss_bytes": 80 * 2**20,
            "adapt_time_vs_full": None}


def test_loso_reports_a_refused_export_and_the_subjects_each_row_covers():
    """A method whose export is refused for one subject (e.g. the self-check) does not run for it:
    the study goes on, that method's row covers the other subjects, and the table says which."""
    from helpers import load_benchmark

    loso = load_benchmark("loso")
    methods = ["source-only", "bn-stats", "entropy", "label-free"]
    subjects = [0, 1, 2]
    rows = [_study_row(s, m, 0.80 if m == "source-only" else 0.80 + 0.01 * (k + 1) * (s + 1))
            for s in subjects for k, m in enumerate(methods) if not (s == 1 and m == "entropy")]
    summary = loso._summary(rows, methods)
    assert summary["entropy"]["n_subjects"] == 2 and summary["bn-stats"]["n_subjects"] == 3
    assert summary["entropy"]["mean_accuracy"] == pytest.approx(0.80 + 0.03 * (1 + 3) / 2)
    result = {
        "config": {"dataset": "synthetic", "model": "cnn", "k_per_class": 5, "epochs": 40, "threads": 1},
        "summary": summary, "lr_selection": {"mode": "fixed", "lr": 3e-3}, "subjects_done": subjects,
        "command": "loso.py --fixed-lr", "source_val_accuracy_mean": 0.97, "total_time_s": 60.0,
        "host": {"cpu": {"model": "test CPU"}, "versions": {}},
        "folds": [{"subject": s, **({"refused": {"entropy": "the portable step graphs do not reproduce torch on "
                                                            "this model"}} if s == 1 else {})} for s in subjects],
    }
    md = loso._markdown(result)
    assert "Exports refused (the method did not run for that subject" in md
    assert "subject 1 entropy: the portable step graphs do not reproduce torch" in md


@pytest.mark.parametrize("extra, named", [
    (["--methods", "label-free", "last-layer"], "drop last-layer"),
    (["--methods", "bn-stats", "--memory-budget", "1MiB"], "drop --memory-budget"),
    (["--methods", "label-free", "--adapt-classes", "1"], "drop --adapt-classes"),
])
def test_loso_unlabeled_fraction_is_for_label_free_methods_only(extra, named, capsys):
    """Labelled methods adapt on k windows per class; a study that gives label-free methods the
    first part of each recording instead refuses them before any work, naming what to drop."""
    from helpers import load_benchmark

    loso = load_benchmark("loso")
    with pytest.raises(SystemExit):
        loso.main(["--unlabeled-fraction", "0.5", *extra])
    assert named in capsys.readouterr().err
    with pytest.raises(SystemExit):
        loso.main(["--unlabeled-fraction", "1.0", "--methods", "label-free"])
    assert "--unlabeled-fraction must be in (0, 1), got 1.0" in capsys.readouterr().err


def test_make_split_takes_one_way_of_picking_adaptation_windows():
    from edgeadapt.datasets import SyntheticConfig, make_synthetic
    from edgeadapt.harness.study import make_split

    ds = make_synthetic(SyntheticConfig(n_subjects=3, windows_per_subject=60, n_time_steps=32, seed=1))
    split = make_split(ds, 0, k_per_class=2, seed=0, unlabeled_fraction=0.5)
    assert len(split.target_adapt.y) == sum((ds.y[ds.subject == 0] == c).sum() // 2 for c in range(ds.n_classes))
    with pytest.raises(ValueError, match="adapt_classes and unlabeled_fraction pick the adaptation windows two ways"):
        make_split(ds, 0, k_per_class=2, seed=0, adapt_classes=1, unlabeled_fraction=0.5)
