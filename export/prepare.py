"""Rewrite a torch model into the form that is exported for on-device training.

Two rewrites, both on a deep copy (the caller's model is never touched):

* **Frozen BatchNorm** (default): every ``BatchNorm1d/2d`` becomes :class:`FrozenBatchNorm`, an
  explicit per-channel affine over the running statistics. ONNX Runtime would otherwise train
  every BatchNormalization with batch statistics; with this rewrite the statistics are constants
  and the layer matches torch's eval-mode BatchNorm.
* **Channel split**: a parameter trained on a subset of output channels is re-parametrised as
  ``concat([trained, frozen])[index]`` along axis 0. Only ``trained`` is a trainable initializer,
  so gradients and optimizer state cover the slice alone and the frozen slice stays bit-identical
  under any optimizer, weight decay included.

The decisions (which parameter trains, which channels) come from the planner: a
:class:`~edgeadapt.sched.Plan` (:func:`prepare_from_plan`) or an update policy that the planner
resolves (:func:`prepare_model`); this module only applies them.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.nn.utils import parametrize

from ..bundle import BATCHNORM_MODES, ParameterEntry
from ..sched.ir import Param
from ..sched.plan import ParamPlan, Plan
from ..sched.policy import Mode, UpdatePolicy
from ..sched.resolve import resolve_param_list

__all__ = ["FrozenBatchNorm", "ChannelSplit", "PreparedModel", "prepare_model", "prepare_from_plan", "channel_masks",
           "BATCHNORM_MODES"]

log = logging.getLogger(__name__)


class FrozenBatchNorm(nn.Module):
    """BatchNorm with fixed running statistics, written as ``x * scale + shift``.

    Keeps the parameter names ``weight`` and ``bias`` of the layer it replaces, so update
    policies and state dicts address it the same way.
    """

    def __init__(self, bn: nn.modules.batchnorm._BatchNorm):
        super().__init__()
        if not bn.track_running_stats or bn.running_mean is None:
            raise ValueError("FrozenBatchNorm needs running statistics (track_running_stats=True)")
        n = bn.num_features
        self.eps = float(bn.eps)
        self.weight = nn.Parameter(bn.weight.detach().clone() if bn.affine else torch.ones(n))
        self.bias = nn.Parameter(bn.bias.detach().clone() if bn.affine else torch.zeros(n))
        self.register_buffer("running_mean", bn.running_mean.detach().clone())
        self.register_buffer("running_var", bn.running_var.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.weight * torch.rsqrt(self.running_var + self.eps)
        shift = self.bias - self.running_mean * scale
        shape = [1, -1] + [1] * (x.dim() - 2)
        return x * scale.reshape(shape) + shift.reshape(shape)


class ChannelSplit(nn.Module):
    """Parametrization: a tensor assembled from a trained and a frozen slice of its output channels."""

    def __init__(self, trained: tuple[int, ...], n_out: int):
        super().__init__()
        trained_t = torch.tensor(trained, dtype=torch.long)
        frozen_mask = torch.ones(n_out, dtype=torch.bool)
        frozen_mask[trained_t] = False
        order = torch.cat([trained_t, torch.nonzero(frozen_mask).flatten()])
        self.n_trained = len(trained)
        self.register_buffer("order", order, persistent=False)
        # index[c] = position of channel c in concat([trained, frozen]).
        self.register_buffer("index", torch.argsort(order))

    def forward(self, trained: torch.Tensor, frozen: torch.Tensor) -> torch.Tensor:
        return torch.index_select(torch.cat([trained, frozen], 0), 0, self.index)

    def right_inverse(self, full: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ordered = full.detach()[self.order]
        return ordered[: self.n_trained].clone(), ordered[self.n_trained :].clone()


@dataclass(frozen=True)
class PreparedModel:
    """A rewritten copy of the model plus how each original parameter maps to graph tensors.

    Attributes:
        module: the rewritten model, in eval mode, ready for ONNX export.
        entries: one :class:`ParameterEntry` per original parameter, in ``named_parameters`` order;
            ``onnx_names`` holds the *torch* names of the tensors (renamed after export).
        trained_channels: for channel-split parameters, the trained output channels.
    """

    module: nn.Module
    entries: tuple[ParameterEntry, ...]
    trained_channels: dict[str, tuple[int, ...]]


def _replace_batchnorms(model: nn.Module) -> int:
    count = 0
    for path, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, (nn.BatchNorm1d, nn.BatchNorm2d)):
                setattr(module, child_name, FrozenBatchNorm(child))
                count += 1
    return count


def _copy_with_batchnorm(model: nn.Module, batchnorm: str) -> nn.Module:
    if batchnorm not in BATCHNORM_MODES:
        raise ValueError(f"batchnorm must be one of {BATCHNORM_MODES}, got {batchnorm!r}")
    prepared = copy.deepcopy(model).eval()
    if batchnorm == "frozen":
        n = _replace_batchnorms(prepared)
        log.debug("replaced %d BatchNorm layers by frozen affine layers", n)
    return prepared


def _apply(prepared: nn.Module, decisions: dict[str, ParamPlan], labels: dict[str, str]) -> PreparedModel:
    """Channel-split and list the parameters of ``prepared`` as ``decisions`` say (absent: frozen).

    ``labels`` optionally overrides the mode recorded in an entry (``"bias"`` for a bias trained
    by a bias rule).
    """
    entries: list[ParameterEntry] = []
    trained_channels: dict[str, tuple[int, ...]] = {}
    for path, module in list(prepared.named_modules()):
        for local, param in list(module.named_parameters(recurse=False)):
            name = f"{path}.{local}" if path else local
            shape = tuple(param.shape)
            numel = int(param.numel())
            decision = decisions.get(name, ParamPlan(name, Mode.FROZEN))
            if decision.mode is Mode.CHANNELS:
                n_out = shape[0] if shape else 1
                channels = decision.channels
                if not shape or channels[-1] >= n_out:
                    raise ValueError(f"the plan trains channels {list(channels)} of {name}, "
                                     f"which has shape {list(shape)}")
                if len(channels) == n_out:
                    decision = ParamPlan(name, Mode.FULL)
            if decision.mode is Mode.CHANNELS:
                parametrize.register_parametrization(module, local, ChannelSplit(channels, n_out), unsafe=True)
                base = f"{path}.parametrizations.{local}" if path else f"parametrizations.{local}"
                onnx_names = {"trained": f"{base}.original0", "frozen": f"{base}.original1", "index": f"{base}.0.index"}
                entries.append(ParameterEntry(name, shape, Mode.CHANNELS.value, onnx_names,
                                              numel // n_out * len(channels)))
                trained_channels[name] = channels
            elif decision.trains:
                entries.append(ParameterEntry(name, shape, labels.get(name, Mode.FULL.value), {"value": name}, numel))
            else:
                entries.append(ParameterEntry(name, shape, Mode.FROZEN.value, {"value": name}, 0))
    if not any(e.trainable_numel for e in entries):
        raise ValueError(
            "the update policy trains no parameter of this model; check the rule patterns against "
            f"the module paths (e.g. {[p for p, m in prepared.named_modules() if p][:6]})"
        )
    return PreparedModel(prepared, tuple(entries), trained_channels)


def prepare_from_plan(model: nn.Module, plan: Plan, batchnorm: str = "frozen") -> PreparedModel:
    """Copy ``model``, apply the BatchNorm mode and the plan's per-parameter updates.

    Parameters the plan does not list (the forward never uses them) stay frozen.

    Raises:
        ValueError: unknown ``batchnorm`` mode, a plan that trains nothing of this model, or
            channels out of range.
    """
    prepared = _copy_with_batchnorm(model, batchnorm)
    own = {n for n, _ in prepared.named_parameters()}
    unknown = sorted(p.name for p in plan.params if p.trains and p.name not in own)
    if unknown:
        raise ValueError(f"the plan trains parameters this model does not have: {unknown[:5]}; "
                         "was it made for another model?")
    return _apply(prepared, {p.name: p for p in plan.params}, {})


def _sched_params(module: nn.Module) -> list[Param]:
    out = []
    for path, m in module.named_modules():
        for local, param in m.named_parameters(recurse=False):
            out.append(Param(f"{path}.{local}" if path else local, tuple(param.shape), param.element_size(),
                             path, type(m).__name__))
    return out


def prepare_model(model: nn.Module, policy: UpdatePolicy, batchnorm: str = "frozen") -> PreparedModel:
    """Copy ``model``, apply the BatchNorm mode and the updates that ``policy`` resolves to.

    The policy is resolved by the planner (:func:`edgeadapt.sched.resolve.resolve_param_list`);
    this only applies the decisions (see :func:`prepare_from_plan` for a whole plan).

    Raises:
        ValueError: unknown ``batchnorm`` mode, a policy that trains nothing, or channel indices
            out of range.
    """
    prepared = _copy_with_batchnorm(model, batchnorm)
    params = _sched_params(prepared)
    weights = {n: p.detach().cpu().numpy() for n, p in prepared.named_parameters()}
    decisions = resolve_param_list(params, policy, weights)
    labels = {}
    for p in params:
        rule = policy.rule_for(p.module, p.module_type, p.name.rsplit(".", 1)[-1])
        if (rule.mode if rule is not None else policy.default) is Mode.BIAS and decisions[p.name].trains:
            labels[p.name] = Mode.BIAS.value
    return _apply(prepared, decisions, labels)


def channel_masks(entries: tuple[ParameterEntry, ...],
                  trained_channels: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    """Per-parameter bool masks over output channels (axis 0); True where values may change."""
    masks = {}
    for e in entries:
        n_out = e.shape[0] if e.shape else 1
        if e.name in trained_channels:
            m = np.zeros(n_out, dtype=bool)
            m[list(trained_channels[e.name])] = True
        else:
            m = np.full(n_out, e.trainable_numel > 0, dtype=bool)
        masks[e.name] = m
    return masks
