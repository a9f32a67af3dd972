"""Activation elements at a kink (edgeadapt.export.kink_noise): found, and their gradient share exact.

A two-layer net ``head(act(fc(x)))`` in float64 with one pre-activation placed within rounding
of a kink: the allowance must equal the change of every gradient when that element's derivative
takes the other side, computed by brute force (moving the element across the kink by 2e-12
changes nothing else measurably).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from edgeadapt.export.kink_noise import KINK_ULPS, KinkAllowance
from edgeadapt.export.reduction_noise import ReductionBounds
from edgeadapt.export.selfcheck import compare_gradients

ACTIVATIONS = {
    "nn.ReLU": (nn.ReLU(), 0.0, 1.0),
    "nn.ReLU(inplace)": (nn.ReLU(inplace=True), 0.0, 1.0),
    "F.relu": (F.relu, 0.0, 1.0),
    "torch.relu": (torch.relu, 0.0, 1.0),
    "Tensor.relu": (lambda t: t.relu(), 0.0, 1.0),
    "leaky_relu 0.2": (lambda t: F.leaky_relu(t, 0.2), 0.0, 0.8),
    "relu6 at 6": (F.relu6, 6.0, 1.0),
    "hardtanh at -2": (lambda t: F.hardtanh(t, -2.0, 3.0), -2.0, 1.0),
}


class Net(nn.Module):
    def __init__(self, act):
        super().__init__()
        self.fc = nn.Linear(5, 7)
        self.head = nn.Linear(7, 3)
        self.act = act

    def forward(self, x):
        return self.head(self.act(self.fc(x)))


def _net(act, kink: float, offset: float, seed: int = 0) -> tuple[Net, torch.Tensor]:
    """A float64 net whose pre-activation (sample 1, unit 4) is ``kink + offset``."""
    torch.manual_seed(seed)
    net = Net(act).double()
    x = torch.randn(4, 5, dtype=torch.float64)
    with torch.no_grad():
        pre = net.fc(x)
        net.fc.bias[4] += kink + offset - pre[1, 4]
    return net, x


def _gradients(net, x, allowance: bool = False):
    params = dict(net.named_parameters())
    with KinkAllowance(params) as kinks:
        out = net(x)
        loss = (out ** 2).sum() / 2 + out.sum()
    loss.backward(retain_graph=True)
    grads = {n: p.grad.detach().clone() for n, p in params.items()}
    return grads, (kinks.allowance() if allowance else None), kinks


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_allowance_is_the_flipped_elements_share(name):
    act, kink, jump = ACTIVATIONS[name]
    above, allowance, kinks = _gradients(*_net(act, kink, +1e-12), allowance=True)
    below, _, _ = _gradients(*_net(act, kink, -1e-12))
    found = kinks.undecided()
    assert len(found) == 1 and found[0][2] == 1 * 7 + 4   # sample 1, unit 4 of the (4, 7) pre-activation
    assert found[0][3] == pytest.approx(jump)
    for n in above:
        flip = float(torch.linalg.vector_norm(above[n] - below[n]))
        # moving the element by 2e-12 changes the rest by ~1e-12 of the gradients
        assert allowance[n] == pytest.approx(flip, rel=1e-6, abs=1e-9), n
    assert allowance["fc.bias"] > 0 and allowance["head.bias"] == 0.0  # the head is above the kink


def test_elements_away_from_a_kink_are_decided():
    """Offsets beyond KINK_ULPS ulps of the tensor's largest magnitude: nothing undecided."""
    net, x = _net(nn.ReLU(), 0.0, 0.0)
    with torch.no_grad():
        largest = float(net.fc(x).abs().max())
    for offset in (2 * KINK_ULPS * np.finfo(np.float32).eps * largest, 0.1):
        _, allowance, kinks = _gradients(*_net(nn.ReLU(), 0.0, offset), allowance=True)
        assert kinks.undecided() == [] and set(allowance.values()) == {0.0}


def test_an_element_exactly_at_the_kink_is_decided_by_convention():
    """A pre-activation of exactly 0 is exact in any precision: torch's derivative there is the
    reference, nothing is allowed for it."""
    net, x = _net(nn.ReLU(), 0.0, 0.0)
    with torch.no_grad():  # small integers and eighths: the dot product is exact in any summation order
        x[1] = x[1].round()
        net.fc.weight[4] = (net.fc.weight[4] * 8).round() / 8
        net.fc.bias[4] = -(x[1] * net.fc.weight[4]).sum()
        assert float(net.fc(x)[1, 4]) == 0.0
    _, allowance, kinks = _gradients(net, x, allowance=True)
    assert kinks.undecided() == [] and set(allowance.values()) == {0.0}


def test_compare_gradients_allows_exactly_a_flip():
    """A float32 engine that put the element on the other side passes with the allowance and
    fails without it; twice the flip fails either way."""
    net, x = _net(nn.ReLU(), 0.0, 1e-12)
    names = [n for n, _ in net.named_parameters()]
    with ReductionBounds(net, names) as rb:
        want, allowance, _ = _gradients(net, x, allowance=True)
    bounds = rb.bounds()
    other, _, _ = _gradients(*_net(nn.ReLU(), 0.0, -1e-12))
    want = {n: g.numpy() for n, g in want.items()}
    flipped = {n: g.numpy() for n, g in other.items()}
    doubled = {n: 2 * flipped[n] - want[n] for n in want}
    assert all(d.passed for d in compare_gradients(flipped, want, bounds, allowance=allowance))
    assert not all(d.passed for d in compare_gradients(flipped, want, bounds))
    assert not all(d.passed for d in compare_gradients(doubled, want, bounds, allowance=allowance))
