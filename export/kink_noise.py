"""Gradients float32 cannot decide: elements that sit at a kink of a piecewise-linear activation.

ReLU, LeakyReLU, ReLU6 and Hardtanh have kinks (0; 0 and 6; their clamp bounds) where the
derivative jumps. An element whose pre-activation lies within float32 rounding of a kink has an
undecided derivative: the float64 reference puts it on one side, a float32 engine may put it on
the other, and that element's whole contribution then moves from one gradient to the other. No
tolerance on rounding covers this: one element's share of a BatchNorm bias gradient can be
percents of its norm (a pre-activation 1.4e-7 from 0 in a batch-statistics BatchNorm's output
moved a bias gradient by 3 %, on both engines alike, while torch's float32 happened to land on
the float64 side).

:class:`KinkAllowance` records, during the reference pass, the input of every such activation
(a :class:`torch.overrides.TorchFunctionMode`, so functional calls count as well as modules)
and the gradient that reaches its output. After the backward pass, the elements within
``KINK_ULPS`` float32 units in the last place of the tensor's largest magnitude of a kink are
*undecided*; for each (closest first, at most ``MAX_KINK_ELEMENTS``), the change of every
trained gradient when that element's derivative takes the other side's value is computed
exactly with one vector-Jacobian product: the output gradient at the element times the jump of
the derivative, carried back to the parameters. The allowance of a gradient is the sum of the
norms of those changes (the triangle inequality: any subset of the elements may flip).

An element exactly at a kink is not undecided: it is exact in both precisions (a padded zero,
a value clamped before), and the engine must follow torch's convention for the derivative there
(ONNX Runtime's ``Clip`` gradient at ties does not, and the self-check refuses it).

Elements further from a kink are decided by float32 as well as float64: a pre-activation is a
reduction of ``K`` terms with a relative rounding of a few ``u`` times its conditioning, and
``KINK_ULPS`` (64) units of the tensor's largest magnitude covers that for the layers of this
project's models; a pre-activation computed with worse conditioning shows as a gradient
difference the check then reports.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Self

import numpy as np
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["KINK_ULPS", "MAX_KINK_ELEMENTS", "KinkAllowance"]

log = logging.getLogger(__name__)

#: An element within this many float32 ulps of its tensor's largest magnitude of a kink is undecided.
KINK_ULPS = 64
#: At most this many undecided elements get their own vector-Jacobian product (closest first).
MAX_KINK_ELEMENTS = 64

_EPS32 = float(np.finfo(np.float32).eps)


def _kinks(func, args, kwargs) -> list[tuple[float, float]] | None:
    """For a piecewise-linear activation call: its kinks as (position, jump of the derivative
    across it); ``None`` for any other call."""
    def arg(i: int, name: str, default):
        return args[i] if len(args) > i else kwargs.get(name, default)

    if func in (F.relu, torch.relu, torch.Tensor.relu):
        return [(0.0, 1.0)]
    if func is F.leaky_relu:
        return [(0.0, 1.0 - float(arg(1, "negative_slope", 0.01)))]
    if func is F.relu6:
        return [(0.0, 1.0), (6.0, 1.0)]
    if func is F.hardtanh:
        return [(float(arg(1, "min_val", -1.0)), 1.0), (float(arg(2, "max_val", 1.0)), 1.0)]
    return None


# Position of the ``inplace`` argument of the activations that have one.
_INPLACE_ARG = {F.relu: 1, F.relu6: 1, F.leaky_relu: 2, F.hardtanh: 3}


def _inplace(func, args, kwargs) -> bool:
    i = _INPLACE_ARG[func]
    return bool(args[i] if len(args) > i else kwargs.get("inplace", False))


@dataclass
class _Site:
    """One activation call: its input (in the graph) and the gradient at its output."""

    input: torch.Tensor
    kinks: list[tuple[float, float]]
    output_grad: torch.Tensor | None = None


class _Recorder(TorchFunctionMode):
    def __init__(self, sites: list[_Site]):
        super().__init__()
        self.sites = sites

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kinks = _kinks(func, args, kwargs)
        x = args[0] if args else kwargs.get("input")
        if kinks is None or not isinstance(x, torch.Tensor) or not x.requires_grad:
            return func(*args, **kwargs)
        # an in-place activation overwrites its input: keep the pre-activation (a graph node)
        recorded = x.clone() if func in _INPLACE_ARG and _inplace(func, args, kwargs) else x
        out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor) and out.requires_grad:
            site = _Site(recorded, kinks)

            def keep(grad, site=site):
                site.output_grad = grad.detach()

            out.register_hook(keep)
            self.sites.append(site)
        return out


class KinkAllowance:
    """Records the activations of one forward pass (``with`` block) and, after its backward
    pass (run with ``retain_graph=True``), gives each named parameter's allowance for undecided
    elements (module docstring)."""

    def __init__(self, params: dict[str, torch.Tensor]):
        self.params = params
        self._sites: list[_Site] = []
        self._mode = _Recorder(self._sites)

    def __enter__(self) -> Self:
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)

    def undecided(self) -> list[tuple[float, int, int, float]]:
        """Undecided elements, closest to their kink (in units of the tolerance) first:
        (distance / tolerance, site index, flat element index, jump of the derivative)."""
        found = []
        for s, site in enumerate(self._sites):
            if site.output_grad is None:
                continue
            x = site.input.detach()
            tolerance = KINK_ULPS * _EPS32 * float(x.abs().max())
            if tolerance == 0.0:
                continue
            flat = x.reshape(-1)
            for position, jump in site.kinks:
                distance = (flat - position).abs()
                # exactly at the kink (a padded zero, a value clamped before): both precisions
                # compute it exactly, so the derivative is torch's convention, not undecided
                for i in torch.nonzero((distance > 0) & (distance <= tolerance)).reshape(-1).tolist():
                    found.append((float(distance[i]) / tolerance, s, i, jump))
        found.sort()
        return found

    def allowance(self) -> dict[str, float]:
        """Per parameter: the summed norm of its gradient's change when each undecided element
        takes the other side of its kink (0 for every parameter when there is none)."""
        out = dict.fromkeys(self.params, 0.0)
        found = self.undecided()
        if len(found) > MAX_KINK_ELEMENTS:
            log.debug("%d elements at a kink; the %d closest are allowed for", len(found), MAX_KINK_ELEMENTS)
        names = [n for n, p in self.params.items() if p.requires_grad]
        # every seed first: the products below pass through the hooks of earlier sites
        seeds = []
        for _, s, i, jump in found[:MAX_KINK_ELEMENTS]:
            site = self._sites[s]
            seed = torch.zeros_like(site.input).reshape(-1)
            seed[i] = site.output_grad.reshape(-1)[i] * jump
            seeds.append((site.input, seed.reshape(site.input.shape)))
        for x, seed in seeds:
            grads = torch.autograd.grad(x, [self.params[n] for n in names], seed, retain_graph=True, allow_unused=True)
            for n, g in zip(names, grads):
                if g is not None:
                    out[n] += float(torch.linalg.vector_norm(g.detach().double()))
        return out
