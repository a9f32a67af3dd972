"""Subject-wise splits: leave-one-subject-out and few-shot adaptation on the held-out subject.

All splits return window indices (sorted ``int64``) into the dataset they were given.

Overlapping windows share samples, so "disjoint indices" alone would let an evaluation window
repeat half of an adaptation window. When the dataset knows where windows came from
(``recording`` and ``start_sample``), :func:`few_shot_split` drops from evaluation every window
that shares a sample with an adaptation window.
"""

from __future__ import annotations

import logging
import numbers
from collections.abc import Iterator
from typing import NamedTuple

import numpy as np

from .window_dataset import WindowDataset

__all__ = ["SubjectSplit", "FewShotSplit", "loso_splits", "few_shot_split", "label_shift_split", "unlabeled_split"]

logger = logging.getLogger(__name__)


class SubjectSplit(NamedTuple):
    """One leave-one-subject-out fold: train on ``source_idx``, test on ``target_idx``."""

    target_subject: int
    source_idx: np.ndarray
    target_idx: np.ndarray


class FewShotSplit(NamedTuple):
    """Windows of one subject: ``adapt_idx`` (k labelled per class) and disjoint ``eval_idx``."""

    adapt_idx: np.ndarray
    eval_idx: np.ndarray


def loso_splits(dataset: WindowDataset) -> Iterator[SubjectSplit]:
    """Leave-one-subject-out folds, one per subject in ascending id order.

    Raises:
        ValueError: the dataset has fewer than two subjects (checked at the call, not lazily).
    """
    subjects = dataset.subjects
    if subjects.size < 2:
        raise ValueError(f"leave-one-subject-out needs at least 2 subjects, dataset has {subjects.tolist()}")

    def folds() -> Iterator[SubjectSplit]:
        for s in subjects:
            is_target = dataset.subject == s
            yield SubjectSplit(int(s), np.flatnonzero(~is_target), np.flatnonzero(is_target))

    return folds()


def few_shot_split(dataset: WindowDataset, subject: int, k_per_class: int, seed: int) -> FewShotSplit:
    """Pick ``k_per_class`` labelled windows of every class of ``subject`` for adaptation.

    The remaining windows of the subject are for evaluation, minus any that share samples with
    an adaptation window (when ``dataset.recording`` is known).

    Args:
        dataset: the data, typically the whole dataset of a LOSO fold.
        subject: the target subject id.
        k_per_class: adaptation windows per class, >= 1.
        seed: seeds the choice (``numpy.random.default_rng``).

    Returns:
        ``FewShotSplit(adapt_idx, eval_idx)``: sorted dataset indices, disjoint, both of ``subject``.

    Raises:
        ValueError: ``subject`` is not in the dataset, or has fewer than ``k_per_class + 1``
            windows of some class (the message lists the counts), or nothing is left to evaluate.
    """
    if int(k_per_class) != k_per_class or k_per_class < 1:
        raise ValueError(f"k_per_class must be a positive integer, got {k_per_class}")
    own = np.flatnonzero(dataset.subject == subject)
    if own.size == 0:
        raise ValueError(f"subject {subject} is not in the dataset (subjects: {dataset.subjects.tolist()})")
    counts = np.bincount(dataset.y[own], minlength=dataset.n_classes)
    short = np.flatnonzero(counts < k_per_class + 1)
    if short.size:
        listed = ", ".join(f"{dataset.class_names[c]!r}: {counts[c]}" for c in short)
        hint = f"; k_per_class <= {counts.min() - 1} would fit" if counts.min() >= 2 else ""
        raise ValueError(
            f"subject {subject} has too few windows for k_per_class={k_per_class}: it needs at least "
            f"{k_per_class + 1} windows of every class ({k_per_class} to adapt, at least 1 to evaluate) "
            f"but has {listed}{hint}"
        )
    rng = np.random.default_rng(seed)
    adapt = np.sort(np.concatenate([
        rng.choice(own[dataset.y[own] == c], size=k_per_class, replace=False) for c in range(dataset.n_classes)
    ]))
    rest = _evaluation_windows(dataset, subject, own, adapt)
    if rest.size == 0:
        raise ValueError(
            f"subject {subject}: no evaluation window is left after taking {k_per_class} per class for "
            "adaptation (and dropping windows that overlap them); lower k_per_class"
        )
    return FewShotSplit(adapt, rest)


def label_shift_split(dataset: WindowDataset, subject: int, n_windows: int, n_classes: int,
                      seed: int) -> FewShotSplit:
    """Adaptation windows of only some activities: ``n_windows`` windows of ``subject`` among its
    windows of ``n_classes`` seeded classes, in dataset (recording) order, as a user who adapts
    on a stretch of one or two activities has them; the subject's other windows, of every class,
    evaluate (minus any that share samples with an adaptation window).

    Raises:
        ValueError: ``subject`` is not in the dataset, ``n_classes`` is not in 1 .. its classes - 1,
            ``n_windows`` is not positive, or nothing is left to evaluate.
    """
    own = np.flatnonzero(dataset.subject == subject)
    if own.size == 0:
        raise ValueError(f"subject {subject} is not in the dataset (subjects: {dataset.subjects.tolist()})")
    present = np.unique(dataset.y[own])
    if not (isinstance(n_classes, (int, np.integer)) and 1 <= n_classes < present.size):
        raise ValueError(f"n_classes must be an integer in 1..{present.size - 1} (subject {subject} has "
                         f"{present.size} classes), got {n_classes!r}")
    if not (isinstance(n_windows, (int, np.integer)) and n_windows >= 1):
        raise ValueError(f"n_windows must be a positive integer, got {n_windows!r}")
    classes = np.random.default_rng([seed, subject]).choice(present, size=n_classes, replace=False)
    adapt = own[np.isin(dataset.y[own], classes)][:n_windows]
    rest = _evaluation_windows(dataset, subject, own, adapt)
    if rest.size == 0:
        raise ValueError(f"subject {subject}: no evaluation window is left after taking {n_windows} windows "
                         f"of its classes {sorted(classes.tolist())}; lower n_windows")
    return FewShotSplit(adapt, rest)


def unlabeled_split(dataset: WindowDataset, subject: int, fraction: float) -> FewShotSplit:
    """The first ``fraction`` of every recording of ``subject`` adapts (labels unused), in dataset
    (recording) order, as a wearable collects unlabelled windows before anyone asks how well it
    does; the later windows of each recording evaluate (minus any that share samples with an
    adaptation window). Within a recording, "first" is by ``start_sample``; a recording with
    fewer than ``1 / fraction`` windows goes wholly to evaluation. Without ``dataset.recording``,
    each class's windows in dataset order stand for its recording (the labels then pick the
    windows: an evaluation protocol, not something a device can do).

    Raises:
        ValueError: ``subject`` is not in the dataset, ``fraction`` is not in (0, 1), or a part is empty.
    """
    if isinstance(fraction, bool) or not (isinstance(fraction, numbers.Real) and 0 < fraction < 1):
        raise ValueError(f"fraction must be a number in (0, 1), got {fraction!r}")
    own = np.flatnonzero(dataset.subject == subject)
    if own.size == 0:
        raise ValueError(f"subject {subject} is not in the dataset (subjects: {dataset.subjects.tolist()})")
    order = dataset.recording_order()  # the earliest windows first, whatever the file's order
    ordered = order[dataset.subject[order] == subject]
    pieces = dataset.recording[ordered] if dataset.recording is not None else dataset.y[ordered]
    adapt_parts = []
    for piece in np.unique(pieces):
        members = ordered[pieces == piece]
        # a recording too short for one window at this fraction goes wholly to evaluation
        adapt_parts.append(members[:int(np.floor(fraction * members.size))])
    adapt = np.sort(np.concatenate(adapt_parts)).astype(np.int64)
    if adapt.size == 0:
        longest = int(max(np.unique(pieces, return_counts=True)[1]))
        fix = (f"a fraction of at least {1 / longest:.3g} would give its longest one a window" if longest > 1
               else "every recording holds one window, so no fraction below 1 can; adapt on whole recordings")
        raise ValueError(f"subject {subject}: the first {fraction} of each of its recordings is no window; {fix}")
    rest = _evaluation_windows(dataset, subject, own, adapt)
    if rest.size == 0:
        raise ValueError(f"subject {subject}: no evaluation window is left after adapting on the first "
                         f"{fraction} of its recordings; lower the fraction")
    return FewShotSplit(adapt, rest)


def _evaluation_windows(dataset: WindowDataset, subject: int, own: np.ndarray, adapt: np.ndarray) -> np.ndarray:
    """``subject``'s windows ``own`` not in ``adapt`` and sharing no sample with one of them (when
    ``dataset.recording`` is known); warns about classes left without an evaluation window."""
    rest = np.setdiff1d(own, adapt)
    if dataset.recording is not None:
        # Two windows of one recording share samples iff their starts differ by less than a window.
        same_recording = dataset.recording[rest][:, None] == dataset.recording[adapt][None, :]
        distance = np.abs(dataset.start_sample[rest][:, None] - dataset.start_sample[adapt][None, :])
        overlapping = (same_recording & (distance < dataset.n_time_steps)).any(axis=1)
        if overlapping.any():
            logger.info("subject %s: %d evaluation windows dropped for sharing samples with adaptation windows",
                        subject, int(overlapping.sum()))
        rest = rest[~overlapping]
    missing = np.flatnonzero(np.bincount(dataset.y[rest], minlength=dataset.n_classes) == 0)
    if rest.size and missing.size:
        logger.warning("subject %s: classes %s have no evaluation window left", subject,
                       [dataset.class_names[c] for c in missing])
    return rest
