"""Run an exported ONNX graph with torch ops, so that autograd and ``make_fx`` can trace it.

The portable step graphs are derived from the very ONNX model the ONNX Runtime training
artifacts are generated from (the exported model after op rewrites, or the suffix of its split):
this interpreter runs that model's nodes with one torch function per ONNX op, only for the ops
the exporter emits. Any other op raises :class:`~export.unsupported.UnsupportedOpError` naming the op
and the modules using it.

Shape arithmetic (``Shape`` -> ``Gather`` -> ``Concat`` -> ``Reshape``, integer constants) is
carried out on Python integers (:class:`Ints`), which stay symbolic under ``make_fx``'s symbolic
tracing, so the batch axis stays dynamic in the traced graph.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import onnx
import torch
import torch.nn.functional as F
from onnx import numpy_helper

from ..unsupported import UnsupportedOpError, module_of_node
from .recurrent import gru, lstm

__all__ = ["Ints", "BatchNormStats", "run_graph", "SUPPORTED_OPS", "check_supported"]

# Integer constants up to this many elements are shape-like (kept as Python ints).
_SHAPE_LIKE_NUMEL = 64


@dataclass(frozen=True)
class Ints:
    """An int64 value known while tracing: a scalar (``rank`` 0) or a vector of Python / symbolic
    integers."""

    values: tuple
    rank: int

    def tensor(self) -> torch.Tensor:
        t = torch.tensor([int(v) for v in self.values], dtype=torch.int64)
        return t.reshape(()) if self.rank == 0 else t


@dataclass
class BatchNormStats:
    """How BatchNormalization nodes normalise: with their running statistics (``batch=False``) or
    with the batch's, then recording the new running statistics in ``updated`` (input name ->
    tensor), as ONNX's training-mode BatchNormalization defines them (``momentum`` attribute:
    ``new = running * momentum + batch * (1 - momentum)``; variance: the batch's unbiased variance,
    as torch's BatchNorm and ONNX Runtime's training kernel keep it)."""

    batch: bool = False
    updated: dict | None = None


def _attrs(node: onnx.NodeProto) -> dict:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def _is_int(a) -> bool:
    return isinstance(a, Ints)


def _as_tensor(a, like: torch.Tensor | None = None):
    if isinstance(a, Ints):
        t = a.tensor()
        return t if like is None or not like.is_floating_point() else t.to(like.dtype)
    return a


def _ints(a) -> list:
    """The integer list of a shape-like input (an :class:`Ints` or a constant tensor)."""
    if isinstance(a, Ints):
        return list(a.values)
    return [int(v) for v in a.reshape(-1).tolist()]


def _constant(array: np.ndarray):
    if array.dtype.kind in "iu" and array.ndim <= 1 and array.size <= _SHAPE_LIKE_NUMEL:
        return Ints(tuple(int(v) for v in array.reshape(-1)), array.ndim)
    return torch.from_numpy(array.copy())


def _axis(a: int, rank: int) -> int:
    return a + rank if a < 0 else a


def _elementwise(fn_t: Callable, fn_i: Callable | None = None):
    def op(node, args, attrs):
        if fn_i is not None and all(_is_int(a) for a in args):
            a, b = args
            if a.rank == 0 and b.rank == 0:
                return [Ints((fn_i(a.values[0], b.values[0]),), 0)]
            va = a.values * len(b.values) if a.rank == 0 else a.values
            vb = b.values * len(a.values) if b.rank == 0 else b.values
            return [Ints(tuple(fn_i(x, y) for x, y in zip(va, vb)), 1)]
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        like = tensors[0] if tensors else None
        return [fn_t(*[_as_tensor(a, like) for a in args])]
    return op


def _mod(node, args, attrs):
    # fmod=0: the remainder takes the divisor's sign (Python's %, torch.remainder); fmod=1: C's fmod
    if attrs.get("fmod", 0):
        return _elementwise(torch.fmod, math.fmod)(node, args, attrs)
    return _elementwise(torch.remainder, lambda a, b: a % b)(node, args, attrs)


def _unary(fn: Callable):
    return lambda node, args, attrs: [fn(args[0])]


def _conv_pads(attrs: dict, n_spatial: int, kernel) -> tuple[list[int], list[int] | None]:
    """(symmetric padding, explicit F.pad list or None) of an ONNX Conv/MaxPool."""
    if attrs.get("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET"):
        raise ValueError(f"auto_pad={attrs['auto_pad']!r} is not supported")
    pads = list(attrs.get("pads", [0] * (2 * n_spatial)))
    begin, end = pads[:n_spatial], pads[n_spatial:]
    if begin == end:
        return begin, None
    pad = []
    for b, e in reversed(list(zip(begin, end))):
        pad += [b, e]
    return [0] * n_spatial, pad


def _conv(node, args, attrs):
    x, w = args[0], args[1]
    b = args[2] if len(args) > 2 and args[2] is not None else None
    n = x.dim() - 2
    padding, explicit = _conv_pads(attrs, n, w.shape[2:])
    if explicit is not None:
        x = F.pad(x, explicit)
    stride = list(attrs.get("strides", [1] * n))
    dilation = list(attrs.get("dilations", [1] * n))
    return [torch.convolution(x, w, b, stride, padding, dilation, False, [0] * n, attrs.get("group", 1))]


def _max_pool(node, args, attrs):
    if len(node.output) > 1 and node.output[1]:
        raise ValueError("MaxPool with an indices output is not supported")
    x = args[0]
    n = x.dim() - 2
    kernel = list(attrs["kernel_shape"])
    padding, explicit = _conv_pads(attrs, n, kernel)
    if explicit is not None:
        x = F.pad(x, explicit, value=-math.inf)
    fn = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}[n]
    return [fn(x, kernel, list(attrs.get("strides", [1] * n)), padding, list(attrs.get("dilations", [1] * n)),
               ceil_mode=bool(attrs.get("ceil_mode", 0)))]


def _global_pool(reduce: Callable):
    def op(node, args, attrs):
        x = args[0]
        return [reduce(x, list(range(2, x.dim())))]
    return op


def _gemm(node, args, attrs):
    a, b = args[0], args[1]
    if attrs.get("transA", 0):
        a = a.t()
    if attrs.get("transB", 0):
        b = b.t()
    y = torch.matmul(a, b)
    if attrs.get("alpha", 1.0) != 1.0:
        y = y * attrs["alpha"]
    if len(args) > 2 and args[2] is not None:
        c = args[2]
        y = y + (c * attrs["beta"] if attrs.get("beta", 1.0) != 1.0 else c)
    return [y]


def _reduce_axes(args, attrs, rank: int) -> list[int] | None:
    if len(args) > 1 and args[1] is not None:
        axes = _ints(args[1])
    else:
        axes = attrs.get("axes")
    if not axes:
        return None if attrs.get("noop_with_empty_axes", 0) == 0 else []
    return [_axis(a, rank) for a in axes]


def _reduce(fn: Callable):
    def op(node, args, attrs):
        x = args[0]
        axes = _reduce_axes(args, attrs, x.dim())
        if axes == []:
            return [x]
        if axes is None:
            axes = list(range(x.dim()))
        return [fn(x, axes, bool(attrs.get("keepdims", 1)))]
    return op


def _reshape(node, args, attrs):
    x, shape = args[0], _ints(args[1])
    if _is_int(x):  # shape arithmetic: a scalar <-> a one-element vector, or a vector kept as it is
        if len(shape) > 1 or (not shape and len(x.values) != 1):
            raise ValueError(f"reshaping shape values {x.values} to {shape}")
        return [Ints(x.values, len(shape))]
    if not attrs.get("allowzero", 0):
        shape = [x.shape[i] if s == 0 else s for i, s in enumerate(shape)]
    return [x.reshape(shape)]


def _transpose(node, args, attrs):
    x = args[0]
    perm = attrs.get("perm", list(reversed(range(x.dim()))))
    return [x.permute(*perm)]


def _axes_arg(args, attrs) -> list[int]:
    return _ints(args[1]) if len(args) > 1 and args[1] is not None else list(attrs.get("axes", []))


def _unsqueeze(node, args, attrs):
    x, axes = args[0], _axes_arg(args, attrs)
    if _is_int(x):
        if x.rank != 0 or axes not in ([0], [-1]):
            raise ValueError("Unsqueeze of a shape vector is not supported")
        return [Ints(x.values, 1)]
    rank = x.dim() + len(axes)
    for a in sorted(_axis(a, rank) for a in axes):
        x = x.unsqueeze(a)
    return [x]


def _squeeze(node, args, attrs):
    x, axes = args[0], _axes_arg(args, attrs)
    if _is_int(x):
        if x.rank != 1 or len(x.values) != 1:
            raise ValueError("Squeeze of a shape vector is not supported")
        return [Ints(x.values, 0)]
    if not axes:
        return [x.squeeze()]
    for a in sorted((_axis(a, x.dim()) for a in axes), reverse=True):
        x = x.squeeze(a)
    return [x]


def _concat(node, args, attrs):
    if all(_is_int(a) for a in args):
        return [Ints(tuple(v for a in args for v in a.values), 1)]
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    return [torch.cat([_as_tensor(a, tensors[0]) for a in args], attrs.get("axis", 0))]


def _gather(node, args, attrs):
    data, index = args
    axis = attrs.get("axis", 0)
    if _is_int(data):
        if data.rank != 1 or axis != 0:
            raise ValueError("Gather on a scalar shape value is not supported")
        idx = _ints(index)
        picked = tuple(data.values[i] for i in idx)
        return [Ints(picked, 0 if (_is_int(index) and index.rank == 0) or
                     (isinstance(index, torch.Tensor) and index.dim() == 0) else 1)]
    axis = _axis(axis, data.dim())
    if _is_int(index):
        if index.rank == 0:
            return [data.select(axis, index.values[0])]
        index = index.tensor()
    if index.dim() == 0:
        return [data.select(axis, index)]
    flat = torch.index_select(data, axis, index.reshape(-1))
    return [flat.reshape(*data.shape[:axis], *index.shape, *data.shape[axis + 1:])]


def _slice(node, args, attrs):
    x = args[0]
    starts, ends = _ints(args[1]), _ints(args[2])
    axes = _ints(args[3]) if len(args) > 3 and args[3] is not None else list(range(len(starts)))
    steps = _ints(args[4]) if len(args) > 4 and args[4] is not None else [1] * len(starts)
    if _is_int(x):
        if axes != [0]:
            raise ValueError("Slice of a shape value on an axis other than 0")
        return [Ints(tuple(x.values[slice(starts[0], ends[0], steps[0])]), 1)]
    index = [slice(None)] * x.dim()
    for s, e, a, st in zip(starts, ends, axes, steps):
        if st <= 0:
            raise ValueError("Slice with a non-positive step is not supported (the exporter rewrites flips)")
        a = _axis(a, x.dim())
        index[a] = slice(s, e, st)
    return [x[tuple(index)]]


def _shape(node, args, attrs):
    shape = tuple(args[0].shape)
    start, end = attrs.get("start", 0), attrs.get("end", len(shape))
    return [Ints(shape[start:end], 1)]


def _cast(node, args, attrs):
    to = onnx.helper.tensor_dtype_to_np_dtype(attrs["to"])
    x = args[0]
    if _is_int(x):
        if to.kind in "iu":
            return [x]
        x = x.tensor()
    return [x.to(getattr(torch, np.dtype(to).name))]


def _clip(node, args, attrs):
    x = args[0]
    lo = args[1] if len(args) > 1 else attrs.get("min")
    hi = args[2] if len(args) > 2 else attrs.get("max")
    if isinstance(lo, torch.Tensor):
        x = torch.maximum(x, lo)
    elif lo is not None:
        x = torch.clamp(x, min=lo)
    if isinstance(hi, torch.Tensor):
        x = torch.minimum(x, hi)
    elif hi is not None:
        x = torch.clamp(x, max=hi)
    return [x]


def _softmax(node, args, attrs):
    return [torch.softmax(args[0], attrs.get("axis", -1))]


def _layer_norm(node, args, attrs):
    x, scale = args[0], args[1]
    bias = args[2] if len(args) > 2 else None
    axis = _axis(attrs.get("axis", -1), x.dim())
    eps = attrs.get("epsilon", 1e-5)
    y = F.layer_norm(x, tuple(x.shape[axis:]), scale, bias, eps)
    if not any(o for o in node.output[1:]):
        return [y]
    # the optional outputs (torch's exporter names them even when nothing reads them)
    dims = list(range(axis, x.dim()))
    mean = x.mean(dims, keepdim=True)
    inv_std = torch.rsqrt(((x - mean) ** 2).mean(dims, keepdim=True) + eps)
    return [y, mean, inv_std]


def _prelu(node, args, attrs):
    x, slope = args
    return [torch.where(x < 0, x * slope, x)]


def _where(node, args, attrs):
    c, a, b = args
    tensors = [t for t in (a, b) if isinstance(t, torch.Tensor)]
    return [torch.where(_as_tensor(c), _as_tensor(a, tensors[0] if tensors else None),
                        _as_tensor(b, tensors[0] if tensors else None))]


def _flatten(node, args, attrs):
    x = args[0]
    axis = _axis(attrs.get("axis", 1), x.dim())
    return [x.reshape(math.prod(x.shape[:axis]) if axis else 1, -1)]


def _expand(node, args, attrs):
    x, shape = args[0], _ints(args[1])
    rank = max(x.dim(), len(shape))
    full = [1] * (rank - len(shape)) + shape
    have = [1] * (rank - x.dim()) + list(x.shape)
    return [x.reshape(have).expand([h if s == 1 else s for s, h in zip(full, have)])]


def _constant_of_shape(node, args, attrs):
    value = attrs.get("value")
    fill = np.zeros(1, np.float32) if value is None else numpy_helper.to_array(value).reshape(-1)
    if fill.size != 1:
        raise ValueError(f"value holds {fill.size} elements, not one")
    return [torch.full(_ints(args[0]), fill[0].item(), dtype=torch.from_numpy(fill.copy()).dtype)]


def _reduce_l2(x, axes, keep):
    return torch.sqrt((x * x).sum(axes, keepdim=keep))


OpFn = Callable[[onnx.NodeProto, list, dict], list]
_OPS: dict[str, OpFn] = {
    "Add": _elementwise(torch.add, lambda a, b: a + b),
    "Sub": _elementwise(torch.sub, lambda a, b: a - b),
    "Mul": _elementwise(torch.mul, lambda a, b: a * b),
    "Div": _elementwise(torch.div, lambda a, b: a // b),
    "Pow": _elementwise(torch.pow),
    "Mod": _mod,
    "Max": _elementwise(torch.maximum),
    "Min": _elementwise(torch.minimum),
    "Equal": _elementwise(torch.eq),
    "Less": _elementwise(torch.lt),
    "LessOrEqual": _elementwise(torch.le),
    "Greater": _elementwise(torch.gt),
    "GreaterOrEqual": _elementwise(torch.ge),
    "Where": _where,
    "Not": _unary(torch.logical_not),
    "Abs": _unary(torch.abs),
    "Neg": _unary(torch.neg),
    "Exp": _unary(torch.exp),
    "Log": _unary(torch.log),
    "Sqrt": _unary(torch.sqrt),
    "Reciprocal": _unary(torch.reciprocal),
    "Erf": _unary(torch.erf),
    "Tanh": _unary(torch.tanh),
    "Sigmoid": _unary(torch.sigmoid),
    "Relu": _unary(torch.relu),
    "LeakyRelu": lambda node, args, attrs: [F.leaky_relu(args[0], attrs.get("alpha", 0.01))],
    "PRelu": _prelu,
    "Identity": lambda node, args, attrs: [args[0]],
    "Dropout": lambda node, args, attrs: [args[0]],  # inference form: the exporter exports in eval mode
    "Clip": _clip,
    "Conv": _conv,
    "MaxPool": _max_pool,
    "GlobalAveragePool": _global_pool(lambda x, axes: x.mean(axes, keepdim=True)),
    "GlobalMaxPool": _global_pool(lambda x, axes: x.amax(axes, keepdim=True)),
    "Gemm": _gemm,
    "MatMul": lambda node, args, attrs: [torch.matmul(args[0], args[1])],
    "Softmax": _softmax,
    "LayerNormalization": _layer_norm,
    "ReduceMean": _reduce(lambda x, axes, keep: x.mean(axes, keepdim=keep)),
    "ReduceSum": _reduce(lambda x, axes, keep: x.sum(axes, keepdim=keep)),
    "ReduceL2": _reduce(_reduce_l2),
    "ReduceLogSumExp": _reduce(lambda x, axes, keep: torch.logsumexp(x, axes, keepdim=keep)),
    "ReduceMax": _reduce(lambda x, axes, keep: x.amax(axes, keepdim=keep)),
    "ReduceMin": _reduce(lambda x, axes, keep: x.amin(axes, keepdim=keep)),
    "Reshape": _reshape,
    "Flatten": _flatten,
    "Transpose": _transpose,
    "Squeeze": _squeeze,
    "Unsqueeze": _unsqueeze,
    "Concat": _concat,
    "Gather": _gather,
    "Slice": _slice,
    "Shape": _shape,
    "Cast": _cast,
    "Expand": _expand,
    "ConstantOfShape": _constant_of_shape,
    "GRU": gru,
    "LSTM": lstm,
}
SUPPORTED_OPS = frozenset([*_OPS, "Constant", "BatchNormalization"])


def _batch_norm(node, args, attrs, bn: BatchNormStats):
    x, scale, bias, mean, var = args
    shape = [1, -1] + [1] * (x.dim() - 2)
    eps = attrs.get("epsilon", 1e-5)
    if attrs.get("training_mode", 0) or any(o for o in node.output[1:]):
        raise ValueError("BatchNormalization in training form is not supported (the exporter exports eval form)")
    if bn.batch:
        axes = [0, *range(2, x.dim())]
        batch_mean = x.mean(axes)
        batch_var = ((x - batch_mean.reshape(shape)) ** 2).mean(axes)
        momentum = attrs.get("momentum", 0.9)
        # values per channel, as a tensor computed from x's values only (a symbolic size would
        # become a scalar the ONNX exporter rejects, or a Shape of another graph input)
        count = torch.ones_like(x[:, 0]).sum()
        with torch.no_grad():
            bn.updated[node.input[3]] = mean * momentum + batch_mean.detach() * (1 - momentum)
            bn.updated[node.input[4]] = var * momentum + batch_var.detach() * (count / (count - 1)) * (1 - momentum)
        mean, var = batch_mean, batch_var
    y = (x - mean.reshape(shape)) / torch.sqrt(var.reshape(shape) + eps)
    return [y * scale.reshape(shape) + bias.reshape(shape)]


def check_supported(graph: onnx.GraphProto) -> None:
    """Raise :class:`UnsupportedOpError` for the first op type the interpreter cannot run,
    naming every module that uses it."""
    for node in graph.node:
        if node.op_type not in SUPPORTED_OPS or node.domain not in ("", "ai.onnx"):
            modules = sorted({module_of_node(n.name) for n in graph.node if n.op_type == node.op_type})
            raise UnsupportedOpError(node.op_type, modules, "the portable backend cannot run it")


def run_graph(graph: onnx.GraphProto, inputs: Mapping[str, torch.Tensor], bn: BatchNormStats | None = None
              ) -> dict[str, torch.Tensor]:
    """Run ``graph`` with torch ops.

    Args:
        graph: the ONNX graph (only :data:`SUPPORTED_OPS`).
        inputs: a value for every graph input and for every initializer that is to be a
            variable (parameters); other initializers are constants.
        bn: how BatchNormalization normalises (default: running statistics).

    Returns:
        The graph outputs by name.
    """
    check_supported(graph)
    bn = bn or BatchNormStats()
    env: dict[str, object] = {"": None}
    for init in graph.initializer:
        if init.name not in inputs:
            env[init.name] = _constant(numpy_helper.to_array(init))
    env.update(inputs)
    for node in graph.node:
        attrs = _attrs(node)
        if node.op_type == "Constant":
            if "value" not in attrs:
                raise UnsupportedOpError("Constant", [module_of_node(node.name)], "the portable backend reads only "
                                         "tensor-valued Constant nodes")
            outputs = [_constant(numpy_helper.to_array(attrs["value"]))]
        else:
            args = [env[name] for name in node.input]
            try:
                if node.op_type == "BatchNormalization":
                    outputs = _batch_norm(node, args, attrs, bn)
                else:
                    outputs = _OPS[node.op_type](node, args, attrs)
            except ValueError as e:
                raise UnsupportedOpError(node.op_type, [module_of_node(node.name)],
                                         f"the portable backend cannot run this form of it ({e})") from None
        for name, value in zip(node.output, outputs):
            if name:
                env[name] = value
    return {o.name: _as_tensor(env[o.name]) for o in graph.output}
