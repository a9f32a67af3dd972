"""``OptimizerConfig``: the optimizer hyper-parameters, one definition for every mode.

The exporter bakes them into a bundle's optimizer graph, the device runner reads them back from
the manifest, and the server trainer applies them with torch's own AdamW/SGD arithmetic. Pure
Python (no torch, onnx or onnxruntime), so each side imports it without the others.

Semantics follow torch: ``adamw`` is ``torch.optim.AdamW`` (decoupled weight decay applied before
the moment update); ``sgd`` is plain SGD without momentum or weight decay.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .bundle import OPTIMIZERS

__all__ = ["OptimizerConfig"]


@dataclass(frozen=True)
class OptimizerConfig:
    """Optimizer hyper-parameters (the learning rate may still be set per step).

    Attributes:
        name: ``"adamw"`` or ``"sgd"``.
        lr: learning rate, finite and > 0.
        weight_decay: decoupled weight decay (AdamW), applied to every parameter as torch does.
        betas: AdamW moment decay rates.
        eps: AdamW denominator epsilon.
    """

    name: str = "adamw"
    lr: float = 1e-3
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {self.name!r}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr must be a finite number > 0, got {self.lr}")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise ValueError(f"weight_decay must be a finite number >= 0, got {self.weight_decay}")
        if self.name == "sgd" and self.weight_decay:
            raise ValueError("sgd here has no weight decay; use weight_decay=0 or optimizer='adamw'")
        object.__setattr__(self, "betas", (float(self.betas[0]), float(self.betas[1])))

    @property
    def state_kinds(self) -> tuple[str, ...]:
        """Optimizer-state vectors kept per parameter (their names in torch's AdamW)."""
        return ("exp_avg", "exp_avg_sq") if self.name == "adamw" else ()

    def to_dict(self) -> dict[str, Any]:
        """The manifest's ``optimizer`` entry."""
        d: dict[str, Any] = {"name": self.name, "lr": self.lr, "weight_decay": self.weight_decay}
        if self.name == "adamw":
            d.update(betas=list(self.betas), eps=self.eps)
        return d

    @classmethod
    def coerce(cls, value: OptimizerConfig | str | dict[str, Any]) -> OptimizerConfig:
        """An ``OptimizerConfig`` from itself, a name (``"adamw"``: default settings; ``"sgd"``: no
        weight decay) or a dict of its fields (e.g. a manifest's ``optimizer`` entry)."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            return cls(value, weight_decay=0.0 if value == "sgd" else 0.01)
        if isinstance(value, dict):
            return cls(**{**value, "betas": tuple(value.get("betas", (0.9, 0.999)))})
        raise TypeError(f"optimizer must be 'adamw', 'sgd', a dict or an OptimizerConfig, got {value!r}")
