"""How much float32 rounding a gradient may carry: the conditioning of its final reduction.

Every trained tensor's gradient ends in one reduction: an element ``g_j`` of a weight gradient is
a sum over the batch and all positions, ``g_j = sum_i t_ij`` with terms ``t_ij = dy_i * a_ij``
(``dy`` the gradient at the layer's output, ``a_ij = dy_i/dp_j``: an input value for a conv or
linear weight, a normalized value for a norm's scale, 1 for a bias). Summed in float32 in *any*
order, the computed sum is off by at most ``gamma_n * sum_i |t_ij|``, ``gamma_n = n u / (1 - n u)``
with ``u = eps32 / 2`` and ``n`` the number of terms (Higham, *Accuracy and Stability of
Numerical Algorithms*, 2nd ed., eq. 4.4). The bound scales with the sum of the terms'
magnitudes, not with the magnitude of the sum: a bias gradient summed over 6,400 terms of both
signs that nearly cancel may carry float32 noise far above ``n u |g_j|``, and a kernel that sums
in running order (ONNX Runtime's) gets near it where a pairwise one (torch's) does not. Which
order a machine's kernels use is not known in advance, so the allowance is the bound, not a
measurement.

:class:`ReductionBounds` computes, for each trained tensor, the per-element bound
``(n_j + TERM_ROUNDINGS) u M_j`` where ``M_j = sum_i |dy_i| |a_ij|`` is evaluated exactly, in
float64, from the layer's recorded input and output gradient (forward and tensor hooks on the
same pass that computes the reference gradient): for ``Conv*d`` and ``Linear`` the weight
gradient of the same layer applied to ``|x|`` with output gradient ``|dy|`` (a conv or linear
weight gradient is bilinear in ``x`` and ``dy`` with coefficients 1, so this is ``sum |dy||x|``
term by term); for BatchNorm (running or batch statistics, and the exporter's
:class:`~edgeadapt.export.prepare.FrozenBatchNorm`), LayerNorm, GroupNorm and InstanceNorm the
scale's terms are ``|dy| |x_hat|`` and the shift's ``|dy|``. ``n_j`` is counted the same way
(ones for ``|x|`` and ``|dy|``). A channel-split parameter gets the rows of its full tensor
(the split is a permutation, which moves magnitudes unchanged). ``TERM_ROUNDINGS`` adds the
rounding of each term itself (the product, and the last bits of its factors).

A parameter of any other module (a bare ``nn.Parameter`` such as a position embedding, a
hand-written norm) is decomposed over the batch: ``M_j = sum_b |g_bj|`` with ``g_b`` the
module's own parameter gradient for sample ``b`` (one small VJP per sample, on that module
alone). That sees cancellation between samples, not within one; where a module's forward cannot
be run sample by sample, ``M_j = |g_j|``, the bound of a sum without cancellation.

Not bounded here: rounding that reaches ``dy`` or ``x`` from earlier reductions (a conv's input
gradient sums ``C_out * k`` terms; a batch-statistics BatchNorm's input gradient subtracts two
batch means). Those reductions are shorter than the final one by the batch size or more, and
their error enters each term in proportion to that term's factors, so it is of the same form
``u * sum|terms|`` with a smaller count; ``selfcheck.REDUCTION_FACTOR`` (2) allows them as much
again as the final reduction, and the gap between torch's float32 and float64
(``SPREAD_FACTOR`` x) is allowed on top.
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass
from typing import Self

import numpy as np
import torch
from torch import nn

__all__ = ["TERM_ROUNDINGS", "UNIT_ROUNDOFF", "ReductionBounds", "reduction_allowance"]

log = logging.getLogger(__name__)

#: Unit roundoff of float32 (half its machine epsilon).
UNIT_ROUNDOFF = float(np.finfo(np.float32).eps) / 2
#: Roundings per term beside the ``n - 1`` additions: the product and its two factors' last bits.
TERM_ROUNDINGS = 3

_NORMS = (nn.modules.batchnorm._BatchNorm, nn.LayerNorm, nn.GroupNorm, nn.modules.instancenorm._InstanceNorm)


def reduction_allowance(bound: np.ndarray) -> float:
    """The allowed L2 error of a whole tensor whose elements may each be off by ``bound``
    (``||e|| <= ||bound||`` when ``|e_j| <= bound_j``)."""
    b = np.asarray(bound, dtype=np.float64)
    return math.sqrt(float(np.square(b).sum()))


@dataclass
class _Accumulated:
    magnitude: torch.Tensor | None = None
    terms: torch.Tensor | None = None

    def add(self, magnitude: torch.Tensor, terms: torch.Tensor) -> None:
        self.magnitude = magnitude if self.magnitude is None else self.magnitude + magnitude
        self.terms = terms if self.terms is None else self.terms + terms


def _leaves(module: nn.Module) -> dict[str, nn.Parameter]:
    """The module's own trainable leaf tensors, by their name relative to the module (a
    parametrized attribute contributes its ``parametrizations.<attr>.original*``)."""
    return {n: p for n, p in module.named_parameters() if "." not in n or n.startswith("parametrizations.")}


def _channel_shape(module: nn.Module, x: torch.Tensor) -> list[int]:
    """The shape that broadcasts a per-channel (or per-feature) vector of a norm against ``x``."""
    if isinstance(module, nn.LayerNorm):
        return [1] * (x.dim() - len(module.normalized_shape)) + list(module.normalized_shape)
    return [1, -1] + [1] * (x.dim() - 2)


def _normalized(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``x_hat``, the value the module's scale multiplies (statistics as in the recorded pass)."""
    if isinstance(module, nn.LayerNorm):
        return nn.functional.layer_norm(x, module.normalized_shape, None, None, module.eps)
    if isinstance(module, nn.GroupNorm):
        return nn.functional.group_norm(x, module.num_groups, None, None, module.eps)
    batch_statistics = isinstance(module, nn.modules.batchnorm._BatchNorm) and (
        module.training or module.running_mean is None)
    if isinstance(module, nn.modules.instancenorm._InstanceNorm) or batch_statistics:
        dims = ([0] if batch_statistics else []) + list(range(2, x.dim()))
        mean = x.mean(dims, keepdim=True)
        var = x.var(dims, keepdim=True, unbiased=False)
        return (x - mean) / torch.sqrt(var + module.eps)
    shape = _channel_shape(module, x)
    return (x - module.running_mean.reshape(shape)) / torch.sqrt(module.running_var.reshape(shape) + module.eps)


def _frozen_batchnorm_type() -> type:
    from .prepare import FrozenBatchNorm

    return FrozenBatchNorm


def _is_input_linear(module: nn.Module) -> bool:
    """Whether the module's weight gradient is ``sum dy * x`` (coefficients 1): a conv or linear."""
    return (isinstance(module, nn.modules.conv._ConvNd) and not module.transposed) or isinstance(module, nn.Linear)


def _input_linear_twin(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The layer applied to ``x`` (``|x|`` or ones): linear in each parameter, its gradient with
    output gradient ``c`` is ``sum_i c_i |a_ij|``."""
    if isinstance(module, nn.Linear):
        return nn.functional.linear(x, module.weight, module.bias)
    return module._conv_forward(x, module.weight, module.bias)


def _norm_twin(module: nn.Module, coefficient: torch.Tensor) -> torch.Tensor:
    """``coefficient * weight + bias`` broadcast as the norm applies them."""
    shape = _channel_shape(module, coefficient)
    out = coefficient
    if getattr(module, "weight", None) is not None:
        out = out * module.weight.reshape(shape)
    if getattr(module, "bias", None) is not None:
        out = out + module.bias.reshape(shape)
    return out


class ReductionBounds:
    """Records, during one forward/backward pass, the float32 rounding bound of each trained
    tensor's gradient (see the module docstring).

    Use as a context manager around the pass; afterwards :meth:`bounds` gives, per parameter
    name (as ``model.named_parameters()`` spells it), an array of the gradient's shape.
    """

    def __init__(self, model: nn.Module, names: list[str]):
        self.model, self.names = model, list(names)
        self._owner: dict[str, tuple[nn.Module, str]] = {}
        for path, module in model.named_modules():
            for local in _leaves(module):
                full = f"{path}.{local}" if path else local
                if full in self.names and full not in self._owner:  # the layer, not its parametrization
                    self._owner[full] = (module, local)
        self._modules = {id(m): m for m, _ in self._owner.values()}
        self._sums: dict[str, _Accumulated] = {n: _Accumulated() for n in self.names}
        self._handles = []
        self._recording = False  # the recorder's own module calls register nothing

    def __enter__(self) -> Self:
        for module in self._modules.values():
            self._handles.append(module.register_forward_hook(self._forward_hook, with_kwargs=True))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _forward_hook(self, module, args, kwargs, output):
        if self._recording or not isinstance(output, torch.Tensor) or not output.requires_grad or not args:
            return
        x = args[0].detach()

        def on_gradient(dy):
            if self._recording:
                return
            self._recording = True
            try:
                with torch.enable_grad():
                    self._record(module, x, args, kwargs, dy.detach())
            finally:
                self._recording = False

        output.register_hook(on_gradient)

    def _record(self, module: nn.Module, x: torch.Tensor, args, kwargs, dy: torch.Tensor) -> None:
        leaves = {n: p for n, p in _leaves(module).items() if p.requires_grad}
        mine = [(full, local) for full, (m, local) in self._owner.items() if m is module and local in leaves]
        if not mine:
            return
        tensors = [leaves[local] for _, local in mine]
        pairs = self._known_terms(module, x, dy, tensors)
        if pairs is None:
            pairs = self._per_sample_terms(module, args, kwargs, dy, tensors)
        for (full, _), (magnitude, terms) in zip(mine, zip(*pairs)):
            self._sums[full].add(magnitude, terms)

    @staticmethod
    def _vjp(out: torch.Tensor, tensors: list[torch.Tensor], cotangent: torch.Tensor) -> list[torch.Tensor]:
        grads = torch.autograd.grad(out, tensors, cotangent, allow_unused=True)
        return [torch.zeros_like(t) if g is None else g for g, t in zip(grads, tensors)]

    def _known_terms(self, module, x, dy, tensors):
        if isinstance(module, (*_NORMS, _frozen_batchnorm_type())):
            coefficient = _normalized(module, x).abs()
            twin = functools.partial(_norm_twin, module)
        elif _is_input_linear(module):
            coefficient = x.abs()
            twin = functools.partial(_input_linear_twin, module)
        else:
            return None
        magnitudes = self._vjp(twin(coefficient), tensors, dy.abs())
        terms = self._vjp(twin(torch.ones_like(coefficient)), tensors, torch.ones_like(dy))
        return magnitudes, terms

    def _per_sample_terms(self, module, args, kwargs, dy, tensors):
        batch = dy.shape[0] if dy.dim() else 0
        try:
            if batch < 1 or any(isinstance(a, torch.Tensor) and (a.dim() == 0 or a.shape[0] != batch) for a in args):
                raise ValueError("not batch-first")
            magnitude = [torch.zeros_like(t) for t in tensors]
            for b in range(batch):
                sample = [a[b:b + 1].detach() if isinstance(a, torch.Tensor) else a for a in args]
                grads = self._vjp(module(*sample, **kwargs), tensors, dy[b:b + 1])
                magnitude = [m + g.abs() for m, g in zip(magnitude, grads)]
        except (RuntimeError, ValueError, TypeError) as e:  # a module that mixes samples
            log.debug("per-sample magnitudes of %s unavailable (%s); using |g|", type(module).__name__, e)
            args0 = [a.detach() if isinstance(a, torch.Tensor) else a for a in args]
            magnitude = [g.abs() for g in self._vjp(module(*args0, **kwargs), tensors, dy)]
        terms = [torch.full_like(t, float(dy.numel())) for t in tensors]
        return magnitude, terms

    def bounds(self) -> dict[str, np.ndarray]:
        """Per parameter: the element-wise float32 rounding bound ``(n_j + TERM_ROUNDINGS) u M_j``
        of its gradient (zeros for a parameter no recorded pass reached)."""
        out = {}
        for name in self.names:
            acc = self._sums[name]
            if acc.magnitude is None:
                shape = tuple(dict(self.model.named_parameters())[name].shape)
                out[name] = np.zeros(shape)
                continue
            m = acc.magnitude.detach().double().cpu().numpy()
            n = acc.terms.detach().double().cpu().numpy()
            out[name] = (n + TERM_ROUNDINGS) * UNIT_ROUNDOFF * m
        return out
