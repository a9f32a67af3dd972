"""The label-free methods of the study and the choice of their settings on source subjects only.

Each label-free method of ``study.METHODS`` carries settings for
:meth:`~edgeadapt.runtime.Runner.adapt_unlabeled` (JSON, as :class:`UnlabeledSettings` takes
them); its bundle is exported with the entropy loss, batch-statistics BatchNorm and the
``bias-norm`` policy, so that every stage can run. ``label-free`` is the recommended safe
method: source-anchored statistics, prototype head, resets and the safety gate. The LOSO study
chooses its settings per fold among :data:`LABEL_FREE_GRID` by leave-one-source-subject-out
(:func:`select_label_free_settings`), as it chooses learning rates; a fixed learning rate
(``--fixed-lr``) does not touch them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .label_free_settings import LABEL_FREE_DEFAULTS, LABEL_FREE_GRID, UNLABELED_METHOD_SETTINGS

__all__ = ["LABEL_FREE_DEFAULTS", "UNLABELED_METHOD_SETTINGS", "LABEL_FREE_GRID", "LabelFreeSelection",
           "selection_score", "select_label_free_settings"]

log = logging.getLogger(__name__)

# A validation subject losing more than this (accuracy, fraction) counts as hurt.
HURT_TOLERANCE = 0.01
# Weight of the hurt beyond the tolerance against the mean gain in the selection score.
HURT_PENALTY = 2.0


def selection_score(gains: list[float]) -> float:
    """Mean gain over the validation subjects minus ``HURT_PENALTY`` x the mean loss beyond
    ``HURT_TOLERANCE`` (a setting that hurts a subject pays for it more than it gains elsewhere)."""
    g = np.asarray(gains, dtype=np.float64)
    return float(g.mean() - HURT_PENALTY * np.maximum(0.0, -g - HURT_TOLERANCE).mean())


@dataclass(frozen=True)
class LabelFreeSelection:
    """The settings chosen for one fold, and what every candidate scored.

    Attributes:
        settings: the chosen candidate (JSON form).
        grid: the candidates tried.
        gains: per candidate, the accuracy gain over the source model on each validation subject.
        scores: per candidate, :func:`selection_score` of its gains.
        validation_subjects: the source subjects that played the new subject in turn.
    """

    settings: dict
    grid: tuple[dict, ...]
    gains: tuple[tuple[float, ...], ...]
    scores: tuple[float, ...]
    validation_subjects: tuple[int, ...]


def select_label_free_settings(ds, target_subject: int, model_name: str, *, workdir: Path,
                               validation_subjects: int = 2, grid: tuple[dict, ...] = LABEL_FREE_GRID,
                               k_per_class: int, pretrain_epochs: int, seed: int = 0,
                               threads: int | None = None,
                               unlabeled_fraction: float | None = None) -> LabelFreeSelection:
    """Choose the label-free settings of one fold by leave-one-source-subject-out.

    The target subject's windows are dropped; ``validation_subjects`` source subjects (the
    same seeded choice as ``study.select_learning_rates``) each play the new subject once: a
    model pretrained on the other source subjects adapts label-free from the validation
    subject's ``k_per_class`` windows per class (labels unused) with each candidate, and the
    accuracy gain on its other windows is scored by :func:`selection_score`; the best score wins
    (ties: the earlier candidate). ``unlabeled_fraction``: the validation subject adapts on the
    first fraction of its recordings instead (as the fold's target does).
    """
    from ..runtime import Runner
    from ..runtime.unlabeled import UnlabeledSettings
    from .study import export_method, validation_folds

    source = ds.subset(ds.subject != target_subject)
    gains: list[list[float]] = [[] for _ in grid]
    chosen = []
    for v, split, model in validation_folds(source, target_subject, model_name, n=validation_subjects,
                                            k_per_class=k_per_class, pretrain_epochs=pretrain_epochs, seed=seed,
                                            unlabeled_fraction=unlabeled_fraction):
        chosen.append(v)
        ad, ev = split.target_adapt, split.target_eval
        bundle = workdir / f"select-label-free-{target_subject}-{v}"
        export_method("label-free", model, model_name, ad.X, bundle)
        runner = Runner.load(bundle, device="cpu", threads=threads)
        before = float((runner.predict(ev.X).argmax(1) == ev.y).mean())
        for i, candidate in enumerate(grid):
            runner = Runner.load(bundle, device="cpu", threads=threads)
            runner.adapt_unlabeled(ad.X, UnlabeledSettings.from_dict({**candidate, "seed": seed}))
            gains[i].append(float((runner.predict(ev.X).argmax(1) == ev.y).mean()) - before)
        log.info("fold %s, validation subject %s: label-free gains %s", target_subject, v,
                 ", ".join(f"{g[-1]:+.3f}" for g in gains))
    scores = tuple(selection_score(g) for g in gains)
    best = max(range(len(grid)), key=lambda i: (round(scores[i], 9), -i))
    return LabelFreeSelection(dict(grid[best]), tuple(grid), tuple(tuple(g) for g in gains), scores, tuple(chosen))
