"""Experiment splits: normalisation on source training windows, no overlap leaks, seeded pretraining."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from edgeadapt.datasets import SyntheticConfig, load_watch, make_synthetic
from edgeadapt.harness.study import make_split, pretrain_source


def test_recordings_are_split_in_time_without_shared_samples():
    ds = load_watch()
    split = make_split(ds, target_subject=int(ds.subjects[-1]), k_per_class=5, seed=0)
    tr, va = split.source_train, split.source_val
    assert int(ds.subjects[-1]) not in set(tr.subject) | set(va.subject)
    length = ds.X.shape[2]
    for rec in np.intersect1d(tr.recording, va.recording):
        train_end = (tr.start_sample[tr.recording == rec] + length).max()
        assert train_end <= va.start_sample[va.recording == rec].min()  # no shared samples
    # every class stays on both sides
    assert set(va.y) == set(tr.y) == set(range(ds.n_classes))
    assert 0.1 < len(va.y) / (len(va.y) + len(tr.y)) < 0.3


def test_normaliser_uses_source_training_windows_only():
    ds = make_synthetic(SyntheticConfig(n_subjects=3, windows_per_subject=60, n_time_steps=64))
    split = make_split(ds, target_subject=2, k_per_class=3, seed=0)
    X = split.source_train.X  # normalised with its own statistics: zero mean, unit std per channel
    np.testing.assert_allclose(X.transpose(1, 0, 2).reshape(X.shape[1], -1).mean(1), 0.0, atol=1e-4)
    assert not np.allclose(split.target_eval.X.mean(axis=(0, 2)), 0.0, atol=1e-2)


def test_pretraining_is_deterministic_in_the_seed():
    ds = make_synthetic(SyntheticConfig(n_subjects=3, windows_per_subject=40, n_time_steps=64))
    split = make_split(ds, target_subject=2, k_per_class=2, seed=0)
    a = pretrain_source("cnn", split, epochs=1, seed=3)
    torch.manual_seed(12345)  # the global generator's state must not matter
    b = pretrain_source("cnn", split, epochs=1, seed=3)
    assert all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values()))


def test_learning_rates_are_chosen_on_source_subjects_only(tmp_path, monkeypatch):
    from edgeadapt.harness import study

    ds = make_synthetic(SyntheticConfig(n_subjects=4, windows_per_subject=48, n_time_steps=64))
    seen: list[int] = []
    make = study.make_split

    def spying_split(data, target_subject, *args, **kwargs):
        seen.append(int(target_subject))
        assert 3 not in set(data.subject.tolist())  # the held-out subject's windows are gone before any split
        return make(data, target_subject, *args, **kwargs)

    monkeypatch.setattr(study, "make_split", spying_split)
    chosen = study.select_learning_rates(ds, 3, ["last-layer", "bn-stats"], "cnn", workdir=tmp_path,
                                         validation_subjects=1, grid=(1e-3, 3e-2), k_per_class=2, epochs=2,
                                         pretrain_epochs=1, seed=0)
    assert set(chosen) == {"last-layer"}  # bn-stats trains nothing: no rate to choose
    sel = chosen["last-layer"]
    assert seen == list(sel.validation_subjects) and len(seen) == 1 and seen[0] in (0, 1, 2)
    assert sel.grid == (1e-3, 3e-2) and len(sel.mean_accuracy) == 2
    best = max(sel.mean_accuracy)
    assert sel.lr == min(g for g, a in zip(sel.grid, sel.mean_accuracy) if a == best)


def test_validation_subjects_adapt_on_the_start_of_their_recordings_when_asked():
    """With ``unlabeled_fraction`` every validation subject's adaptation windows are the first part
    of its recordings, as the held-out subject's are (the label-free settings are chosen that way)."""
    from edgeadapt.datasets import unlabeled_split
    from edgeadapt.harness.study import validation_folds

    ds = make_synthetic(SyntheticConfig(n_subjects=4, windows_per_subject=48, n_time_steps=32))
    source = ds.subset(ds.subject != 3)
    folds = list(validation_folds(source, 3, lambda split: torch.nn.Identity(), n=2, k_per_class=2,
                                  pretrain_epochs=1, seed=0, unlabeled_fraction=0.5))
    assert len(folds) == 2
    for v, split, _ in folds:
        own = np.flatnonzero(source.subject == v)
        expected = unlabeled_split(source, v, 0.5)
        assert len(split.target_adapt.y) == len(expected.adapt_idx)
        assert own.size // 2 - ds.n_classes < len(expected.adapt_idx) <= own.size // 2  # half of each class
        np.testing.assert_array_equal(split.target_adapt.y, source.y[expected.adapt_idx])
        np.testing.assert_array_equal(split.target_eval.y, source.y[expected.eval_idx])


def test_both_selections_on_source_subjects_use_the_study_protocol(tmp_path, monkeypatch):
    """The learning-rate and the label-free settings' selections hand ``unlabeled_fraction`` to the
    validation folds, so their source subjects adapt as the fold's target does."""
    from edgeadapt.harness import label_free, study

    seen = []

    class Seen(Exception):
        pass

    def spying_folds(*args, **kwargs):
        seen.append(kwargs.get("unlabeled_fraction"))
        raise Seen  # only the protocol is checked: no model is trained

    monkeypatch.setattr(study, "validation_folds", spying_folds)
    ds = make_synthetic(SyntheticConfig(n_subjects=3, windows_per_subject=24, n_time_steps=32))
    with pytest.raises(Seen):
        study.select_learning_rates(ds, 2, ["entropy"], "cnn", workdir=tmp_path, k_per_class=2, epochs=1,
                                    pretrain_epochs=1, unlabeled_fraction=0.5)
    with pytest.raises(Seen):
        label_free.select_label_free_settings(ds, 2, "cnn", workdir=tmp_path, k_per_class=2, pretrain_epochs=1,
                                              unlabeled_fraction=0.5)
    assert seen == [0.5, 0.5]
