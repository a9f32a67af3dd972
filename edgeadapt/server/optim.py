"""The CPU optimizer update of one block: torch's AdamW (or SGD) arithmetic, vectorised.

The update calls torch's own functional implementation (``torch.optim.adam.adam`` with
decoupled weight decay, the code behind ``torch.optim.AdamW``) with ``foreach=True``, so a
streamed block is updated with exactly the arithmetic of ``torch.optim.AdamW(foreach=True)``
on the same tensors.
"""

from __future__ import annotations

import torch
from torch.optim.adam import adam as _adam

from ..optimizer_config import OptimizerConfig

__all__ = ["update_block"]


def update_block(spec: OptimizerConfig, params: list[torch.Tensor], grads: list[torch.Tensor],
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
