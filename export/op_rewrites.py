"""Rewrites of the ops ONNX Runtime 1.19.2 cannot differentiate, or differentiates wrongly.

:func:`fit_for_ort_gradients` rewrites an exported model in place into the same arithmetic in
ops whose gradients ONNX Runtime builds correctly (the table :data:`_OP_REWRITES`, AveragePool
and grouped 1-D Conv); :data:`NO_GRADIENT_OPS` is what stays without a gradient, and
:func:`check_grouped_conv_grads` refuses the grouped ConvGrad that no rewrite makes safe.

Over 500 lines: one rewrite table whose entries are short functions sharing :class:`_Rewriter`;
splitting it would separate the table from its entries and the helper from its users.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import onnx
from onnx import numpy_helper

from .unsupported import UnsupportedOpError, module_of_node

__all__ = ["fit_for_ort_gradients", "check_grouped_conv_grads", "lacks_gradient", "NO_GRADIENT_OPS"]

log = logging.getLogger(__name__)


def _attr(node: onnx.NodeProto, name: str, default):
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


def _average_pools_as_convs(model: onnx.ModelProto) -> int:
    """Replace AveragePool by the equivalent depthwise Conv with constant 1/window weights.

    ONNX Runtime 1.19.2's AveragePoolGrad kernel dies with SIGFPE (the whole process), so a
    trainable graph must not contain it. With ``ceil_mode=0`` and zero padding counted in the
    mean (torch's default), average pooling is exactly a grouped convolution.
    """
    pools = [n for n in model.graph.node if n.op_type == "AveragePool"]
    if not pools:
        return 0
    shapes = {v.name: v.type.tensor_type.shape for v in onnx.shape_inference.infer_shapes(model).graph.value_info}
    shapes.update({v.name: v.type.tensor_type.shape for v in model.graph.input})
    for node in pools:
        kernel = list(_attr(node, "kernel_shape", []))
        pads = list(_attr(node, "pads", [0] * 2 * len(kernel)))
        shape = shapes.get(node.input[0])
        channels = shape.dim[1].dim_value if shape is not None and len(shape.dim) > 1 else 0
        if _attr(node, "ceil_mode", 0) or (any(pads) and not _attr(node, "count_include_pad", 0)) or not channels:
            raise UnsupportedOpError(
                "AveragePool", [module_of_node(node.name)],
                "ONNX Runtime 1.19.2 crashes computing its gradient, and this configuration "
                "(ceil_mode, or padding excluded from the mean) has no exact convolution form")
        weight = f"{node.output[0]}__avg_weight"
        window = int(np.prod(kernel))
        model.graph.initializer.append(numpy_helper.from_array(
            np.full([channels, 1, *kernel], 1.0 / window, dtype=np.float32), weight))
        conv = onnx.helper.make_node(
            "Conv", [node.input[0], weight], list(node.output), name=node.name.replace("AveragePool", "AvgConv"),
            kernel_shape=kernel, strides=list(_attr(node, "strides", [1] * len(kernel))), pads=pads,
            group=channels)
        node.CopyFrom(conv)
    return len(pools)


class _Rewriter:
    """Helpers for replacing nodes of one op type: static shapes, constant inputs, new initializers.

    Replacement nodes are named ``<original name>_<step>`` so that :func:`module_of_node` (and the
    memory planner) attribute them to the original node's module.
    """

    def __init__(self, model: onnx.ModelProto):
        self.model = model
        self._shapes: dict[str, list[int | None]] | None = None
        self._producers = {o: n for n in model.graph.node for o in n.output}
        self._inits = {i.name: i for i in model.graph.initializer}

    def shape(self, name: str) -> list[int | None] | None:
        """Dimensions of a tensor after ONNX shape inference (``None`` for an unknown one)."""
        if self._shapes is None:
            inferred = onnx.shape_inference.infer_shapes(self.model).graph
            self._shapes = {
                v.name: [d.dim_value if d.HasField("dim_value") else None for d in v.type.tensor_type.shape.dim]
                for v in (*inferred.value_info, *inferred.input, *inferred.output)
                if v.type.tensor_type.HasField("shape")
            }
        return self._shapes.get(name)

    def static_shape(self, name: str) -> list[int] | None:
        """Dimensions after the batch axis when all are known: ``[None, d1, d2, ...]``, else ``None``."""
        shape = self.shape(name)
        if not shape or any(d is None for d in shape[1:]):
            return None
        return [None, *shape[1:]]

    def const(self, name: str) -> np.ndarray | None:
        """The value of a constant tensor (initializer, Constant node, Concat of constants)."""
        if not name:
            return None
        if name in self._inits:
            return numpy_helper.to_array(self._inits[name])
        node = self._producers.get(name)
        if node is None:
            return None
        if node.op_type == "Constant":
            for a in node.attribute:
                if a.name == "value":
                    return numpy_helper.to_array(a.t)
                if a.name in ("value_float", "value_int", "value_floats", "value_ints"):
                    return np.array(onnx.helper.get_attribute_value(a))
            return None
        if node.op_type == "Concat":
            parts = [self.const(i) for i in node.input]
            if any(p is None for p in parts):
                return None
            return np.concatenate(parts, axis=_attr(node, "axis", 0))
        return None

    def init(self, node: onnx.NodeProto, tag: str, value) -> str:
        """Add an initializer named after ``node``'s output; returns its name."""
        name = f"{node.output[0]}__{tag}"
        self.model.graph.initializer.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    @staticmethod
    def chain(node: onnx.NodeProto, steps: list[tuple]) -> list[onnx.NodeProto]:
        """Nodes for ``steps`` of ``(op_type, inputs, tag, attributes)``; ``"@k"`` in inputs names the
        output of step ``k``; the last step writes ``node``'s output."""
        out = node.output[0]
        names = [out if k == len(steps) - 1 else f"{out}__{tag}" for k, (_, _, tag, _) in enumerate(steps)]
        nodes = []
        for (op, inputs, tag, attrs), result in zip(steps, names):
            ins = [names[int(i[1:])] if isinstance(i, str) and i.startswith("@") else i for i in inputs]
            nodes.append(onnx.helper.make_node(op, ins, [result], name=f"{node.name}_{tag}", **attrs))
        return nodes


def _replace(model: onnx.ModelProto, op_type: str, rewrite) -> int:
    """Replace each ``op_type`` node by ``rewrite(rewriter, node)`` (a node list; ``None`` keeps it)."""
    if not any(n.op_type == op_type for n in model.graph.node):
        return 0
    rw = _Rewriter(model)
    nodes: list[onnx.NodeProto] = []
    count = 0
    for node in model.graph.node:
        new = rewrite(rw, node) if node.op_type == op_type else None
        if new is None:
            nodes.append(node)
        else:
            nodes.extend(new)
            count += 1
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return count


def _f32(value: float) -> np.ndarray:
    return np.array(value, dtype=np.float32)


def _instance_norm(rw: _Rewriter, node: onnx.NodeProto) -> list[onnx.NodeProto]:
    """InstanceNormalization (no gradient registered in ONNX Runtime 1.19.2; torch emits it for
    ``GroupNorm``, a ``Reshape`` to groups around it, and ``InstanceNorm1d/2d``) as the same
    arithmetic: per sample and channel over the spatial axes, ``(x - mean) / sqrt(var + eps) *
    scale + B`` with the biased variance, the definition both torch and ONNX use.

    Raises:
        UnsupportedOpError: the input's rank is unknown, so the reduced axes are.
    """
    x, scale, bias = node.input
    shape = rw.shape(x)
    if not shape or len(shape) < 3:
        raise UnsupportedOpError(
            "InstanceNormalization", [module_of_node(node.name)],
            "ONNX Runtime has no gradient for it and its input rank is unknown, so it cannot be rewritten")
    rank = len(shape)
    axes = list(range(2, rank))
    eps = rw.init(node, "eps", _f32(_attr(node, "epsilon", 1e-5)))
    affine_shape = rw.init(node, "affine_shape", np.array([1, -1] + [1] * (rank - 2), dtype=np.int64))
    return rw.chain(node, [
        ("ReduceMean", [x], "mean", {"axes": axes, "keepdims": 1}),
        ("Sub", [x, "@0"], "centre", {}),
        ("Mul", ["@1", "@1"], "square", {}),
        ("ReduceMean", ["@2"], "var", {"axes": axes, "keepdims": 1}),
        ("Add", ["@3", eps], "var_eps", {}),
        ("Sqrt", ["@4"], "std", {}),
        ("Div", ["@1", "@5"], "normalise", {}),
        ("Reshape", [scale, affine_shape], "scale_shape", {}),
        ("Reshape", [bias, affine_shape], "bias_shape", {}),
        ("Mul", ["@6", "@7"], "scale", {}),
        ("Add", ["@9", "@8"], "shift", {}),
    ])


def _elu(rw: _Rewriter, node: onnx.NodeProto) -> list[onnx.NodeProto]:
    """Elu (no gradient in ONNX Runtime 1.19.2) as ``Relu(x) + alpha * (Exp(-Relu(-x)) - 1)``.

    Each branch only sees its own half of the axis (``Exp`` of a non-positive number), so neither
    the values nor the gradients overflow; the gradient is 1 for ``x > 0`` and
    ``alpha * exp(x)`` for ``x < 0``, torch's (at exactly 0 it is 0 here, ``alpha`` in torch).
    """
    x = node.input[0]
    alpha = rw.init(node, "alpha", _f32(_attr(node, "alpha", 1.0)))
    one = rw.init(node, "one", _f32(1.0))
    return rw.chain(node, [
        ("Relu", [x], "pos", {}),
        ("Neg", [x], "negx", {}),
        ("Relu", ["@1"], "neg_relu", {}),
        ("Neg", ["@2"], "neg", {}),
        ("Exp", ["@3"], "exp", {}),
        ("Sub", ["@4", one], "expm1", {}),
        ("Mul", ["@5", alpha], "scaled", {}),
        ("Add", ["@0", "@6"], "elu", {}),
    ])


def _softplus(rw: _Rewriter, node: onnx.NodeProto) -> list[onnx.NodeProto]:
    """Softplus (no gradient) as the overflow-free ``Relu(x) + Log(1 + Exp(-Abs(x)))``.

    torch exports ``softplus(x, beta)`` as ``Softplus(beta * x) / beta``, so ``beta`` is kept; its
    ``threshold`` (linear above ``beta * x > threshold``) is not exported by torch at all: the
    difference is below ``exp(-threshold) / beta`` (2e-9 at the default 20).
    """
    x = node.input[0]
    one = rw.init(node, "one", _f32(1.0))
    return rw.chain(node, [
        ("Relu", [x], "pos", {}),
        ("Abs", [x], "abs", {}),
        ("Neg", ["@1"], "neg_abs", {}),
        ("Exp", ["@2"], "exp", {}),
        ("Add", ["@3", one], "one_plus", {}),
        ("Log", ["@4"], "log", {}),
        ("Add", ["@0", "@5"], "softplus", {}),
    ])


def _hard_sigmoid_steps(rw: _Rewriter, node: onnx.NodeProto, x: str, tag: str) -> list[tuple]:
    alpha, beta = float(_attr(node, "alpha", 0.2)), float(_attr(node, "beta", 0.5))
    if node.op_type == "HardSwish" or (np.float32(alpha) == np.float32(1 / 6) and beta == 0.5):
        # torch's own arithmetic: relu6(x + 3) / 6
        three, zero, six = (rw.init(node, f"{tag}_{k}", _f32(v)) for k, v in (("three", 3), ("zero", 0), ("six", 6)))
        return [("Add", [x, three], f"{tag}_shift", {}), ("Clip", ["@0", zero, six], f"{tag}_clip", {}),
                ("Div", ["@1", six], f"{tag}_div", {})]
    a, b, zero, one = (rw.init(node, f"{tag}_{k}", _f32(v)) for k, v in
                       (("alpha", alpha), ("beta", beta), ("zero", 0), ("one", 1)))
    return [("Mul", [x, a], f"{tag}_scale", {}), ("Add", ["@0", b], f"{tag}_shift", {}),
            ("Clip", ["@1", zero, one], f"{tag}_clip", {})]


def _hard_sigmoid(rw: _Rewriter, node: onnx.NodeProto) -> list[onnx.NodeProto]:
    """HardSigmoid (no gradient) as ``Clip(alpha * x + beta, 0, 1)``; torch's
    ``hardsigmoid`` (alpha 1/6, beta 1/2) as its own ``Clip(x + 3, 0, 6) / 6``."""
    return rw.chain(node, _hard_sigmoid_steps(rw, node, node.input[0], "hsig"))


def _hard_swish(rw: _Rewriter, node: onnx.NodeProto) -> list[onnx.NodeProto]:
    """HardSwish (no gradient) as torch computes it: ``x * Clip(x + 3, 0, 6) / 6``."""
    x = node.input[0]
    six = rw.init(node, "hswish_six", _f32(6.0))
    return rw.chain(node, [
        *_hard_sigmoid_steps(rw, node, x, "hsig")[:2],
        ("Mul", [x, "@1"], "hswish_mul", {}),
        ("Div", ["@2", six], "hswish_div", {}),
    ])


def _reduce_max(rw: _Rewriter, node: onnx.NodeProto) -> list[onnx.NodeProto] | None:
    """ReduceMax / ReduceMin (no gradient) over non-batch axes of static size as a MaxPool.

    The reduced axes are moved last (``Transpose``, when they are not already), flattened into one
    (``Reshape`` to ``(batch, kept, reduced)``), pooled with the whole reduced extent as the
    kernel, and reshaped to the output (``keepdims`` respected). ReduceMin is ``-max(-x)``.
    Values are exact. Ties: MaxPool's gradient goes entirely to the first maximum (in the
    flattened order), torch's ``amax``/``amin`` splits it evenly between tied maxima, and
    ``max(dim)`` gives it to the index it returns; tied maxima of a float input are rare (a row
    of zeros after ReLU, whose gradient is zero either way).
    """
    x = node.input[0]
    shape = rw.static_shape(x)
    axes = _attr(node, "axes", None)
    if shape is None or axes is None or len(shape) < 2:
        return None
    rank = len(shape)
    axes = sorted({a % rank for a in axes})
    if 0 in axes:
        return None
    kept = [a for a in range(1, rank) if a not in axes]
    perm = [0, *kept, *axes]
    n_kept, n_red = int(np.prod([shape[a] for a in kept])), int(np.prod([shape[a] for a in axes]))
    keepdims = _attr(node, "keepdims", 1)
    out_shape = [-1, *(1 if a in axes else shape[a] for a in range(1, rank) if keepdims or a not in axes)]
    flat = rw.init(node, "flat_shape", np.array([-1, n_kept, n_red], dtype=np.int64))
    final = rw.init(node, "out_shape", np.array(out_shape, dtype=np.int64))
    steps: list[tuple] = []
    src = x
    if node.op_type == "ReduceMin":
        steps.append(("Neg", [x], "negate", {}))
        src = "@0"
    if perm != list(range(rank)):
        steps.append(("Transpose", [src], "reduced_last", {"perm": perm}))
        src = f"@{len(steps) - 1}"
    steps += [("Reshape", [src, flat], "flatten", {}),
              ("MaxPool", [f"@{len(steps)}"], "maxpool", {"kernel_shape": [n_red]}),
              ("Reshape", [f"@{len(steps) + 1}", final], "reshape", {})]
    if node.op_type == "ReduceMin":
        steps.append(("Neg", [f"@{len(steps) - 1}"], "min", {}))
    return rw.chain(node, steps)


def _reduce_keepdims(rw: _Rewriter, node: onnx.NodeProto) -> list[onnx.NodeProto] | None:
    """ReduceLogSumExp / ReduceL2 with ``keepdims=0`` as the same reduction with ``keepdims=1`` and
    a ``Squeeze`` of the reduced axes.

    ONNX Runtime 1.19.2's gradient builder emits an opset-11 ``Unsqueeze`` (axes as an attribute)
    for the ``keepdims=0`` case, which the opset-13+ graph rejects; with ``keepdims=1`` its
    gradients (``dy * exp(x - y)``, ``dy * x / y`` masked where ``y == 0``) are right and its
    kernels are the stable ones (the log-sum-exp subtracts the maximum). Same values, same gradient.
    """
    if _attr(node, "keepdims", 1):
        return None
    axes = _attr(node, "axes", None)
    x = node.input[0]
    if axes is None:  # every axis reduced: the result is a scalar
        shape = rw.shape(x)
        if shape is None:
            return None
        axes = list(range(len(shape)))
    squeeze = rw.init(node, "squeeze_axes", np.array(list(axes), dtype=np.int64))
    attrs = {"axes": list(axes), "keepdims": 1}
    return rw.chain(node, [(node.op_type, [x], "keepdims", attrs), ("Squeeze", ["@0", squeeze], "squeeze", {})])


def _gathers(rw: _Rewriter, node: onnx.NodeProto, x: str,
             per_axis: list[tuple[int, list[int]]]) -> list[onnx.NodeProto]:
    steps, src = [], x
    for k, (axis, index) in enumerate(per_axis):
        idx = rw.init(node, f"index_{axis}", np.array(index, dtype=np.int64))
        steps.append(("Gather", [src, idx], f"gather_{axis}", {"axis": axis}))
        src = f"@{k}"
    return rw.chain(node, steps)


def _reversed_slice(rw: _Rewriter, node: onnx.NodeProto) -> list[onnx.NodeProto] | None:
    """Slice with a negative step (torch's ``flip``) as a Gather of the selected indices per axis.

    ONNX Runtime 1.19.2's SliceGrad fails at the train step (``narrowing_error``) on negative
    steps; GatherGrad scatters the gradient back to the same elements.
    """
    x, *rest = node.input
    values = [rw.const(i) if i else None for i in rest] + [None] * (4 - len(rest))
    starts, ends, axes, steps = values
    if starts is None or ends is None or (steps is None or not (steps < 0).any()):
        return None
    shape = rw.static_shape(x)
    if shape is None:
        return None
    rank = len(shape)
    axes = list(range(len(starts))) if axes is None else [int(a) % rank for a in axes]
    if 0 in axes:
        return None
    per_axis = [(a, list(range(*slice(int(s), int(e), int(st)).indices(shape[a]))))
                for a, s, e, st in zip(axes, starts, ends, steps)]
    return _gathers(rw, node, x, per_axis)


def _nearest_source_index(i: int, n_in: int, n_out: int, scale: float, transform: str, rounding: str) -> int:
    """ONNX Resize (nearest): the input index output index ``i`` reads."""
    if transform == "asymmetric":
        c = i / scale
    elif transform == "tf_half_pixel_for_nn":
        c = (i + 0.5) / scale
    elif transform == "pytorch_half_pixel":
        c = (i + 0.5) / scale - 0.5 if n_out > 1 else 0.0
    else:  # half_pixel
        c = (i + 0.5) / scale - 0.5
    if rounding == "floor":
        k = math.floor(c)
    elif rounding == "ceil":
        k = math.ceil(c)
    elif rounding == "round_prefer_ceil":
        k = math.floor(c + 0.5)
    else:  # round_prefer_floor
        k = math.ceil(c - 0.5)
    return min(max(k, 0), n_in - 1)


def _nearest_resize(rw: _Rewriter, node: onnx.NodeProto) -> list[onnx.NodeProto] | None:
    """Nearest-neighbour Resize by integer factors (``F.interpolate(x, scale_factor=k)`` or a
    ``size`` that is a multiple of the input's) as a Gather of the source indices per resized axis.

    ONNX Runtime 1.19.2 has no CPU kernel for ResizeGrad. With integer factors every source index
    is an exact rational, so the index map is the one ONNX Runtime's and torch's kernels compute;
    GatherGrad sums the gradient of the copies. Other modes or factors are left as they are.
    """
    if _attr(node, "mode", b"nearest") not in (b"nearest", "nearest"):
        return None
    transform = _attr(node, "coordinate_transformation_mode", b"half_pixel")
    rounding = _attr(node, "nearest_mode", b"round_prefer_floor")
    transform = transform.decode() if isinstance(transform, bytes) else transform
    rounding = rounding.decode() if isinstance(rounding, bytes) else rounding
    if transform not in ("asymmetric", "half_pixel", "pytorch_half_pixel", "tf_half_pixel_for_nn"):
        return None
    x = node.input[0]
    shape = rw.static_shape(x)
    scales = rw.const(node.input[2]) if len(node.input) > 2 else None
    sizes = rw.const(node.input[3]) if len(node.input) > 3 else None
    if shape is None or (scales is None or scales.size == 0) == (sizes is None or sizes.size == 0):
        return None
    if scales is None or scales.size == 0:
        if any(int(s) % n for s, n in zip(sizes[1:], shape[1:])):
            return None
        scales = np.array([1.0] + [int(s) // n for s, n in zip(sizes[1:], shape[1:])])
    if len(scales) != len(shape) or scales[0] != 1 or any(s < 1 or s != round(s) for s in scales):
        return None
    per_axis = [(a, [_nearest_source_index(i, shape[a], shape[a] * int(s), float(s), transform, rounding)
                     for i in range(shape[a] * int(s))])
                for a, s in enumerate(scales) if a > 0 and s != 1]
    if not per_axis:
        return None
    return _gathers(rw, node, x, per_axis)


#: Op types ONNX Runtime 1.19.2 has no gradient for (none registered, or no CPU kernel for it),
#: left after :func:`fit_for_ort_gradients`: a trained parameter whose gradient flows through
#: one fails the export. Checked against onnxruntime-training 1.19.2 (artifact generation on a
#: MatMul followed by the op). Resize is left only where the rewrite does not apply (linear,
#: cubic, non-integer factors): no ResizeGrad CPU kernel. The graph IR marks ops holding one as
#: not differentiable (:func:`lacks_gradient`), and the planner trains nothing upstream of them.
NO_GRADIENT_OPS = frozenset({
    "CumSum", "Resize", "Round", "Floor", "Ceil", "Sign", "Mod", "Einsum", "Det", "Hardmax",
    "LpNormalization", "PRelu", "Selu", "Celu", "ThresholdedRelu", "Softsign",
    "Tan", "Asin", "Acos", "Atan", "Sinh", "Cosh",
})


def lacks_gradient(node: onnx.NodeProto) -> bool:
    """Whether ONNX Runtime cannot propagate a gradient through ``node`` (after the rewrites)."""
    return node.op_type in NO_GRADIENT_OPS


#: (op type, rewrite) applied in this order by :func:`fit_for_ort_gradients`.
_OP_REWRITES = (
    ("InstanceNormalization", _instance_norm), ("Elu", _elu), ("Softplus", _softplus),
    ("HardSigmoid", _hard_sigmoid), ("HardSwish", _hard_swish),
    ("ReduceMax", _reduce_max), ("ReduceMin", _reduce_max),
    ("ReduceLogSumExp", _reduce_keepdims), ("ReduceL2", _reduce_keepdims),
    ("Slice", _reversed_slice), ("Resize", _nearest_resize),
)


def fit_for_ort_gradients(model: onnx.ModelProto) -> None:
    """Rewrite patterns whose gradients ONNX Runtime 1.19.2 gets wrong or cannot build.

    * AveragePool: see :func:`_average_pools_as_convs` (runs first; yields grouped Convs).
    * InstanceNormalization (GroupNorm, InstanceNorm): no gradient registered; see
      :func:`_instance_norm`.
    * Grouped 1-D Conv (``group > 1``, e.g. depthwise ``Conv1d``): ConvGrad writes past the end of
      its input gradient; the same convolution as a 2-D one, see :func:`_grouped_conv_as_2d`.
      (Grouped 3-D convs stay: :func:`check_grouped_conv_grads` refuses their gradient.)
    * LayerNormalization exported with only ``Y``: the gradient builder needs the optional
      ``Mean`` and ``InvStdDev`` outputs, so they are declared.
    * Elu, Softplus, HardSigmoid, HardSwish (no gradient): the same arithmetic in differentiable
      ops, see :func:`_elu`, :func:`_softplus`, :func:`_hard_sigmoid`, :func:`_hard_swish`.
    * ReduceMax / ReduceMin (no gradient; ``amax``, ``max(dim)``, global max pooling written as a
      reduction): a MaxPool over the reduced axes, see :func:`_reduce_max`.
    * ReduceLogSumExp / ReduceL2 with ``keepdims=0`` (``logsumexp``, ``norm``; the gradient
      builder emits an invalid node): ``keepdims=1`` and a Squeeze, see :func:`_reduce_keepdims`.
    * Slice with a negative step (``flip``; SliceGrad fails at the train step): a Gather of the
      reversed indices, see :func:`_reversed_slice`.
    * Resize, nearest, integer factors (``interpolate``; no ResizeGrad kernel): a Gather of the
      source indices, see :func:`_nearest_resize`.

    What stays unsupported (CumSum, linear Resize, ...; :data:`NO_GRADIENT_OPS`) is reported by
    the artifact generation or the export self-check as :class:`UnsupportedOpError` naming the op
    and module; under a memory budget without a policy the planner avoids it (the graph IR marks
    those ops not differentiable).
    """
    _average_pools_as_convs(model)
    for op_type, rewrite in _OP_REWRITES:
        n = _replace(model, op_type, rewrite)
        if n:
            log.debug("rewrote %d %s node(s) for ONNX Runtime's gradient builder", n, op_type)
    nodes = []
    for node in model.graph.node:
        nodes.append(node)
        if node.op_type == "LayerNormalization" and len(node.output) == 1:
            node.output.extend([f"{node.output[0]}__mean", f"{node.output[0]}__inv_std"])
        if node.op_type == "Conv" and _attr(node, "group", 1) > 1 and _conv_rank(model, node) == 3:
            nodes[-1:] = _grouped_conv_as_2d(model, node)
    del model.graph.node[:]
    model.graph.node.extend(nodes)


def _grouped_conv_as_2d(model: onnx.ModelProto, node: onnx.NodeProto) -> list[onnx.NodeProto]:
    """A grouped 1-D Conv as the same 2-D Conv over a height-1 image: ``Unsqueeze`` of input and
    weight at axis 2, ``Conv`` with kernel ``(1, k)``, ``Squeeze`` back (same output name).

    ONNX Runtime 1.19.2's CPU ConvGrad, for any kernel rank but 2, clears the input gradient of
    each (image, group) with ``Col2imNd`` over ``C * L`` elements from the group's offset instead
    of ``C / group * L``: for the last image it writes ``(C - C / group) * L`` zeros past the end of
    the input-gradient tensor, into whatever ONNX Runtime placed there (another gradient, a saved
    activation, heap metadata: wrong gradients or a crashed process). The 2-D path clears only the
    group's own channels. Forward values and gradients are the same arithmetic.
    """
    out, name = node.output[0], node.name
    axis = f"{out}__axis_h"
    model.graph.initializer.append(numpy_helper.from_array(np.array([2], dtype=np.int64), axis))
    kernel = list(_attr(node, "kernel_shape", []))
    pads = list(_attr(node, "pads", [0, 0]))
    attrs = {"group": _attr(node, "group", 1), "kernel_shape": [1, *kernel],
             "strides": [1, *_attr(node, "strides", [1])], "dilations": [1, *_attr(node, "dilations", [1])]}
    auto_pad = _attr(node, "auto_pad", b"NOTSET")
    auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else auto_pad
    if auto_pad == "NOTSET":
        attrs["pads"] = [0, pads[0], 0, pads[1]]
    else:  # SAME_* / VALID pad nothing on a height-1 axis with a height-1 kernel
        attrs["auto_pad"] = auto_pad
    x, w = f"{out}__x_h", f"{out}__w_h"
    return [
        onnx.helper.make_node("Unsqueeze", [node.input[0], axis], [x], name=f"{name}_x_as_2d"),
        onnx.helper.make_node("Unsqueeze", [node.input[1], axis], [w], name=f"{name}_w_as_2d"),
        onnx.helper.make_node("Conv", [x, w, *node.input[2:]], [f"{out}__2d"], name=name, **attrs),
        onnx.helper.make_node("Squeeze", [f"{out}__2d", axis], [out], name=f"{name}_as_1d"),
    ]


def check_grouped_conv_grads(training: onnx.ModelProto) -> None:
    """Refuse a training graph with a grouped ConvGrad of kernel rank other than 2 that computes
    its input gradient: ONNX Runtime 1.19.2 writes past that tensor's end (see
    :func:`_grouped_conv_as_2d`), which corrupts other tensors or the heap before any check could
    run. 1-D convs were rewritten as 2-D ones; a grouped 3-D conv is what remains.

    Raises:
        UnsupportedOpError: naming the op and the modules of the forward Conv(s).
    """
    forward = {n.name: n for n in training.graph.node if n.op_type == "Conv"}
    modules, ranks = set(), set()
    for node in training.graph.node:
        if node.op_type != "ConvGrad" or _attr(node, "group", 1) <= 1 or not node.output or not node.output[0]:
            continue
        name = node.name.split("_Grad/")[0]
        kernel = _attr(node, "kernel_shape", None) or _attr(forward.get(name, node), "kernel_shape", None)
        if kernel is None or len(kernel) != 2:
            modules.add(module_of_node(name))
            ranks.add("?" if kernel is None else str(len(kernel)))
    if modules:
        raise UnsupportedOpError(
            "Conv", sorted(modules),
            f"ONNX Runtime 1.19.2's ConvGrad writes past the end of the input gradient of a grouped convolution "
            f"with a {'/'.join(sorted(ranks))}-D kernel (Conv3d with groups > 1, 3-D average pooling; the exporter "
            "writes grouped 1-D convs as 2-D ones, the only safe rank)")


def _conv_rank(model: onnx.ModelProto, node: onnx.NodeProto) -> int:
    kernel = next((list(a.ints) for a in node.attribute if a.name == "kernel_shape"), None)
    if kernel is None:
        raise RuntimeError(f"Conv node {node.name} has no kernel_shape attribute; cannot rewrite it")
    return 2 + len(kernel)
