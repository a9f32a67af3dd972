"""ONNX model -> the scheduler's graph IR (:class:`edgeadapt.sched.Graph`).

Shape inference runs with a batch of one, so every byte count is *per window*. Nodes are
fused per module: consecutive nodes of the same module path become one op, so an op is one
``Conv1d``, one ``FrozenBatchNorm`` affine, one ``Linear`` -- the granularity update policies
speak in. Nodes that only transform parameters (a frozen BatchNorm's scale from its running
statistics, a channel split's Concat/Gather) are not ops; the op consuming their result owns the
parameters they read.

Per op:

* ``output_bytes``: the per-window tensors it produces that something outside it reads;
* ``workspace_bytes``: its internal per-window tensors (produced and consumed inside it);
* ``saved_bytes``: what its backward re-reads -- Conv/Gemm/MatMul their inputs, Relu/Sigmoid/
  Tanh/Softmax their output, Mul/Div/Pow and other non-linear ops their inputs, Add/Sub/reshapes
  nothing -- each tensor counted once, at the last op that re-reads it; a GRU or LSTM also every
  step's hidden state and gate activations, which its training form keeps for the backward
  (:func:`recurrent_state_bytes`);
* ``kernel_bytes``: a GRU's or LSTM's kernel buffers while its forward runs (every step's gates:
  :func:`recurrent_kernel_bytes`), which no graph tensor shows;
* ``param_copy_bytes``: the tensors it reads that nodes compute from its parameters (a GRU's or
  LSTM's weights re-ordered per gate, a frozen BatchNorm's scale): not per window;
* ``param_grad_bytes``: what its backward adds for those copies when its parameters train -- the
  gradient of each copy and one transform step's gradient (2 x the copies), and a GRU's or LSTM's
  gradient kernel's weight-sized accumulators (:func:`recurrent_grad_kernel_bytes`);
* ``recurrent_layers``: its ``GRU``/``LSTM`` nodes (each with a fixed cost, ``CostModel.recurrent_layer_bytes``);
* ``flops``: multiply-adds x 2 for Conv/Gemm/MatMul, one per output element otherwise.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from dataclasses import replace
from typing import NamedTuple

import onnx
from onnx import helper, shape_inference

from ..bundle import ParameterEntry
from ..sched.ir import Graph, Op, Param
from .op_rewrites import lacks_gradient

__all__ = ["graph_from_onnx", "module_path_of_node", "recurrent_state_bytes", "recurrent_kernel_bytes",
           "recurrent_grad_kernel_bytes", "SAVES_OUTPUT",
           "SAVES_NOTHING"]

log = logging.getLogger(__name__)

SAVES_OUTPUT = frozenset({"Relu", "Sigmoid", "Tanh", "Softmax", "LogSoftmax", "Sqrt", "Reciprocal", "Exp"})
SAVES_NOTHING = frozenset({
    "Add", "Sub", "Neg", "Identity", "Reshape", "Transpose", "Flatten", "Squeeze", "Unsqueeze", "Concat", "Split",
    "Slice", "Gather", "ReduceMean", "ReduceSum", "GlobalAveragePool", "Pad", "Dropout", "Constant", "Shape",
    "Expand", "Cast", "Tile", "ConstantOfShape",
})
_MATMUL = frozenset({"Conv", "ConvTranspose", "Gemm", "MatMul"})
_CONSTANT_OUTPUT = frozenset({"Shape", "Constant", "ConstantOfShape", "Size"})


def module_path_of_node(node_name: str) -> str:
    """Module path from an exported node name.

    ``/blocks/blocks.0/conv/Conv`` and ``/blocks/blocks.0/blocks.0.conv/Conv`` both give
    ``blocks.0.conv``; a node of the top-level forward (``/ReduceMean``) gives ``<root>``.
    """
    parts = [p for p in node_name.split("/") if p][:-1]
    if not parts:
        return "<root>"
    path = parts[0]
    for part in parts[1:]:
        path = part if part.startswith(path + ".") else f"{path}.{part}"
    return path


def _elem_bytes(elem_type: int) -> int:
    return helper.tensor_dtype_to_np_dtype(elem_type).itemsize


def _tensor_bytes(value_info: dict[str, onnx.ValueInfoProto], name: str) -> int | None:
    vi = value_info.get(name)
    if vi is None or not vi.type.HasField("tensor_type"):
        return None
    tt = vi.type.tensor_type
    dims = []
    for d in tt.shape.dim:
        if not d.HasField("dim_value"):
            return None
        dims.append(d.dim_value)
    return math.prod(dims) * _elem_bytes(tt.elem_type)


def _numel(value_info, name: str) -> int:
    vi = value_info.get(name)
    if vi is None:
        return 0
    return math.prod(d.dim_value for d in vi.type.tensor_type.shape.dim if d.HasField("dim_value"))


# Per step and direction, in units of the hidden size: what a recurrent node's training form keeps
# beyond its inputs for the backward. ONNX Runtime's GRUTraining: every hidden state (1) and the
# update, reset and candidate gates (3); LSTMTraining: every hidden state (1), every cell state (1)
# and the input, output, forget and cell gates (4).
_RECURRENT_KEPT_PER_HIDDEN = {"GRU": 4, "LSTM": 6}
# Per step and direction, in units of the hidden size: the buffers a recurrent node's forward kernel
# allocates beyond its graph output (every hidden state) and frees when it returns. The training
# form (LSTMTraining, GRUTraining: a frozen layer of a training graph runs it too) writes the kept
# tensors above, of which the unread ones are dropped after it (LSTM 5, GRU 3); the inference
# kernel writes every step's gates to a buffer of its own (LSTM 4, GRU 3). The larger of the two.
_RECURRENT_KERNEL_PER_HIDDEN = {"GRU": 3, "LSTM": 5}
# Gates per recurrent node: its weights are ``gates x hidden`` rows.
_RECURRENT_GATES = {"GRU": 3, "LSTM": 4}
# Fixed bytes a trained op's backward adds per byte of its parameter copies: the gradient with
# respect to the copy and one transform step's gradient beside it (a Split of it, or a Concat of
# the pieces) while it is carried back to the parameter.
PARAM_COPY_GRADIENTS = 2


class _RecurrentDims(NamedTuple):
    """A GRU or LSTM node's sizes after shape inference with a batch of one."""

    steps: int  # the input's sequence axis (axis 0, or 1 with ``layout=1``)
    direction: str  # "forward", "reverse" or "bidirectional"
    hidden: int
    inputs: int  # input size per step
    elem_bytes: int

    @property
    def directions(self) -> int:
        return 2 if self.direction == "bidirectional" else 1


def _recurrent_dims(node: onnx.NodeProto, value_info: dict[str, onnx.ValueInfoProto]) -> _RecurrentDims:
    """:class:`_RecurrentDims` of a GRU or LSTM node; refuses a node without a static sequence
    length or hidden size."""
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    hidden = int(attrs.get("hidden_size", 0))
    direction = attrs.get("direction", b"forward")
    direction = direction.decode() if isinstance(direction, bytes) else direction
    vi = value_info.get(node.input[0])
    dims = [d.dim_value for d in vi.type.tensor_type.shape.dim] if vi is not None else []
    axis = 1 if int(attrs.get("layout", 0)) == 1 else 0
    if hidden <= 0 or len(dims) < 3 or dims[axis] <= 0:
        raise ValueError(f"{node.op_type} node {node.name!r} has no static sequence length or hidden_size after "
                         "shape inference; export with a fixed window length")
    return _RecurrentDims(dims[axis], direction, hidden, dims[-1], _elem_bytes(vi.type.tensor_type.elem_type))


def recurrent_state_bytes(node: onnx.NodeProto, value_info: dict[str, onnx.ValueInfoProto]) -> int:
    """Per-window bytes a GRU or LSTM node keeps for its backward beyond its inputs (0 for any other
    node): ``steps x directions x hidden_size x`` the kept tensors per hidden unit
    (:data:`_RECURRENT_KEPT_PER_HIDDEN`), in the input's element size."""
    per_hidden = _RECURRENT_KEPT_PER_HIDDEN.get(node.op_type)
    if per_hidden is None:
        return 0
    d = _recurrent_dims(node, value_info)
    return d.steps * d.directions * d.hidden * per_hidden * d.elem_bytes


def recurrent_kernel_bytes(node: onnx.NodeProto, value_info: dict[str, onnx.ValueInfoProto]) -> int:
    """Per-window bytes a GRU or LSTM node's forward kernel allocates beyond the graph's tensors and
    frees when it returns (0 for any other node): ``steps x directions x hidden_size x``
    :data:`_RECURRENT_KERNEL_PER_HIDDEN`, plus, for a reverse or bidirectional node, the inference
    kernel's reversed copies of the input and of the output (``steps x (input + hidden_size)``)."""
    per_hidden = _RECURRENT_KERNEL_PER_HIDDEN.get(node.op_type)
    if per_hidden is None:
        return 0
    d = _recurrent_dims(node, value_info)
    reversed_copies = d.steps * (d.inputs + d.hidden) if d.direction != "forward" else 0
    return (d.steps * d.directions * d.hidden * per_hidden + reversed_copies) * d.elem_bytes


def recurrent_grad_kernel_bytes(node: onnx.NodeProto, value_info: dict[str, onnx.ValueInfoProto]) -> int:
    """Bytes a GRU or LSTM node's gradient kernel allocates for itself when it runs (0 for any other
    node): ONNX Runtime's GRUGrad and LSTMGrad accumulate each step's weight gradients through
    buffers the size of the input and recurrence weights (``gates x hidden x (input + hidden)`` per
    direction), whatever the number of windows."""
    gates = _RECURRENT_GATES.get(node.op_type)
    if gates is None:
        return 0
    d = _recurrent_dims(node, value_info)
    return d.directions * gates * d.hidden * (d.inputs + d.hidden) * d.elem_bytes


def _with_batch_one(model: onnx.ModelProto, input_shape: Iterable[int]) -> onnx.ModelProto:
    model = onnx.ModelProto.FromString(model.SerializeToString())
    inits = {i.name for i in model.graph.initializer}
    real_inputs = [i for i in model.graph.input if i.name not in inits]
    if len(real_inputs) != 1:
        raise ValueError(f"graph_from_onnx expects one data input, found {[i.name for i in real_inputs]}")
    shape = [1, *list(input_shape)[1:]]
    dims = real_inputs[0].type.tensor_type.shape
    del dims.dim[:]
    for s in shape:
        dims.dim.add().dim_value = int(s)
    for out in model.graph.output:  # let inference fill the output shapes
        out.type.tensor_type.ClearField("shape")
    return shape_inference.infer_shapes(model, strict_mode=False, data_prop=True)


def _flops(node: onnx.NodeProto, vi, inits: dict[str, onnx.TensorProto]) -> int:
    out = _numel(vi, node.output[0]) if node.output else 0
    if node.op_type in ("Conv", "ConvTranspose") and len(node.input) > 1:
        w = vi.get(node.input[1])
        wdims = [d.dim_value for d in w.type.tensor_type.shape.dim] if w is not None else []
        if not wdims and node.input[1] in inits:
            wdims = list(inits[node.input[1]].dims)
        return 2 * out * (math.prod(wdims[1:]) if len(wdims) > 1 else 1)
    if node.op_type in ("Gemm", "MatMul"):
        a = vi.get(node.input[0])
        k = a.type.tensor_type.shape.dim[-1].dim_value if a is not None and a.type.tensor_type.shape.dim else 1
        if node.op_type == "Gemm" and any(at.name == "transA" and at.i for at in node.attribute):
            k = a.type.tensor_type.shape.dim[0].dim_value
        return 2 * out * max(1, k)
    return out


def _param_copy_bytes(nodes, per_window: set[str], inits, depends: dict[str, set[str]], nbytes) -> int:
    """Bytes of the distinct tensors ``nodes`` read that other nodes compute from parameters (not
    the initializers themselves, nor anything per window)."""
    copies = {t for node in nodes for t in node.input
              if t and t not in per_window and t not in inits and depends.get(t)}
    return sum(nbytes(t) for t in copies)


def graph_from_onnx(model_proto: onnx.ModelProto, entries: Iterable[ParameterEntry], input_shape: Iterable[int], *,
                    name: str | None = None, module_types: dict[str, str] | None = None) -> Graph:
    """Build the scheduler graph of an exported model.

    Args:
        model_proto: the inference model from :func:`edgeadapt.export.onnx_export.to_onnx`.
        entries: its parameter entries (``onnx_names`` map graph initializers to source names).
        input_shape: the input's shape; the batch axis is replaced by 1.
        name: the graph's name (plans refer to it); default: the ONNX graph's name.
        module_types: module path -> class name (``{"blocks.0.bn": "FrozenBatchNorm"}``) for
            policy rules restricted by type; default: empty types.

    Returns:
        The graph: ops in execution order, parameters with source names.

    Raises:
        ValueError: a per-window tensor has no static shape after inference (the message names it).
    """
    entries = tuple(entries)
    model = _with_batch_one(model_proto, input_shape)
    g = model.graph
    inits = {i.name: i for i in g.initializer}
    input_name = next(i.name for i in g.input if i.name not in inits)
    vi = {v.name: v for v in (*g.value_info, *g.input, *g.output)}
    for i in g.initializer:
        vi.setdefault(i.name, helper.make_tensor_value_info(i.name, i.data_type, list(i.dims)))
    module_types = module_types or {}

    init_param: dict[str, str] = {}
    for e in entries:
        for onnx_name in e.onnx_names.values():
            init_param[onnx_name] = e.name
    # Which tensors hang off the input (per window), and which parameters each constant depends on.
    per_window = {input_name}
    depends: dict[str, set[str]] = {n: ({init_param[n]} if n in init_param else set()) for n in inits}
    groups: list[dict] = []  # fused ops in execution order
    producer: dict[str, int] = {}  # per-window tensor -> group index
    for node in g.node:
        ins = [t for t in node.input if t]
        if node.op_type not in _CONSTANT_OUTPUT and any(t in per_window for t in ins):
            module = module_path_of_node(node.name)
            if not groups or groups[-1]["module"] != module:
                groups.append({"module": module, "nodes": [], "params": []})
            grp = groups[-1]
            grp["nodes"].append(node)
            for t in ins:
                for p in sorted(depends.get(t, ())):
                    if p not in grp["params"]:
                        grp["params"].append(p)
            for t in node.output:
                if t:
                    per_window.add(t)
                    producer[t] = len(groups) - 1
        else:
            dep = set().union(*(depends.get(t, set()) for t in ins)) if ins else set()
            for t in node.output:
                depends[t] = dep

    consumers: dict[str, set[int]] = {}
    for gi, grp in enumerate(groups):
        for node in grp["nodes"]:
            for t in node.input:
                if t in per_window:
                    consumers.setdefault(t, set()).add(gi)
    graph_outputs = {o.name for o in g.output}

    def nbytes(t: str) -> int:
        b = _tensor_bytes(vi, t)
        if b is None:
            raise ValueError(f"tensor {t!r} has no static shape after ONNX shape inference; "
                             "export with fixed non-batch dimensions")
        return b

    # Saved tensors per group, each attributed to the last group that re-reads it.
    saved_by: dict[str, int] = {}
    state_bytes = [sum(recurrent_state_bytes(n, vi) for n in grp["nodes"]) for grp in groups]
    kernel_bytes = [sum(recurrent_kernel_bytes(n, vi) for n in grp["nodes"]) for grp in groups]
    copy_bytes = [_param_copy_bytes(grp["nodes"], per_window, inits, depends, nbytes) for grp in groups]
    grad_kernel_bytes = [sum(recurrent_grad_kernel_bytes(n, vi) for n in grp["nodes"]) for grp in groups]
    for gi, grp in enumerate(groups):
        for node in grp["nodes"]:
            if node.op_type in SAVES_NOTHING:
                continue
            tensors = [node.output[0]] if node.op_type in SAVES_OUTPUT else [t for t in node.input if t in per_window]
            for t in tensors:
                saved_by[t] = gi

    owned: set[str] = set()
    names_seen: dict[str, int] = {}
    ops: list[Op] = []
    op_names: list[str] = []
    for gi, grp in enumerate(groups):
        produced = {t for node in grp["nodes"] for t in node.output if t in per_window}
        outside = {t for t in produced if t in graph_outputs or (consumers.get(t, set()) - {gi})}
        internal = produced - outside
        srcs: list[int] = []
        for node in grp["nodes"]:
            for t in node.input:
                if t in per_window and t not in produced and t != input_name and producer[t] not in srcs:
                    srcs.append(producer[t])
        params = [p for p in grp["params"] if p not in owned]
        owned.update(params)
        base = grp["module"]
        names_seen[base] = names_seen.get(base, 0) + 1
        op_name = base if names_seen[base] == 1 else f"{base}#{names_seen[base]}"
        op_names.append(op_name)
        main = next((n for n in grp["nodes"] if n.op_type in _MATMUL), grp["nodes"][0])
        ops.append(Op(
            name=op_name, kind=main.op_type, params=tuple(params), inputs=tuple(op_names[s] for s in sorted(srcs)),
            output_bytes=sum(nbytes(t) for t in outside),
            saved_bytes=sum(nbytes(t) for t, owner in saved_by.items() if owner == gi) + state_bytes[gi],
            workspace_bytes=sum(nbytes(t) for t in internal),
            flops=sum(_flops(n, vi, inits) for n in grp["nodes"]),
            module=base,
            differentiable=not any(lacks_gradient(n) for n in grp["nodes"]),
            kernel_bytes=kernel_bytes[gi],
            param_copy_bytes=copy_bytes[gi],
            param_grad_bytes=PARAM_COPY_GRADIENTS * copy_bytes[gi] + grad_kernel_bytes[gi],
            recurrent_layers=sum(n.op_type in _RECURRENT_GATES for n in grp["nodes"]),
        ))
    params = []
    for e in entries:
        if e.name not in owned:
            if e.onnx_names:
                log.debug("parameter %s does not reach a per-window op; left out of the graph", e.name)
            continue
        first = next(iter(e.onnx_names.values()))
        dtype_bytes = _elem_bytes(inits[first].data_type) if first in inits else 4
        module = e.name.rsplit(".", 1)[0] if "." in e.name else ""
        params.append(Param(e.name, tuple(e.shape), dtype_bytes, module, module_types.get(module, "")))
    known = {p.name for p in params}
    ops = [replace(o, params=tuple(p for p in o.params if p in known)) for o in ops]
    return Graph(tuple(ops), tuple(params), nbytes(input_name), name or g.name or "model")


