"""The rounding of the loss's own gradient (edgeadapt.export.loss_noise): the bound holds for float32
computations of it in different orders, on random cases and on windows whose classes are balanced
enough that the entropy gradient cancels; the allowance carries it to a head exactly."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from edgeadapt.export.loss_noise import loss_rounding_allowance, loss_value_bound, output_gradient_bound
from edgeadapt.export.objectives import torch_loss


def _softmax_graph_order(z: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(p, log p) of logits ``z`` in float32, as the training graph's Softmax and LogSoftmax."""
    z = z.astype(np.float32)
    shifted = z - z.max(axis=1, keepdims=True)
    e = np.exp(shifted)
    return e / e.sum(axis=1, keepdims=True), shifted - np.log(e.sum(axis=1, keepdims=True))


def _entropy_grad_graph_order(z: np.ndarray) -> np.ndarray:
    """The entropy loss's gradient in float32 the way a training graph builds it from its ops:
    Mul's gradients into p and log p, then SoftmaxGrad and LogSoftmaxGrad (each a class sum)."""
    p, logp = _softmax_graph_order(z)
    b = np.float32(z.shape[0])
    dp, dlogp = -logp / b, -p / b
    d_softmax = p * (dp - (dp * p).sum(axis=1, keepdims=True))
    d_logsoftmax = dlogp - np.exp(logp) * dlogp.sum(axis=1, keepdims=True)
    return d_softmax + d_logsoftmax


def _labels(loss: str, y, dtype: torch.dtype):
    """``y`` as ``torch_loss`` takes it: class indices as they are, targets in ``dtype``."""
    return None if y is None else (y if loss == "cross_entropy" else y.to(dtype))


def _float32_grads(loss: str, z: np.ndarray, y) -> list[np.ndarray]:
    """The loss's gradient at the output in float32: torch's autograd, and (entropy) the graph's order."""
    out = torch.tensor(z, dtype=torch.float32, requires_grad=True)
    torch_loss(loss, out, _labels(loss, y, torch.float32)).backward()
    grads = [out.grad.numpy().astype(np.float64)]
    if loss == "entropy":
        grads.append(_entropy_grad_graph_order(z).astype(np.float64))
    return grads


def _case(loss: str, rng: np.random.Generator):
    batch, classes = int(rng.integers(1, 9)), int(rng.integers(2, 12))
    scale = float(rng.choice([0.1, 1.0, 5.0, 20.0]))
    z = rng.normal(size=(batch, classes)) * scale
    if loss == "entropy" and rng.random() < 0.5:  # near-balanced classes: dy_k ~ 0 where log p_k ~ -H
        z = rng.normal(size=(batch, classes)) * 1e-3 + rng.integers(0, 2, size=(batch, classes))
    if loss == "cross_entropy":
        y = torch.from_numpy(rng.integers(0, classes, size=batch))
    elif loss == "entropy":
        y = None
    else:
        y = torch.from_numpy(rng.random((batch, classes)) if loss == "bce_with_logits"
                             else rng.normal(size=(batch, classes)) * scale)
    return z, y


@pytest.mark.parametrize("loss", ["cross_entropy", "entropy", "mse", "bce_with_logits"])
def test_float32_loss_gradients_stay_within_the_bound(loss):
    rng = np.random.default_rng(0)
    worst = 0.0
    for _ in range(300):
        z, y = _case(loss, rng)
        labels = _labels(loss, y, torch.float64)
        # the float32 inputs are what the engines see: their own rounding is not the loss's
        z32 = z.astype(np.float32).astype(np.float64)
        out_exact = torch.tensor(z32, dtype=torch.float64, requires_grad=True)
        torch_loss(loss, out_exact, labels).backward()
        exact = out_exact.grad.numpy()
        bound = output_gradient_bound(loss, out_exact, labels).numpy()
        for got in _float32_grads(loss, z32, y):
            err = np.abs(got - exact)
            worst = max(worst, float((err / np.maximum(bound, 1e-300)).max()))
            assert np.all(err <= bound), (loss, float((err - bound).max()))
    assert worst > 0.01  # the bound is not vacuous: float32 errors reach a visible share of it


def test_the_entropy_bound_covers_a_cancelling_gradient_that_relative_rounding_does_not():
    """Two classes of nearly equal probability: dy is tiny next to its terms, and float32 rounding of
    dy is many ulps of dy itself (what made a head bias fail a 2e-7 relative allowance)."""
    z = np.array([[0.3, 0.3 + 1e-6, -4.0]], dtype=np.float32).astype(np.float64)
    out = torch.tensor(z, requires_grad=True)
    torch_loss("entropy", out, None).backward()
    exact = out.grad.numpy()
    got = _entropy_grad_graph_order(z)
    u = float(np.finfo(np.float32).eps) / 2
    assert np.any(np.abs(got - exact) > 8 * u * np.abs(exact))  # relative rounding alone would not cover it
    assert np.all(np.abs(got - exact) <= output_gradient_bound("entropy", out, None).numpy())


def test_the_allowance_of_a_head_bias_is_the_bound_summed_over_the_batch():
    torch.manual_seed(0)
    head = torch.nn.Linear(5, 4).double()
    x = torch.randn(6, 5, dtype=torch.float64)
    out = head(x)
    value = torch_loss("entropy", out, None)
    out.retain_grad()
    value.backward(retain_graph=True)
    bound = output_gradient_bound("entropy", out, None)
    allowance = loss_rounding_allowance(out, dict(head.named_parameters()), bound, out.grad)
    assert allowance["bias"] == pytest.approx(math.sqrt(float(bound.sum(0).square().sum())), rel=1e-12)
    # the all-positive probe alone gives the weight's bound times the inputs
    assert allowance["weight"] >= math.sqrt(float((bound.T @ x).square().sum())) * (1 - 1e-12)
    # small next to the gradients themselves: the check stays a check
    assert allowance["bias"] < 1e-3 * float(head.bias.grad.norm())


def test_unknown_loss_is_refused():
    with pytest.raises(ValueError, match="no rounding model"):
        output_gradient_bound("hinge", torch.zeros(2, 3, dtype=torch.float64), None)


def _entropy_value_graph_order(z: np.ndarray) -> float:
    """The entropy loss's value in float32 the way the training graph computes it."""
    p, logp = _softmax_graph_order(z)
    return float(-(p * logp).sum(axis=1).mean(dtype=np.float32))


@pytest.mark.parametrize("loss", ["cross_entropy", "entropy", "mse", "bce_with_logits"])
def test_float32_loss_values_stay_within_the_bound(loss):
    rng = np.random.default_rng(1)
    worst = 0.0
    for _ in range(300):
        z, y = _case(loss, rng)
        if loss == "entropy" and rng.random() < 0.3:  # a confident model: the entropy is a sum of tiny terms
            z = rng.normal(size=z.shape) + 12 * np.eye(z.shape[1])[rng.integers(0, z.shape[1], len(z))]
        z32 = z.astype(np.float32).astype(np.float64)
        exact = float(torch_loss(loss, torch.tensor(z32), _labels(loss, y, torch.float64)))
        got = [float(torch_loss(loss, torch.tensor(z32, dtype=torch.float32), _labels(loss, y, torch.float32)))]
        if loss == "entropy":
            got.append(_entropy_value_graph_order(z32))
        bound = loss_value_bound(loss, z32, None if y is None else y.numpy())
        for g in got:
            assert abs(g - exact) <= bound, (loss, abs(g - exact), bound)
            worst = max(worst, abs(g - exact) / bound)
    assert worst > 0.01


def test_a_confident_models_entropy_is_off_by_more_than_a_relative_tolerance_allows():
    """One window, one class far ahead: the entropy is ~1e-4 and its float32 value is off by ulps of
    its terms, not of itself."""
    z = np.array([[9.0, 0.3, -0.2, 0.1, 0.0, -0.4, 0.2]], dtype=np.float32).astype(np.float64)
    exact = float(torch_loss("entropy", torch.tensor(z), None))
    got = _entropy_value_graph_order(z)
    assert abs(got - exact) <= loss_value_bound("entropy", z, None)
    assert loss_value_bound("entropy", z, None) > 1e-5 * exact  # more than the old relative tolerance alone
