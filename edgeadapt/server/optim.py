"""The CPU optimizer update of one block: torch's AdamW (or SGD) arithmetic, vectorised.

The update calls torch's own functional implementation (``torch.optim.adam.adam`` with
decoupled weight decay, the code behind ``torch.optim.AdamW``) with ``foreach=True``, so a
streamed block is updated with exactly the arithmetic of ``torch.optim.AdamW(foreach=True)``
on the same tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.optim.adam import adam as _adam

__all__ = ["OptimizerSpec", "as_optimizer_spec", "update_block"]


@dataclass(frozen=True)
class OptimizerSpec:
    """Optimizer hyper-parameters (the fields of ``edgeadapt.export.objectives.OptimizerConfig``).

    Attributes:
        name: ``"adamw"`` or ``"sgd"`` (plain SGD, no momentum, no weight decay).
        lr: learning rate.
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
        if self.name not in ("adamw", "sgd"):
            raise ValueError(f"optimizer must be 'adamw' or 'sgd', got {self.name!r}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay}")
        if self.name == "sgd" and self.weight_decay:
            raise ValueError("sgd here has no weight decay; use weight_decay=0 or optimizer='adamw'")
        object.__setattr__(self, "betas", (float(self.betas[0]), float(self.betas[1])))

    @property
    def state_kinds(self) -> tuple[str, ...]:
        """Optimizer-state vectors kept per parameter."""
        return ("exp_avg", "exp_avg_sq") if self.name == "adamw" else ()

    def to_dict(self) -> dict:
        d = {"name": self.name, "lr": self.lr, "weight_decay": self.weight_decay}
        if self.name == "adamw":
            d.update(betas=list(self.betas), eps=self.eps)
        return d


def as_optimizer_spec(value) -> OptimizerSpec:
    """An :class:`OptimizerSpec` from a name (``"adamw"``), a dict, or any object with the fields
    of ``OptimizerConfig`` (duck-typed, so this module does not import the exporter)."""
    if isinstance(value, OptimizerSpec):
        return value
    if isinstance(value, str):
        return OptimizerSpec(value, weight_decay=0.0 if value == "sgd" else 0.01)
    if isinstance(value, dict):
        return OptimizerSpec(**{**value, "betas": tuple(value.get("betas", (0.9, 0.999)))})
    try:
        return OptimizerSpec(value.name, float(value.lr), float(value.weight_decay),
                             tuple(getattr(value, "betas", (0.9, 0.999))), float(getattr(value, "eps", 1e-8)))
    except AttributeError:
        raise TypeError(f"optimizer must be 'adamw', 'sgd', a dict or an OptimizerConfig, got {value!r}") from None


def update_block(spec: OptimizerSpec, params: list[torch.Tensor], grads: list[torch.Tensor],
                 state: dict[str, list[torch.Tensor]], steps: list[int], lr: float | None = None) -> None:
    """Apply one optimizer step in place to ``params`` (CPU float32 tensors).

    Args:
        spec: hyper-parameters.
        params: the master weights to update in place.
        grads: their gradients (same shapes, CPU).
        state: ``exp_avg`` / ``exp_avg_sq`` lists for AdamW (updated in place).
        steps: per parameter, the number of this update (1 for the first; AdamW bias correction).
        lr: the learning rate for this step (defaults to ``spec.lr``).
    """
    lr = spec.lr if lr is None else lr
    if not params:
        return
    if spec.name == "sgd":
        torch._foreach_add_(params, grads, alpha=-lr)
        return
    step_t = [torch.tensor(float(s - 1)) for s in steps]  # torch's adam adds 1 itself
    _adam(params, grads, state["exp_avg"], state["exp_avg_sq"], [], step_t, foreach=True,
          decoupled_weight_decay=True, amsgrad=False, beta1=spec.betas[0], beta2=spec.betas[1], lr=lr,
          weight_decay=spec.weight_decay, eps=spec.eps, maximize=False)
