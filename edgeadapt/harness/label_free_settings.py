"""The settings the study's label-free methods carry (JSON, as
:class:`~edgeadapt.runtime.unlabeled.UnlabeledSettings` takes them), apart from the selection
code in :mod:`.label_free` so that the method registry (:mod:`.study`) can read them without
importing the code that runs the study.
"""

from __future__ import annotations

__all__ = ["LABEL_FREE_DEFAULTS", "UNLABELED_METHOD_SETTINGS", "LABEL_FREE_GRID"]

# The recommended method's settings (UnlabeledSettings fields not named keep their defaults):
# the setting the LOSO study's per-fold selection chose most often on watch (README, "Safe
# label-free adaptation"), every fold choosing on its source subjects only.
LABEL_FREE_DEFAULTS: dict = {"stats_prior_windows": 64.0, "prototype_mix": 0.3, "gate": True}

# The other label-free methods of the registry, one stage each, no gate (references).
UNLABELED_METHOD_SETTINGS: dict[str, dict] = {
    "anchored-bn": {"stats_prior_windows": 64.0, "prototype_mix": 0.0, "gate": False},
    "reliable-entropy": {"stats_prior_windows": float("inf"), "prototype_mix": 0.0, "entropy_steps": 20,
                         "lr": 1e-3, "entropy_threshold": 0.4, "anchor": 0.1, "gate": False},
    "prototypes": {"stats_prior_windows": float("inf"), "prototype_mix": 0.3, "gate": False},
    "label-free": LABEL_FREE_DEFAULTS,
}

# What the selection tries for label-free (each with the gate on).
LABEL_FREE_GRID: tuple[dict, ...] = tuple(
    {"stats_prior_windows": n0, "prototype_mix": mix, "gate": True}
    for n0 in (16.0, 64.0, 256.0) for mix in (0.0, 0.3))
