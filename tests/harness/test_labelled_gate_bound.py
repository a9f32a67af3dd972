"""benchmarks/labelled_gate_bound.py: the labels it pairs with the gate's recorded predictions are
those of the windows the gate saw, in the gate's order.

The shipped cross-fitted studies are the fixture: the script rebuilds each fold's split from the
study's config. Were the order or the split wrong, the source model's accuracy read on the windows
adapted on would be near chance, not the source model's accuracy on the subject.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import REPO, load_benchmark

STUDY = REPO / "benchmarks" / "results" / "loso_synthetic_cnn_label_free_gain-offset_all_crossfit.json"


def _source_accuracies(bound, path):
    """(source accuracy on the windows adapted on, as the script reads it; on the evaluation windows)."""
    rows = bound.fold_rows(path)
    study = json.loads(path.read_text())
    source_only = {int(r["subject"]): r["accuracy_source_only"] for r in study["rows"] if r["method"] == "label-free"}
    assert sorted(r["subject"] for r in rows) == sorted(source_only)
    return (np.array([r["source_accuracy_adapt_windows"] for r in rows]),
            np.array([source_only[r["subject"]] for r in rows]))


@pytest.mark.skipif(not STUDY.is_file(), reason="the shipped study is not in this checkout")
def test_labels_follow_the_gates_order(tmp_path):
    bound = load_benchmark("labelled_gate_bound")
    on_adapt, on_eval = _source_accuracies(bound, STUDY)
    # the same model on two disjoint sets of one subject's windows (30 adapted on, ~100 evaluated)
    assert np.corrcoef(on_adapt, on_eval)[0, 1] > 0.8
    assert np.abs(on_adapt - on_eval).mean() < 0.1
    # another seed's order pairs the labels with other windows' predictions: the agreement falls apart
    study = json.loads(STUDY.read_text())
    for r in study["rows"]:
        if r["method"] == "label-free":
            r["label_free"]["settings"]["seed"] += 1
    wrong = tmp_path / "wrong_order.json"
    wrong.write_text(json.dumps(study))
    on_adapt, on_eval = _source_accuracies(bound, wrong)
    assert np.abs(on_adapt - on_eval).mean() > 0.2


@pytest.mark.skipif(not STUDY.is_file(), reason="the shipped study is not in this checkout")
def test_a_study_whose_split_does_not_match_is_refused(tmp_path):
    bound = load_benchmark("labelled_gate_bound")
    study = json.loads(STUDY.read_text())
    row = next(r for r in study["rows"] if r["method"] == "label-free" and r["label_free"]["cross_fitted"])
    row["label_free"]["gate"]["source"]["classes"] = row["label_free"]["gate"]["source"]["classes"][:-1]
    study["rows"] = [row]
    path = tmp_path / "study.json"
    path.write_text(json.dumps(study))
    with pytest.raises(SystemExit, match="not the study's split"):
        bound.fold_rows(path)
