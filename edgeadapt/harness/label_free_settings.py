"""The settings the study's label-free methods carry (JSON, as
:class:`~edgeadapt.runtime.unlabeled.UnlabeledSettings` takes them), apart from the selection
code in :mod:`.label_free` so that the method registry (:mod:`.study`) can read them without
importing the code that runs the study.
"""

from __future__ import annotations

__all__ = ["LABEL_FREE_DEFAULTS", "UNLABELED_METHOD_SETTINGS", "LABEL_FREE_GRID"]

# The recommended method's settings (UnlabeledSettings fields not named keep their defaults):
# statistics weighted by the evidence of a shift (empirical Bayes), the prototype head and the
# gate; chosen on source subjects only (README, "Safe label-free adaptation").
LABEL_FREE_DEFAULTS: dict = {"stats_weighting": "shrinkage", "prototype_mix": 0.3, "gate": True}

# The other label-free methods of the registry, one stage each, no gate (references).
UNLABELED_METHOD_SETTINGS: dict[str, dict] = {
    "anchored-bn": {"stats_weighting": "shrinkage", "prototype_mix": 0.0, "gate": False},
    "reliable-entropy": {"stats_prior_windows": float("inf"), "prototype_mix": 0.0, "entropy_steps": 20,
                         "lr": 1e-3, "entropy_threshold": 0.4, "anchor": 0.1, "gate": False},
    "prototypes": {"stats_prior_windows": float("inf"), "prototype_mix": 0.3, "gate": False},
    "label-free": LABEL_FREE_DEFAULTS,
}

# What the selection tries for label-free (each with the gate on): with and without the
# prototype head (the statistics' weight needs no choosing: the evidence sets it).
LABEL_FREE_GRID: tuple[dict, ...] = tuple({**LABEL_FREE_DEFAULTS, "prototype_mix": mix} for mix in (0.3, 0.0))
