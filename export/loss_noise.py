"""How much float32 rounding the loss's own gradient carries, and what it does to the parameters'.

Every parameter gradient starts from the gradient of the loss at the model's output, ``dy``. A
float32 engine computes ``dy`` with rounding ``delta``, and every parameter gradient then carries
``J^T delta`` (``J`` the output's Jacobian in that parameter) besides the rounding of its own
reductions (:mod:`.reduction_noise`). ``delta`` is small next to the *terms* ``dy`` is made of,
not next to ``dy``: the entropy loss's ``dy_k = -(p_k / B) (log p_k + H)`` is tiny where
``log p_k`` is near ``-H`` while its terms are not, so a window whose classes are that balanced
gives a bias gradient whose float32 error is many times ``u |g|``. Which engine rounds more
depends on its kernels (measured: the same export passed on one CPU and failed on another, a
head bias off by 3.3e-6 of its norm against 2.0e-7 allowed), so the allowance is derived from the
computation, not measured on one machine.

:func:`output_gradient_bound` gives, per element of ``dy``, ``gamma_n * m`` with ``m`` the sum
of the magnitudes of the terms the loss's backward adds (in float64, from the output) and ``n``
the roundings on the way (the class sums of softmax and its gradient, the products), plus
float32's smallest normal number (underflow). A
probability ``p = exp(z - max z - log sum exp)`` computed in float32 is off relatively by about
``u (|log p| + log C)`` (the exponent's absolute error), so its magnitude counts as
``p (1 + |log p| + log C)``:

* ``cross_entropy``: ``dy = (p - onehot) / B``; ``m = (p (1 + |log p| + log C) + onehot) / B``,
  ``n = C + 4``;
* ``entropy``: ``dy = p (-log p + sum_j p_j log p_j) / B`` plus the log-softmax gradient's
  ``(-p + p sum_j p_j) / B`` (zero in exact arithmetic, not in float32);
  ``m = p (1 + |log p| + log C) (2 + |log p| + sum_j p_j |log p_j|) / B``, ``n = 2 C + 6``;
* ``mse``: ``dy = 2 (o - y) / N``; ``m = 2 (|o| + |y|) / N``, ``n = 6`` (the target's own
  rounding to float32, the difference, ``1 / N`` and the products);
* ``bce_with_logits``: ``dy = (sigmoid(o) - y) / N``; ``m = (sigmoid(o) (1 + |o|) + |y|) / N``,
  ``n = 6``.

:func:`loss_rounding_allowance` carries that bound to the parameters: ``J^T (s * bound)`` for a
few sign patterns ``s`` (all positive, the signs of ``dy``, and seeded random ones), the largest
norm per parameter. All-positive signs give the worst case of any parameter whose gradient sums
``dy`` over the batch with positive weights (a bias, a weight over non-negative inputs); deeper
parameters mix elements of both signs, which the other patterns probe. It is the first-order
effect, estimated by probes, not a bound over every sign pattern.

:func:`loss_value_bound` bounds the loss value's own rounding the same way: ``gamma_n`` times the
sum of its terms' magnitudes. A confident model's entropy is a sum of tiny terms whose logarithms
are each off by about ``u``: measured 1.2e-7 off a loss of 4.7e-4 (0.026 %), where a relative
tolerance alone allowed 1.05e-7.
"""

from __future__ import annotations

import math

import numpy as np
import torch

__all__ = ["output_gradient_bound", "loss_rounding_allowance", "loss_value_bound", "PROBES"]

#: Sign patterns tried per parameter (all positive, signs of dy, then seeded random ones).
PROBES = 4

_U = float(np.finfo(np.float32).eps) / 2
# Probabilities below float32's smallest normal number underflow (or flush to zero in kernels that
# run without subnormals): an absolute error of up to that much per element.
_TINY = float(np.finfo(np.float32).tiny)


def _gamma(n: int) -> float:
    return n * _U / (1 - n * _U)


def _softmax_terms(o: torch.Tensor) -> tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(batch, classes, log p, p, p's magnitude ``p (1 + |log p| + log C)``) of logits ``o``
    (float64): a float32 probability is off by its exponent's rounding (module docstring)."""
    batch, classes = o.shape[0], o.shape[-1]
    logp = torch.log_softmax(o, -1)
    p = logp.exp()
    return batch, classes, logp, p, p * (1 + logp.abs() + math.log(classes))


def _targets(loss: str, labels) -> torch.Tensor:
    """The targets of an elementwise loss (``mse``, ``bce_with_logits``) in float64; any other loss
    but the two softmax ones has no rounding model."""
    if loss not in ("mse", "bce_with_logits"):
        raise ValueError(f"no rounding model for loss {loss!r}")
    return torch.as_tensor(labels.detach() if isinstance(labels, torch.Tensor) else np.asarray(labels),
                           dtype=torch.float64)


def output_gradient_bound(loss: str, output: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
    """Per element of the loss's gradient at ``output`` (float64, same shape), the bound on its
    float32 rounding (module docstring). ``labels``: class indices (``cross_entropy``), targets
    (``mse``, ``bce_with_logits``) or ``None`` (``entropy``)."""
    o = output.detach().to(torch.float64)
    if loss in ("cross_entropy", "entropy"):
        batch, classes, logp, p, p_magnitude = _softmax_terms(o)
        if loss == "cross_entropy":
            onehot = torch.nn.functional.one_hot(labels.long(), classes).to(torch.float64)
            return _gamma(classes + 4) * (p_magnitude + onehot) / batch + _TINY
        spread = (p * logp.abs()).sum(-1, keepdim=True)
        return _gamma(2 * classes + 6) * p_magnitude * (2 + logp.abs() + spread) / batch + _TINY
    y = _targets(loss, labels)
    n = o.numel()
    if loss == "mse":
        return _gamma(6) * 2 * (o.abs() + y.abs()) / n
    return _gamma(6) * (torch.sigmoid(o) * (1 + o.abs()) + y.abs()) / n + _TINY


def loss_rounding_allowance(output: torch.Tensor, params: dict[str, torch.Tensor], bound: torch.Tensor,
                            dy: torch.Tensor, seed: int = 0) -> dict[str, float]:
    """Per parameter, the largest norm of ``J^T (s * bound)`` over :data:`PROBES` sign patterns
    ``s`` (module docstring). ``output`` must still hold its autograd graph (the caller keeps it,
    ``retain_graph``); ``dy``: the loss's gradient at ``output`` (its signs are one pattern)."""
    names = list(params)
    gen = torch.Generator().manual_seed(seed)
    patterns = [torch.ones_like(bound), torch.sign(dy.detach()).to(bound.dtype)]
    while len(patterns) < PROBES:
        patterns.append(torch.randint(0, 2, bound.shape, generator=gen).to(bound.dtype) * 2 - 1)
    best = dict.fromkeys(names, 0.0)
    for s in patterns:
        grads = torch.autograd.grad(output, [params[n] for n in names], grad_outputs=(s * bound).to(output.dtype),
                                    retain_graph=True, allow_unused=True)
        for n, g in zip(names, grads):
            if g is not None:
                best[n] = max(best[n], math.sqrt(float(g.detach().to(torch.float64).square().sum())))
    return best


def loss_value_bound(loss: str, output: np.ndarray, labels: np.ndarray | None) -> float:
    """Bound on the float32 rounding of the loss's value at ``output`` (module docstring): per loss,
    ``gamma_n`` times the summed magnitudes of its terms, the mean's own sum included in ``n``.

    * ``cross_entropy``: ``log sum exp z - z_y`` per window: ``|z_y - max| + |lse - max| + 1``;
    * ``entropy``: ``-sum_k p_k log p_k`` per window: ``p_k (1 + |log p_k| + log C) (1 + |log p_k|)``
      (``p_k`` and ``log p_k`` each off by their exponent's rounding);
    * ``mse``: ``(o - y)^2``: ``(|o| + |y|)^2``; ``bce_with_logits``: ``|o| + |o y| + log(1 + e^-|o|) + 1``.
    """
    o = torch.as_tensor(np.asarray(output), dtype=torch.float64)
    if loss == "cross_entropy":
        batch, classes = o.shape[0], o.shape[-1]
        shifted = o - o.max(-1, keepdim=True).values
        lse = torch.logsumexp(shifted, -1)
        picked = shifted.gather(-1, torch.as_tensor(np.asarray(labels), dtype=torch.long).reshape(-1, 1))[:, 0]
        magnitude = float((picked.abs() + lse.abs() + 1).sum()) / batch
        return _gamma(classes + 4 + batch) * magnitude + _TINY
    if loss == "entropy":
        batch, classes, logp, _, p_magnitude = _softmax_terms(o)
        magnitude = float((p_magnitude * (1 + logp.abs())).sum()) / batch
        return _gamma(2 * classes + 6 + batch) * magnitude + _TINY
    y = _targets(loss, labels)
    n = o.numel()
    if loss == "mse":
        magnitude = float(((o.abs() + y.abs()) ** 2).sum()) / n
    else:
        magnitude = float((o.abs() + (o * y).abs() + torch.log1p(torch.exp(-o.abs())) + 1).sum()) / n
    return _gamma(n + 6) * magnitude + _TINY
