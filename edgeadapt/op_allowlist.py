"""Which ONNX ops each model of a bundle may hold, and bounds on the sizes ops compute from data.

A bundle's graphs run on the device with no time limit: a ``Loop`` without a trip count spins
forever, a ``ConstantOfShape`` whose shape is computed from the input's values allocates
whatever the input says. The exporter never writes either. :func:`check_ops` refuses, per model
role (``training_model``, ``eval_model``, ...):

* any op outside :data:`ALLOWED_OPS` ``[role]``: the ops the exporter emits for that role
  (derived from exports of the reference models under every policy, loss, optimizer and
  BatchNorm mode, the op rewrites of ``edgeadapt.export.op_rewrites`` and the common layers of
  ``tests/export/test_op_rewrites.py``), control flow (:data:`CONTROL_FLOW_OPS`) never among them;
* a size that an op computes from data: the size inputs (:data:`SIZE_INPUTS`) of
  ``ConstantOfShape``, ``Expand``, ``Tile``, ``Range``, ``Pad``, ``OneHot`` and ``Resize`` must be
  constants within :data:`MAX_SIZE_VALUE` (a constant shape at most :data:`MAX_CONSTANT_NUMEL`
  elements, a constant range at most as many steps), or computed from the *shapes* of tensors
  the graph holds (``Shape``/``Size``) through shape arithmetic (:data:`SHAPE_ARITHMETIC_OPS`)
  and such constants - never from a tensor's values. A ``Range`` needs a constant step of at
  least 1 in magnitude unless its bounds are constant.

The table is data: a new kind of bundle model (a new role) adds its entry to
:data:`ALLOWED_OPS`; an op the exporter starts to emit is added to the role's set (a bundle whose
graphs the table refuses does not load, which the export tests that load their bundles catch).
Torch-free: ``onnx`` and numpy only.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np

from .bundle import BundleError

__all__ = [
    "ALLOWED_OPS",
    "CONTROL_FLOW_OPS",
    "SIZE_INPUTS",
    "SHAPE_ARITHMETIC_OPS",
    "MAX_SIZE_VALUE",
    "MAX_CONSTANT_NUMEL",
    "MAX_SHAPE_FACTOR",
    "check_ops",
    "op_key",
    "subgraphs",
]

#: Ops that repeat or branch over subgraphs (or sequences): never in an exported graph.
CONTROL_FLOW_OPS = frozenset({"Loop", "If", "Scan", "SequenceMap", "SequenceConstruct", "SequenceInsert",
                              "SequenceAt", "SequenceEmpty", "SplitToSequence", "ConcatFromSequence"})

_MS = "com.microsoft::"


def _ms(*names: str) -> frozenset[str]:
    return frozenset(_MS + n for n in names)


#: Standard ops of the forward graphs (the exported model, before and after the op rewrites):
#: layers torch.onnx writes for the reference models and the common layers, plus the ops the
#: graph IR knows have no gradient (they may stay in a frozen part: ``op_rewrites.NO_GRADIENT_OPS``).
FORWARD_OPS = frozenset({
    "Abs", "Add", "And", "BatchNormalization", "Cast", "Ceil", "Clip", "Concat", "Constant", "ConstantOfShape",
    "Conv", "Cos", "CumSum", "Div", "Dropout", "Einsum", "Equal", "Erf", "Exp", "Expand", "Flatten", "Floor",
    "Gather", "Gemm", "GlobalAveragePool", "GlobalMaxPool", "Greater", "GreaterOrEqual", "Identity",
    "LayerNormalization", "LeakyRelu", "Less", "LessOrEqual", "Log", "LogSoftmax", "MatMul", "Max", "MaxPool",
    "Mean", "Min", "Mod", "Mul", "Neg", "Not", "Or", "Pad", "Pow", "PRelu", "Range", "Reciprocal", "ReduceL2",
    "ReduceLogSumExp", "ReduceMax", "ReduceMean", "ReduceMin", "ReduceProd", "ReduceSum", "Relu", "Reshape",
    "Resize", "Round", "Selu", "Celu", "Shape", "Sigmoid", "Sign", "Sin", "Size", "Slice", "Softmax", "Softsign",
    "Split", "Sqrt", "Squeeze", "Sub", "Sum", "Tanh", "Tile", "Transpose", "Unsqueeze", "Where",
    "Det", "Hardmax", "LpNormalization", "ThresholdedRelu", "Tan", "Asin", "Acos", "Atan", "Sinh", "Cosh",
    "GRU", "LSTM", "RNN",  # torch.nn.GRU / LSTM / RNN
})

#: What ONNX Runtime's training artifacts add to the training graph: its loss blocks, gradient
#: kernels and accumulators (``com.microsoft``), and standard ops its gradient builder writes.
ORT_TRAINING_OPS = FORWARD_OPS | {"SoftmaxCrossEntropyLoss"} | _ms(
    "BatchNormInternal", "BatchNormalizationGrad", "ConcatTraining", "ConvGrad", "DivGrad", "FusedMatMul",
    "GatherGrad", "Gelu", "GeluGrad", "FastGelu", "FastGeluGrad", "InPlaceAccumulatorV2", "LayerNormalizationGrad",
    "LeakyReluGrad", "LogSoftmaxGrad_13", "MaxPoolGrad", "QuickGelu", "QuickGeluGrad", "ReluGrad", "Scale",
    "SigmoidGrad", "SliceGrad", "SoftmaxCrossEntropyLossGrad", "SoftmaxCrossEntropyLossInternal",
    "SoftmaxCrossEntropyLossInternalGrad", "SoftmaxGrad_13", "SplitTraining", "TanhGrad", "DropoutGrad",
    "BitmaskDropout", "BitmaskDropoutGrad", "AveragePoolGrad", "ReduceSumTraining", "BroadcastGradientArgs",
    "GRUTraining", "GRUGrad", "LSTMTraining", "LSTMGrad",
) | {"MaxPoolGrad"}  # ONNX Runtime registers MaxPoolGrad in the standard domain

#: Standard ops of the portable step graphs (forward, backward and optimizer update written from
#: the torch joint graph with torch.onnx's dynamo exporter) beyond the forward ops.
PORTABLE_OPS = FORWARD_OPS | {
    "CastLike", "ConvTranspose", "Gemm", "ScatterElements", "ScatterND", "GatherElements", "GatherND", "OneHot",
    "Softmax",
    "SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss", "ReduceSumSquare", "IsNaN", "IsInf", "Xor",
    "BitShift", "ArgMax", "ArgMin", "Trilu", "AveragePool", "InstanceNormalization", "Elu", "Softplus",
    "HardSigmoid", "HardSwish", "Gelu", "Mish", "GroupNormalization", "Erf", "Sqrt", "Log", "Exp",
}

#: Op type (``domain::op`` outside the standard domain) allowed in each model role of a bundle.
ALLOWED_OPS: dict[str, frozenset[str]] = {
    "training_model": frozenset(ORT_TRAINING_OPS),
    "eval_model": frozenset(FORWARD_OPS | {"SoftmaxCrossEntropyLoss"}),
    "prefix_model": FORWARD_OPS,
    "optimizer_model": _ms("AdamWOptimizer", "SGDOptimizerV2") | {"Identity", "Constant", "Add", "Mul", "Sub",
                                                                  "Div", "Sqrt", "Pow", "Cast"},
    "portable_train": frozenset(PORTABLE_OPS),
    "portable_eval": frozenset(PORTABLE_OPS),
    "portable_stats": frozenset(PORTABLE_OPS),
    "portable_optimizer": frozenset(PORTABLE_OPS),
}

#: Inputs that set the size of an op's output (by position).
SIZE_INPUTS: dict[str, tuple[int, ...]] = {
    "ConstantOfShape": (0,), "Expand": (1,), "Tile": (1,), "Range": (0, 1, 2), "Pad": (1,), "OneHot": (1,),
    "Resize": (2, 3), "Upsample": (1,),
}
#: Ops through which a size may be computed from ``Shape``/``Size`` outputs and constants
#: (``ConstantOfShape``: its fill value is checked like a constant; ``Mul``: only by a constant of
#: at most :data:`MAX_SHAPE_FACTOR`, as torch writes for ``F.pad``).
SHAPE_ARITHMETIC_OPS = frozenset({"Shape", "Size", "Gather", "Slice", "Concat", "ConcatTraining", "Unsqueeze",
                                  "Squeeze", "Reshape", "Cast", "Identity", "Add", "Sub", "Neg", "Abs", "Max",
                                  "Min", "Div", "Floor", "Ceil", "Constant", "ConstantOfShape", "Mul", "Transpose"})
_SELECTING_OPS = frozenset({"Gather", "Slice", "Reshape", "Squeeze", "Unsqueeze", "Transpose"})
#: Largest constant factor a size may be multiplied by.
MAX_SHAPE_FACTOR = 64
#: Largest magnitude of a constant that a size is computed from.
MAX_SIZE_VALUE = 1 << 24
#: Largest output (elements, or steps of a Range) that constant sizes may give.
MAX_CONSTANT_NUMEL = 1 << 28
# A tensor feeding a size input is a shape vector: refuse bigger ones unread.
_MAX_SIZE_TENSOR_NUMEL = 64


def op_key(node) -> str:
    """``op`` for the standard domain, ``domain::op`` otherwise (the keys of :data:`ALLOWED_OPS`)."""
    return node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}::{node.op_type}"


class _Sizes:
    """The constants and producers of one graph, to tell where a size input comes from."""

    def __init__(self, graph, outer: dict | None = None):
        from onnx import numpy_helper

        self.tensors = dict(outer or {})
        self.tensors.update({t.name: t for t in graph.initializer})
        self.producer = {out: node for node in graph.node for out in node.output if out}
        self.to_array = numpy_helper.to_array

    def constant(self, name: str) -> np.ndarray | None:
        """The value of ``name`` when it is an initializer or a Constant node's output, else None."""
        tensor = self.tensors.get(name)
        node = self.producer.get(name)
        if tensor is None and node is not None and node.op_type in ("Cast", "Identity", "Neg") and node.input:
            value = self.constant(node.input[0])
            return value if value is None or node.op_type != "Neg" else -value
        if tensor is None and node is not None and node.op_type == "Constant":
            for a in node.attribute:
                if a.name == "value":
                    tensor = a.t
                elif a.name in ("value_int", "value_ints", "value_float", "value_floats"):
                    return np.asarray(a.i if a.name == "value_int" else a.ints if a.name == "value_ints"
                                      else a.f if a.name == "value_float" else a.floats, dtype=np.float64)
        if tensor is None:
            return None
        if math.prod(tensor.dims) > _MAX_SIZE_TENSOR_NUMEL:
            raise ValueError(f"the tensor {name!r} of {math.prod(tensor.dims)} elements, not a shape")
        return np.asarray(self.to_array(tensor), dtype=np.float64)

    def data_source(self, name: str, seen: set[str]) -> str | None:
        """What, if anything, makes ``name`` depend on a tensor's values (None: only shapes and
        bounded constants)."""
        if name in seen or not name:
            return None
        seen.add(name)
        value = self.constant(name)
        if value is not None:
            if not np.isfinite(value).all() or np.abs(value).max(initial=0) > MAX_SIZE_VALUE:
                return f"the constant {name!r} ({value.ravel()[:4].tolist()}...), beyond {MAX_SIZE_VALUE}"
            return None
        node = self.producer.get(name)
        if node is None:
            return f"the graph input {name!r}"
        if node.op_type in ("Shape", "Size"):
            return None
        if node.op_type not in SHAPE_ARITHMETIC_OPS:
            return f"the values of {node.op_type} node {node.name or name!r}"
        if node.op_type == "ConstantOfShape":
            fill = next((self.to_array(a.t) for a in node.attribute if a.name == "value"), np.zeros(1))
            if not np.isfinite(fill).all() or np.abs(fill).max(initial=0) > MAX_SIZE_VALUE:
                return f"the fill value of ConstantOfShape node {node.name or name!r}"
        if node.op_type == "Mul":
            factors = [self.constant(x) for x in node.input]
            if not any(f is not None and f.size and np.isfinite(f).all() and np.abs(f).max() <= MAX_SHAPE_FACTOR
                       for f in factors):
                return f"Mul node {node.name or name!r}, which multiplies by no constant of at most {MAX_SHAPE_FACTOR}"
        # Indices, axes and target shapes select or arrange values (Slice clamps its sentinel
        # bounds of +-2^63): only the data input carries values into the size.
        for source in node.input[:1] if node.op_type in _SELECTING_OPS else node.input:
            if (found := self.data_source(source, seen)) is not None:
                return found
        return None


def _size_problem(node, sizes: _Sizes) -> str | None:
    """Why ``node``'s output size is not bounded, or None."""
    positions = [i for i in SIZE_INPUTS[node.op_type] if i < len(node.input) and node.input[i]]
    values = {i: sizes.constant(node.input[i]) for i in positions}
    if node.op_type == "Range":
        start, limit, delta = (values.get(i) for i in (0, 1, 2))
        if delta is None or delta.size != 1 or not np.isfinite(delta).all() or delta.item() == 0:
            return "its step is not a non-zero constant"
        if start is not None and limit is not None:
            finite = np.isfinite([start, limit]).all()
            steps = math.ceil((limit.item() - start.item()) / delta.item()) if finite else math.inf
            return None if steps <= MAX_CONSTANT_NUMEL else f"it counts {steps} steps (at most {MAX_CONSTANT_NUMEL})"
        if abs(delta.item()) < 1:
            return f"its bounds come from shapes and its step {delta.item()} is below 1 in magnitude"
    for i in positions:
        value = values[i]
        if value is not None and node.op_type in ("ConstantOfShape", "Expand", "Tile"):
            if not np.isfinite(value).all() or value.size and np.abs(value).max() > MAX_SIZE_VALUE:
                return f"its input {node.input[i]!r} holds {value.ravel()[:4].tolist()}..., beyond {MAX_SIZE_VALUE}"
            if math.prod(int(abs(v)) for v in value.ravel()) > MAX_CONSTANT_NUMEL:
                return f"its input {node.input[i]!r} asks for more than {MAX_CONSTANT_NUMEL} elements"
            continue
        if (source := sizes.data_source(node.input[i], set())) is not None:
            return f"its input {node.input[i]!r} is computed from {source}"
    return None


def subgraphs(graph) -> Iterable:
    """``graph`` and every graph nested in its nodes' attributes, depth first."""
    yield graph
    for node in graph.node:
        for attr in node.attribute:
            if attr.HasField("g"):
                yield from subgraphs(attr.g)
            for g in attr.graphs:
                yield from subgraphs(g)


def check_ops(model, role: str, where: str = "") -> None:
    """Refuse ops outside :data:`ALLOWED_OPS` ``[role]`` and sizes computed from data (see the
    module docstring).

    Args:
        model: an ``onnx.ModelProto``.
        role: its role in the bundle (a key of :data:`ALLOWED_OPS`).
        where: the file, for messages.

    Raises:
        BundleError: naming the file, the node and the op or the size input.
    """
    where = where or role
    allowed = ALLOWED_OPS.get(role)
    if allowed is None:
        raise BundleError(f"{where}: no ops are allowed for a model of role {role!r} (known: {sorted(ALLOWED_OPS)})")
    for graph in subgraphs(model.graph):
        for node in graph.node:
            key = op_key(node)
            if key not in allowed:
                kind = "control flow, which" if node.op_type in CONTROL_FLOW_OPS else "an op"
                raise BundleError(
                    f"{where}: node {node.name or '(unnamed)'!r} is {key}, {kind} the exporter never writes into a "
                    f"{role}; the model was not made by edgeadapt export - re-export the bundle"
                )
        sizes = _Sizes(graph)
        for node in graph.node:
            if node.op_type not in SIZE_INPUTS:
                continue
            try:
                problem = _size_problem(node, sizes)
            except ValueError as e:
                problem = f"it reads {e}"
            if problem is not None:
                raise BundleError(
                    f"{where}: the output size of {node.op_type} node {node.name or '(unnamed)'!r} is not bounded: "
                    f"{problem}; the exporter only writes sizes from tensor shapes and small constants - "
                    "re-export the bundle"
                )
