"""The gradient tolerance follows each reduction's conditioning (``export/reduction_noise.py``).

* The recorded sums of magnitudes equal a brute-force sum of ``|term|`` for every layer kind.
* A float32 engine that sums every gradient in plain running order (the order with the largest
  rounding, emulated here term by term with ``np.cumsum``) is never refused on random models and
  example batches, numpy- or torch-drawn, with offsets that make the sums cancel; the sweep is
  checked to contain reductions whose terms' magnitudes sum to over 10x the magnitude of their
  sum (where a tolerance relative to the gradient's own norm is too tight).
* Real exports with such batches pass the self-check.
The defects the self-check exists for are still caught: ``test_selfcheck.py``, ``test_grouped_conv.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from edgeadapt.export import UpdatePolicy, export_bundle
from edgeadapt.export.prepare import ChannelSplit, FrozenBatchNorm
from edgeadapt.export.reduction_noise import (
    TERM_ROUNDINGS,
    UNIT_ROUNDOFF,
    ReductionBounds,
)
from edgeadapt.export.selfcheck import compare_gradients

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


def _block(c_in: int, c_out: int, k: int, frozen: bool) -> nn.Sequential:
    bn = nn.BatchNorm1d(c_out)
    with torch.no_grad():  # trained-like statistics and affine values
        bn.weight.uniform_(0.5, 1.5), bn.bias.uniform_(-0.5, 0.5)
        bn.running_mean.uniform_(-0.5, 0.5), bn.running_var.uniform_(0.5, 1.5)
    return nn.Sequential(nn.Conv1d(c_in, c_out, k, padding=k // 2), FrozenBatchNorm(bn) if frozen else bn.eval(),
                         nn.ReLU())


class ResidualNet(nn.Module):
    """Three Conv1d-BatchNorm-ReLU blocks, the last two around a residual, mean over time, head."""

    def __init__(self, c_in: int, width: int, k: int, frozen: bool = False):
        super().__init__()
        self.a = _block(c_in, width, k, frozen)
        self.b, self.c = _block(width, width, k, frozen), _block(width, width, k, frozen)
        self.head = nn.Linear(width, 5)

    def forward(self, x):
        x = self.a(x)
        return self.head((x + self.c(self.b(x))).mean(-1))


def _batch(rng: np.random.Generator, case: int, shape: tuple[int, ...]) -> np.ndarray:
    """numpy-drawn, torch-drawn, and drawn with a large mean or scale (sums that cancel)."""
    kind = case % 4
    if kind == 1:
        return torch.randn(*shape, generator=torch.Generator().manual_seed(case)).numpy()
    x = rng.standard_normal(shape)
    if kind == 2:
        x = x + rng.uniform(3, 30) * rng.choice([-1, 1], size=(1, shape[1], 1))
    elif kind == 3:
        x = x * rng.uniform(0.01, 100)
    return x.astype(np.float32)


def _passes(model: nn.Module, x: np.ndarray, dtype: torch.dtype, record: bool = False):
    """Gradients (and with ``record``: rounding bounds, and each layer's input and output gradient)."""
    model = model.to(dtype)
    model.zero_grad()
    names = [n for n, _ in model.named_parameters()]
    seen = {}

    def keep(module, args, output):
        def on_gradient(dy):
            seen[module] = (args[0].detach(), dy.detach())

        output.register_hook(on_gradient)

    handles = [m.register_forward_hook(keep) for m in model.modules() if record and list(m.parameters(recurse=False))]
    with ReductionBounds(model, names) as bounds:
        out = model(torch.from_numpy(x).to(dtype))
        nn.functional.cross_entropy(out, torch.arange(len(x)) % 5).backward()
    for h in handles:
        h.remove()
    grads = {n: p.grad.detach().double().numpy() for n, p in model.named_parameters()}
    return grads, bounds.bounds(), seen


def _running_sum(terms: np.ndarray) -> np.ndarray:
    """float32 sums over axis 0 in plain running order (``np.sum`` would sum pairwise)."""
    return np.cumsum(terms.astype(np.float32), axis=0, dtype=np.float32)[-1]


def _running_order_gradients(model: nn.Module, seen: dict) -> dict[str, np.ndarray]:
    """Every parameter gradient summed term by term in float32 running order from float32 inputs
    and output gradients (what a kernel without blocking or pairwise sums computes)."""
    out = {}
    for path, m in model.named_modules():
        if m not in seen:
            continue
        x, dy = (t.numpy() for t in seen[m])
        if isinstance(m, nn.Conv1d):
            k, p = m.kernel_size[0], m.padding[0]
            xp = np.pad(x, ((0, 0), (0, 0), (p, p)))
            cols = np.stack([xp[:, :, j:j + x.shape[2]] for j in range(k)], axis=2)  # (b, i, k, t)
            terms = np.einsum("bot,bikt->btoik", dy, cols).reshape(-1, *m.weight.shape)
            out[f"{path}.weight"] = _running_sum(terms)
            out[f"{path}.bias"] = _running_sum(dy.transpose(0, 2, 1).reshape(-1, dy.shape[1]))
        elif isinstance(m, (nn.BatchNorm1d, FrozenBatchNorm)):
            xhat = (x - m.running_mean.numpy()[:, None]) / np.sqrt(m.running_var.numpy()[:, None] + m.eps)
            weighted = (dy * xhat.astype(np.float32)).transpose(0, 2, 1).reshape(-1, dy.shape[1])
            out[f"{path}.weight"] = _running_sum(weighted)
            out[f"{path}.bias"] = _running_sum(dy.transpose(0, 2, 1).reshape(-1, dy.shape[1]))
        elif isinstance(m, nn.Linear):
            out[f"{path}.weight"] = _running_sum(dy[:, :, None] * x[:, None, :])
            out[f"{path}.bias"] = _running_sum(dy)
    return out


def _sweep(n_cases: int, seed: int, max_batch: int, max_length: int) -> float:
    """Random models and batches; asserts none is refused; returns the largest conditioning
    ``sum|terms| / |sum|`` of a gradient tensor (in norm)."""
    rng = np.random.default_rng(seed)
    worst = 0.0
    for case in range(n_cases):
        torch.manual_seed(seed * 1000 + case)
        shape = (int(rng.integers(4, max_batch + 1)), int(rng.integers(2, 9)), int(rng.integers(32, max_length + 1)))
        model = ResidualNet(shape[1], int(rng.choice([8, 16, 32])), int(rng.choice([3, 5, 7])),
                            frozen=bool(case % 2)).eval()
        x = _batch(rng, case, shape)
        g64, bounds, _ = _passes(model, x, torch.float64)
        g32, _, seen = _passes(model, x, torch.float32, record=True)
        got = _running_order_gradients(model, seen)
        assert set(got) == set(g64)
        spread = {n: float(np.linalg.norm(g32[n] - g64[n])) for n in g64}
        failed = [d.describe() for d in compare_gradients(got, g64, bounds, spread=spread) if not d.passed]
        assert not failed, f"case {case} {shape}: {failed[:3]}"
        n_terms = shape[0] * shape[2]
        for n in g64:
            ref = float(np.linalg.norm(g64[n]))
            if ref > 0 and not n.startswith("head"):  # the head sums over the batch alone
                scale = (n_terms + TERM_ROUNDINGS) * UNIT_ROUNDOFF * ref
                worst = max(worst, float(np.linalg.norm(bounds[n])) / scale)
    return worst


def test_running_order_float32_is_never_refused():
    assert _sweep(n_cases=6, seed=0, max_batch=16, max_length=96) > 10.0


@pytest.mark.slow
def test_running_order_float32_is_never_refused_wide_sweep():
    assert _sweep(n_cases=100, seed=1, max_batch=32, max_length=200) > 10.0


@pytest.mark.parametrize("layer", ["conv", "conv-split", "linear", "frozen-bn", "bn-batch", "layernorm", "bare"])
def test_magnitudes_are_the_sums_of_the_terms_magnitudes(layer):
    """Per element: the recorded bound is ``(n + TERM_ROUNDINGS) u sum_i |dy_i a_ij|``, checked
    against the terms written out (``a_ij = dy_i/dp_j`` from a full Jacobian of the layer)."""
    torch.manual_seed(0)
    x = torch.randn(3, 4, 6, dtype=torch.float64) + 2.0
    bn = nn.BatchNorm1d(4).double()
    with torch.no_grad():
        bn.weight.uniform_(-1.5, 1.5), bn.bias.uniform_(-0.5, 0.5)
        bn.running_mean.uniform_(-1, 1), bn.running_var.uniform_(0.5, 2)
    if layer.startswith("conv"):
        layer_m = nn.Conv1d(4, 5, 3, stride=2, padding=1).double()
        if layer == "conv-split":
            torch.nn.utils.parametrize.register_parametrization(layer_m, "weight", ChannelSplit((1, 3), 5), unsafe=True)
    elif layer == "linear":
        layer_m = nn.Linear(6, 5).double()
    elif layer == "frozen-bn":
        layer_m = FrozenBatchNorm(bn).double()
    elif layer == "bn-batch":
        layer_m = bn.train()
    elif layer == "layernorm":
        layer_m = nn.LayerNorm(6).double()
        with torch.no_grad():
            layer_m.weight.uniform_(-1.5, 1.5)
    else:
        class Bare(nn.Module):
            def __init__(self):
                super().__init__()
                self.pos = nn.Parameter(torch.randn(1, 4, 6, dtype=torch.float64))

            def forward(self, z):
                return z + self.pos

        layer_m = Bare()
    model = nn.Sequential(layer_m, nn.Tanh())
    names = [n for n, _ in model.named_parameters()]
    with ReductionBounds(model, names) as recorded:
        y = model(x)
        (y * torch.linspace(-1, 1, y.numel(), dtype=torch.float64).reshape(y.shape)).sum().backward()
    bounds = recorded.bounds()
    # the terms written out: dy at the layer's output times the Jacobian of the output w.r.t. each parameter
    out = layer_m(x)
    dy = torch.autograd.grad((torch.tanh(out) * torch.linspace(-1, 1, out.numel(), dtype=torch.float64)
                              .reshape(out.shape)).sum(), out)[0].reshape(-1)
    params = dict(model.named_parameters())
    for n in names:
        local = n.split(".", 1)[1]
        jac = torch.autograd.functional.jacobian(
            lambda p, local=local: torch.func.functional_call(layer_m, {local: p}, (x,)).reshape(-1),
            params[n].detach())
        terms = (dy[:, None] * jac.reshape(dy.numel(), -1)).abs()
        if layer == "bare":  # decomposed over the batch only: sum_b |sum over the sample's terms|
            want = (dy.reshape(3, -1)[:, :, None] * jac.reshape(3, dy.numel() // 3, -1)).sum(1).abs().sum(0)
            count = torch.full_like(want, float(dy.numel()))
        else:
            want = terms.sum(0)
            count = (jac.reshape(dy.numel(), -1) != 0).sum(0).double()
            if layer == "bn-batch" and local == "bias":
                count = torch.full_like(want, float(x.numel() // x.shape[1]))
        expected = ((count + TERM_ROUNDINGS) * UNIT_ROUNDOFF * want).reshape(params[n].shape).numpy()
        np.testing.assert_allclose(bounds[n], expected, rtol=1e-9, atol=0, err_msg=n)


@pytest.mark.parametrize("case", [0, 2])
def test_exports_with_cancelling_example_batches_pass_the_self_check(tmp_path, case):
    """A numpy-drawn example batch (case 0) and one with a large mean (case 2), 32 x 4 x 200."""
    torch.manual_seed(case)
    x = _batch(np.random.default_rng(case), case, (32, 4, 200))
    export_bundle(ResidualNet(4, 16, 5).eval(), torch.from_numpy(x), tmp_path / "b", policy=UpdatePolicy.full())
    assert (tmp_path / "b" / "manifest.json").is_file()
