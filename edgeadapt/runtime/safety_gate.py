"""The safety gate of label-free adaptation: keep the adapted model or return to the source one.

No label is available, so the gate compares the two models on *held-back* unlabeled windows
(never adapted on) with label-free evidence (:class:`ModelEvidence`):

* **view agreement**: how often the prediction on a window survives small sensor
  perturbations (:func:`augmented_views`: per-channel gain, additive noise, a circular time
  shift). A model whose decisions follow the signal rather than the shift keeps them under such
  perturbations; adaptation that broke the features loses agreement.
* **collapse**: the share of the most predicted class and the mean prediction entropy.
* **one class in the adaptation windows**: when the model assigns nearly all the windows it
  adapted on to one class they may show one activity (label shift), not a shifted sensor: their
  statistics and prototypes pull every class toward that one, and views of held-back windows of
  the same activity cannot show it. The adaptation is refused (the safe side of an ambiguity no
  label-free evidence resolves).
* **prediction change**: the fraction of held-back windows the adapted model classifies
  differently from the source model (off by default: a subject the source model gets wrong
  needs many changes).

:func:`decide` keeps the adaptation only when every criterion passes and reports which failed.
Agreement is compared window by window, on the same windows and views (a paired sign test):
with ``d_i`` the number of views of window ``i`` on which only the source model agrees minus
those on which only the adapted one does, the adaptation is refused when ``sum d_i >
agreement_margin_sd * sqrt(sum d_i^2)``, the net loss more than that many standard deviations of
its noise. The window is the unit of evidence: the views of one window near a class boundary
flip together, so a window losing all its views is one piece of evidence, not several. A single
flip among eight windows is noise; a consistent loss is evidence of harm.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

__all__ = ["GateSettings", "ModelEvidence", "GateDecision", "augmented_views", "view_logits", "evidence",
           "agreement_changes", "agreement_loss", "decide", "softmax", "normalized_entropy", "collapsed",
           "pool_evidence"]

# Perturbations of augmented_views, in units of the (normalised) input: per-channel gain factor
# exp(U(-g, g)), additive Gaussian noise of this fraction of each window's channel std, circular
# shift by up to this fraction of the window length.
VIEW_GAIN_LOG = 0.1
VIEW_NOISE_FRACTION = 0.1
VIEW_SHIFT_FRACTION = 0.1


@dataclass(frozen=True)
class GateSettings:
    """Thresholds of :func:`decide`.

    Attributes:
        agreement_margin_sd: the adapted model's view-agreement losses may exceed its gains
            by at most this many standard deviations (module docstring; 0: any net loss refuses).
        max_changed_fraction: at most this fraction of held-back windows may change class
            (1: no limit).
        collapse_share: a model predicting one class for more than this share of windows (when
            the source model did not) has collapsed.
        collapse_entropy: ... or one whose mean normalised entropy fell below this (and below
            half the source model's).
        label_shift_share: refused when more than this share of the windows adapted on are
            predicted as one class (1: no limit).
    """

    agreement_margin_sd: float = 1.0
    max_changed_fraction: float = 1.0
    collapse_share: float = 0.9
    collapse_entropy: float = 0.01
    label_shift_share: float = 0.9

    def __post_init__(self) -> None:
        if not (isinstance(self.agreement_margin_sd, (int, float)) and 0 <= self.agreement_margin_sd < float("inf")):
            raise ValueError(f"agreement_margin_sd must be a finite number >= 0, got {self.agreement_margin_sd!r}")
        for name in ("max_changed_fraction", "collapse_share", "collapse_entropy", "label_shift_share"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0 <= value <= 1):
                raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")


@dataclass(frozen=True)
class ModelEvidence:
    """What one model shows on the held-back windows.

    Attributes:
        view_agreement: mean over views of the fraction of windows whose class on the view equals
            the class on the window itself.
        mean_entropy: mean prediction entropy over windows, divided by log(classes) (0..1).
        max_class_share: share of windows given the most predicted class.
        classes: the predicted class of every held-back window (clean view).
        view_agrees: per view, then per window: whether the view's class equals the clean one.
    """

    view_agreement: float
    mean_entropy: float
    max_class_share: float
    classes: tuple[int, ...]
    view_agrees: tuple[bool, ...] = ()


@dataclass(frozen=True)
class GateDecision:
    """The gate's verdict and its evidence.

    Attributes:
        kept: ``True``: the adaptation is kept; ``False``: the runner returned to the source model.
        reasons: the failed criteria (empty when kept).
        source, adapted: the evidence of each model on the same held-back windows.
        changed_fraction: share of held-back windows whose class changed.
        n_windows: held-back windows the evidence is computed on.
        adapt_max_class_share: share of the windows adapted on given their most predicted class
            (by the model before each batch's update; ``None`` when not given).
        only_label_shift: refused for that share alone (every other criterion passed).
    """

    kept: bool
    reasons: tuple[str, ...]
    source: ModelEvidence
    adapted: ModelEvidence
    changed_fraction: float
    n_windows: int
    adapt_max_class_share: float | None = None
    only_label_shift: bool = False


def softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise softmax in float64."""
    z = logits.astype(np.float64) - logits.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


def normalized_entropy(probs: np.ndarray) -> np.ndarray:
    """Entropy of each row of ``probs`` divided by log(columns): 0 (certain) .. 1 (uniform)."""
    return -(probs * np.log(np.clip(probs, 1e-12, 1.0))).sum(axis=1) / np.log(probs.shape[1])


def augmented_views(X: np.ndarray, seed: int, n_views: int = 2) -> list[np.ndarray]:
    """``n_views`` perturbed copies of the windows ``X`` (batch, channels, time), seeded: each
    with a per-window, per-channel gain, additive noise and a circular time shift."""
    return view_logits(X, seed, n_views, lambda view: view, len(X))


def view_logits(X: np.ndarray, seed: int, n_views: int, logits: Callable[[np.ndarray], np.ndarray],
                chunk_windows: int) -> list[np.ndarray]:
    """``logits`` of each of :func:`augmented_views` ``(X, seed, n_views)``, built and run
    ``chunk_windows`` windows at a time: the same views (the same random numbers, drawn in the
    same order) without ever holding more than one chunk of one view."""
    rng = np.random.default_rng(seed)
    n, steps = X.shape[0], X.shape[-1]
    max_shift = max(1, int(round(VIEW_SHIFT_FRACTION * steps)))
    out = []
    for _ in range(n_views):
        gain = np.exp(rng.uniform(-VIEW_GAIN_LOG, VIEW_GAIN_LOG, size=X.shape[:-1] + (1,)))
        # The noise is drawn before the shifts: skip past it (drawing and dropping it a chunk at a
        # time) for the shifts, then replay it chunk by chunk from a copy of the generator.
        noise = copy.deepcopy(rng)
        for start in range(0, n, chunk_windows):
            rng.standard_normal((min(chunk_windows, n - start), *X.shape[1:]))
        shifts = rng.integers(-max_shift, max_shift + 1, size=n)
        parts = []
        for start in range(0, n, chunk_windows):
            part = slice(start, min(start + chunk_windows, n))
            m = part.stop - part.start
            # X * gain + (fraction * std) * noise, in place where the value is the same bit for bit
            view = noise.standard_normal((m, *X.shape[1:]))
            view *= VIEW_NOISE_FRACTION * X[part].std(axis=-1, keepdims=True)
            view += X[part] * gain[part]
            idx = (np.arange(steps)[None, :] - shifts[part, None]) % steps
            view = np.take_along_axis(view, idx.reshape(m, *([1] * (X.ndim - 2)), steps), axis=-1)
            parts.append(logits(view.astype(np.float32)))
            del view
        out.append(np.concatenate(parts))
    return out


def evidence(clean_logits: np.ndarray, view_logits: list[np.ndarray]) -> ModelEvidence:
    """:class:`ModelEvidence` from a model's logits on the held-back windows and on their views."""
    probs = softmax(clean_logits)
    classes = probs.argmax(axis=1)
    agrees = np.concatenate([v.argmax(axis=1) == classes for v in view_logits]) if view_logits else np.ones(0, bool)
    agreement = float(agrees.mean()) if len(agrees) else 1.0
    share = np.bincount(classes, minlength=probs.shape[1]).max() / len(classes)
    return ModelEvidence(agreement, float(normalized_entropy(probs).mean()), float(share),
                         tuple(int(c) for c in classes), tuple(bool(a) for a in agrees))


def pool_evidence(parts: list[ModelEvidence]) -> ModelEvidence:
    """One model's evidence on the union of disjoint sets of windows (the folds of a cross-fitted
    call), each part with the same number of views: as :func:`evidence` on all the windows at
    once (agreement and entropy averaged over windows, the class share over all of them)."""
    if not parts:
        raise ValueError("no evidence to pool")
    sizes = [len(p.classes) for p in parts]
    views = {len(p.view_agrees) // n for p, n in zip(parts, sizes) if n}
    if len(views) > 1 or any(len(p.view_agrees) % max(n, 1) for p, n in zip(parts, sizes)):
        raise ValueError("the parts' evidence has different numbers of views")
    n_views = views.pop() if views else 0
    classes = np.concatenate([np.asarray(p.classes, int) for p in parts])
    agrees = np.concatenate([np.asarray(p.view_agrees, bool).reshape(n_views, n) for p, n in zip(parts, sizes)],
                            axis=1) if n_views else np.ones((0, len(classes)), bool)
    total = len(classes)
    entropy = sum(p.mean_entropy * n for p, n in zip(parts, sizes)) / total
    return ModelEvidence(float(agrees.mean()) if agrees.size else 1.0, float(entropy),
                         float(np.bincount(classes).max() / total), tuple(int(c) for c in classes),
                         tuple(bool(a) for a in agrees.ravel()))


def collapsed(model: ModelEvidence, source: ModelEvidence, settings: GateSettings) -> str | None:
    """Why ``model`` has collapsed relative to ``source`` (one class for nearly everything, or
    entropy falling to zero), or ``None``."""
    if model.max_class_share > settings.collapse_share and source.max_class_share <= settings.collapse_share:
        return f"one class predicted for {model.max_class_share:.0%} of windows"
    if model.mean_entropy < settings.collapse_entropy and model.mean_entropy < 0.5 * source.mean_entropy:
        return f"mean entropy fell to {model.mean_entropy:.3f}"
    return None


def agreement_changes(source: ModelEvidence, adapted: ModelEvidence) -> tuple[int, int]:
    """(window, view) pairs on which only the source model agrees, and only the adapted one."""
    if len(source.view_agrees) != len(adapted.view_agrees):
        raise ValueError("the two models' evidence covers different windows or views")
    a, b = np.asarray(source.view_agrees, bool), np.asarray(adapted.view_agrees, bool)
    return int((a & ~b).sum()), int((~a & b).sum())


def agreement_loss(source: ModelEvidence, adapted: ModelEvidence) -> tuple[int, float]:
    """The net number of (window, view) pairs the adaptation lost, ``sum d_i``, and its standard
    deviation under no change, ``sqrt(sum d_i^2)``, with ``d_i`` window ``i``'s views on which only
    the source model agrees minus those on which only the adapted one does."""
    if len(source.view_agrees) != len(adapted.view_agrees):
        raise ValueError("the two models' evidence covers different windows or views")
    lost_won = np.asarray(source.view_agrees, int) - np.asarray(adapted.view_agrees, int)
    n = len(source.classes)
    if not n or not len(lost_won):
        return 0, 0.0
    d = lost_won.reshape(-1, n).sum(axis=0)  # view_agrees is view-major: one row per view
    return int(d.sum()), float(np.sqrt((d * d).sum()))


def decide(source: ModelEvidence, adapted: ModelEvidence, settings: GateSettings,
           adapt_class_counts: np.ndarray | None = None) -> GateDecision:
    """Keep the adaptation when it has not collapsed, has not lost view agreement beyond the
    noise (module docstring), changes at most ``max_changed_fraction`` of classes, and (given
    ``adapt_class_counts``, the windows adapted on per predicted class) was not made on windows
    of nearly one class."""
    n = len(source.classes)
    changed = float(np.mean(np.array(source.classes) != np.array(adapted.classes))) if n else 0.0
    reasons = []
    why = collapsed(adapted, source, settings)
    if why:
        reasons.append(f"collapse: {why}")
    lost, won = agreement_changes(source, adapted)
    net, sd = agreement_loss(source, adapted)
    if net > settings.agreement_margin_sd * sd:
        reasons.append(f"view agreement fell from {source.view_agreement:.3f} to {adapted.view_agreement:.3f} "
                       f"({lost} window-views lost, {won} won: net {net}, more than "
                       f"{settings.agreement_margin_sd:g} x its standard deviation {sd:.2f} over {n} windows)")
    share, label_shift = None, False
    if adapt_class_counts is not None and np.sum(adapt_class_counts) > 0:
        share = float(np.max(adapt_class_counts) / np.sum(adapt_class_counts))
        label_shift = share > settings.label_shift_share
        if label_shift:
            reasons.append(f"{share:.0%} of the windows adapted on are predicted as one class: they may show one "
                           "activity, whose statistics would pull every class toward it; adapt on windows of "
                           "several activities")
    if changed > settings.max_changed_fraction:
        reasons.append(f"{changed:.0%} of held-back windows changed class (limit "
                       f"{settings.max_changed_fraction:.0%})")
    return GateDecision(not reasons, tuple(reasons), source, adapted, changed, n, share,
                        label_shift and len(reasons) == 1)
