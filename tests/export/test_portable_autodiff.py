"""The convolution backward decomposition (export.portable.autodiff_decomp) against torch autograd
in float64: plain, strided, padded, dilated, grouped and depthwise convolutions, 1-D and 2-D.

Tolerance: both sides sum the same products in a different order, so they agree to a few ulps
of float64 times the reduction length (here <= 3 * 13 * 13 * 8 terms): 1e-12 relative."""

from __future__ import annotations

import pytest
import torch

from edgeadapt.export.portable.autodiff_decomp import convolution_backward

CASES = [  # groups, spatial rank, stride, padding, dilation, input length, kernel
    (1, 1, 1, 2, 1, 13, 5), (2, 1, 2, 1, 1, 13, 3), (4, 1, 1, 0, 2, 13, 3), (8, 1, 3, 3, 2, 14, 3),
    (1, 1, 2, 0, 1, 12, 4),  # a stride that leaves trailing samples unreached
    (1, 2, 1, 1, 1, 9, 3), (2, 2, 2, 0, 1, 9, 3), (8, 2, 2, 1, 1, 10, 3), (4, 2, 1, 2, 2, 9, 3),
]


@pytest.mark.parametrize("groups, rank, stride, padding, dilation, length, k", CASES)
def test_matches_autograd_in_float64(groups, rank, stride, padding, dilation, length, k):
    gen = torch.Generator().manual_seed(0)
    c_in, c_out = 8, 16
    x = torch.randn(3, c_in, *[length] * rank, dtype=torch.float64, generator=gen, requires_grad=True)
    w = torch.randn(c_out, c_in // groups, *[k] * rank, dtype=torch.float64, generator=gen, requires_grad=True)
    b = torch.randn(c_out, dtype=torch.float64, generator=gen, requires_grad=True)
    y = torch.convolution(x, w, b, [stride] * rank, [padding] * rank, [dilation] * rank, False, [0] * rank, groups)
    go = torch.randn(y.shape, dtype=torch.float64, generator=gen)
    want = torch.autograd.grad(y, (x, w, b), go)
    got = convolution_backward(go, x.detach(), w.detach(), [c_out], [stride], [padding], [dilation], False, [0],
                               groups, [True, True, True])
    for name, g, t in zip(("input", "weight", "bias"), got, want):
        assert g.shape == t.shape, name
        torch.testing.assert_close(g, t, rtol=1e-12, atol=1e-12 * float(t.abs().max()), msg=name)


def test_only_the_requested_gradients_are_computed():
    x, w = torch.randn(2, 4, 10, dtype=torch.float64), torch.randn(6, 4, 3, dtype=torch.float64)
    go = torch.randn(2, 6, 8, dtype=torch.float64)
    gi, gw, gb = convolution_backward(go, x, w, [6], [1], [0], [1], False, [0], 1, [False, True, False])
    assert gi is None and gb is None and gw.shape == w.shape
