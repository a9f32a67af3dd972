"""Importance of parameters and output-channel groups, measured on source data with torch.

The measure is the empirical Fisher information: the mean over a few batches of the squared
gradient of the loss, per element, summed per output channel (axis 0). Parameters whose
gradient is large on the source data are the ones whose change moves the loss most, the usual
proxy for what is worth adapting. Without labels the model's own predictions stand in for them
(the label-free form). The result is a plain dict for :mod:`edgeadapt.sched.select`:
parameter name -> ``np.ndarray`` of one value per output channel (a 0-d parameter: a float).
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from torch import nn

from ..sched.ir import Graph
from ..sched.policy import UpdatePolicy
from .prepare import prepare_model

__all__ = ["measure_importance"]

log = logging.getLogger(__name__)


def measure_importance(model: nn.Module, inputs: torch.Tensor, graph: Graph | None = None, *,
                       labels: torch.Tensor | None = None, batchnorm: str = "frozen", loss: str = "cross_entropy",
                       batch_windows: int = 32, max_batches: int = 4) -> dict[str, np.ndarray | float]:
    """Mean squared gradient per output channel of every parameter, over a few batches.

    Args:
        model: the source model (deep-copied; never modified).
        inputs: source windows, float32 ``(n, ...)``; the first ``batch_windows x max_batches``
            are used.
        graph: the scheduler graph; when given, only its parameters are returned.
        labels: targets for ``loss`` (``None``: the model's own predictions, label-free).
        batchnorm: the BatchNorm mode the model is exported with (``"frozen"`` measures the
            eval-mode model the device trains).
        loss: ``"cross_entropy"`` or ``"mse"``.
        batch_windows: windows per batch.
        max_batches: batches averaged.

    Returns:
        Parameter name -> per-output-channel importance (``np.ndarray``; a float for 0-d ones).

    Raises:
        ValueError: empty inputs or an unknown loss.
    """
    if loss not in ("cross_entropy", "mse"):
        raise ValueError(f"importance is measured with 'cross_entropy' or 'mse', got {loss!r}")
    if not isinstance(inputs, torch.Tensor) or inputs.shape[0] == 0:
        raise ValueError("inputs must be a non-empty float32 tensor of shape (n, ...)")
    module = prepare_model(model, UpdatePolicy.full(), batchnorm).module
    module.train(batchnorm == "batch")
    params = dict(module.named_parameters())
    wanted = [p.name for p in graph.params] if graph is not None else list(params)
    sums = {n: torch.zeros(params[n].shape[0] if params[n].dim() else 1, dtype=torch.float64) for n in wanted}
    n_batches = 0
    for start in range(0, min(len(inputs), batch_windows * max_batches), batch_windows):
        x = inputs[start:start + batch_windows]
        module.zero_grad(set_to_none=True)
        out = module(x)
        if loss == "cross_entropy":
            target = labels[start:start + batch_windows] if labels is not None else out.detach().argmax(dim=1)
            value = nn.functional.cross_entropy(out, target)
        else:
            target = labels[start:start + batch_windows] if labels is not None else out.detach()
            value = nn.functional.mse_loss(out, target)
        value.backward()
        for n in wanted:
            g = params[n].grad
            if g is None:
                continue
            sq = g.detach().double() ** 2
            sums[n] += sq.reshape(sq.shape[0], -1).sum(dim=1) if g.dim() else sq.reshape(1)
        n_batches += 1
    out_dict: dict[str, np.ndarray | float] = {}
    for n in wanted:
        per_channel = (sums[n] / max(1, n_batches)).numpy()
        out_dict[n] = per_channel if params[n].dim() else float(per_channel[0])
    log.debug("measured importance of %d parameters over %d batches", len(out_dict), n_batches)
    return out_dict
