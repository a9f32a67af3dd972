"""Backward ops written as forward ops, for tracing step graphs into standard ONNX.

torch's ONNX exporter (torchlib) has no lowering for ``aten.convolution_backward``; this module
decomposes it into forward convolutions, which ONNX has (``Conv``, ``ConvTranspose``):

* input gradient: the transposed convolution of the output gradient with the same weight,
  stride, padding, dilation and groups; ``output_padding`` restores the input length that a
  stride dropped (the trailing samples no output window reached get gradient zero);
* weight gradient: a convolution of the input with the output gradient as its kernel, batch and
  channel axes exchanged, stride and dilation exchanged (an output-gradient tap ``j`` meets input
  sample ``j * stride + i * dilation``), cut to the kernel's extent. With ``groups`` the group
  axis is folded into the channel axes, so each group's input channels meet only its own output
  gradients (one grouped convolution; depthwise is the case of one channel per group);
* bias gradient: the output gradient summed over batch and spatial axes.

Exact up to summation order (float64: ~1e-14 of torch autograd), 1-D and 2-D (any spatial rank).
"""

from __future__ import annotations

import torch

__all__ = ["convolution_backward", "decompositions"]

aten = torch.ops.aten


def _per_axis(values, n: int) -> list[int]:
    values = list(values)
    return values * n if len(values) == 1 else values


def _input_gradient(grad_out: torch.Tensor, weight: torch.Tensor, stride, padding, dilation, extra, groups: int):
    """The transposed convolution of ``grad_out`` with ``weight``, written as a forward convolution.

    onnxruntime's CPU ``ConvTranspose`` runs ~5x slower than a ``Conv`` of the same arithmetic
    (measured, onnxruntime 1.19.2, 1 thread, 32 x 64 x 256, kernel 5: 149 vs 31 ms). A transposed
    convolution is a convolution of the output gradient with ``stride - 1`` zeros between its
    samples (and ``extra`` trailing zeros), padded by ``dilation * (kernel - 1) - padding``, with
    the kernel flipped and its channel axes exchanged per group. The zeros come from a broadcast
    product with a one-hot constant (no data-dependent sizes). Falls back to the transposed
    convolution where that padding would be negative.
    """
    n_spatial = grad_out.dim() - 2
    kernel = weight.shape[2:]
    pads = [dilation[d] * (kernel[d] - 1) - padding[d] for d in range(n_spatial)]
    if min(pads) < 0:
        return aten.convolution(grad_out, weight, None, stride, padding, dilation, True, extra, groups)
    g = grad_out
    for d in range(n_spatial):
        s, ax = stride[d], 2 + d
        if s == 1:
            continue
        one_hot = torch.zeros([s, *([1] * (n_spatial - d - 1))], dtype=g.dtype)
        one_hot[0] = 1
        g = g.unsqueeze(ax + 1) * one_hot  # (..., L, s, ...): each sample then s - 1 zeros
        shape = list(g.shape)
        g = g.reshape(*shape[:ax], shape[ax] * s, *shape[ax + 2:]).narrow(ax, 0, (shape[ax] - 1) * s + 1 + extra[d])
    c_out, c_in_g = weight.shape[0], weight.shape[1]
    w = weight.reshape(groups, c_out // groups, c_in_g, *kernel).transpose(1, 2)
    w = w.reshape(groups * c_in_g, c_out // groups, *kernel).flip(list(range(2, 2 + n_spatial)))
    return aten.convolution(g, w, None, [1] * n_spatial, pads, dilation, False, [0] * n_spatial, groups)


def convolution_backward(grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias_sizes, stride, padding,
                         dilation, transposed: bool, output_padding, groups: int, output_mask):
    """``aten.convolution_backward`` of a (non-transposed) convolution, in forward convolutions."""
    if transposed:
        raise NotImplementedError("the backward of a transposed convolution is not decomposed")
    n_spatial = x.dim() - 2
    stride, padding, dilation = (_per_axis(v, n_spatial) for v in (stride, padding, dilation))
    kernel = weight.shape[2:]
    grad_input = grad_weight = grad_bias = None
    if output_mask[0]:
        reached = [(grad_out.shape[2 + d] - 1) * stride[d] - 2 * padding[d] + dilation[d] * (kernel[d] - 1) + 1
                   for d in range(n_spatial)]
        extra = [x.shape[2 + d] - reached[d] for d in range(n_spatial)]
        grad_input = _input_gradient(grad_out, weight, stride, padding, dilation, extra, groups)
    if output_mask[1]:
        batch, c_in, c_out = x.shape[0], x.shape[1], grad_out.shape[1]
        c_in_g, c_out_g = c_in // groups, c_out // groups
        spatial = list(range(3, 3 + n_spatial))
        # input -> (c_in_g, groups * batch, *spatial): channels within a group become the batch axis
        xs = x.reshape(batch, groups, c_in_g, *x.shape[2:]).permute(2, 1, 0, *spatial)
        xs = xs.reshape(c_in_g, groups * batch, *x.shape[2:])
        # output gradient -> (groups * c_out_g, batch, *spatial): the kernel of a grouped convolution
        gs = grad_out.reshape(batch, groups, c_out_g, *grad_out.shape[2:]).permute(1, 2, 0, *spatial)
        gs = gs.reshape(groups * c_out_g, batch, *grad_out.shape[2:])
        full = aten.convolution(xs, gs, None, dilation, padding, stride, False, [0] * n_spatial, groups)
        for d in range(n_spatial):
            full = full.narrow(2 + d, 0, kernel[d])
        grad_weight = full.transpose(0, 1)  # (c_out, c_in_g, *kernel)
    if output_mask[2]:
        grad_bias = grad_out.sum([0, *range(2, grad_out.dim())])
    return grad_input, grad_weight, grad_bias


def decompositions() -> dict:
    """The decomposition table for ``make_fx``: torch's core ATen decompositions plus
    :func:`convolution_backward`."""
    from torch._decomp import core_aten_decompositions

    table = dict(core_aten_decompositions())
    table[aten.convolution_backward.default] = convolution_backward
    return table
