"""Cut an exported ONNX model in two at the plan's cut: a frozen prefix and a trainable suffix.

The prefix (``input`` -> ``features``) is a plain inference model holding every node that the
cut tensor depends on; the device runs it once per ``adapt`` call and caches its output. The
suffix (``features`` -> ``output``) holds the rest and is what the training artifacts are
generated from, so the training graph contains neither the prefix's forward nor any backward
through it.

A cut is valid when the cut tensor is the only tensor that crosses it: no node after the cut
may read the model input or any other tensor the prefix computes (a skip connection over the
cut), and no parameter that trains may sit in the prefix. Input-free nodes (``Constant``) the
two halves share are copied into both.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import onnx
from onnx import helper

__all__ = ["CutError", "SplitModel", "split_model", "cut_tensor_of_node", "FEATURES_NAME"]

log = logging.getLogger(__name__)

FEATURES_NAME = "features"


class CutError(ValueError):
    """The model cannot be cut at the requested tensor; the message says what crosses the cut."""


@dataclass(frozen=True)
class SplitModel:
    """The two halves of a cut model.

    Attributes:
        prefix: inference model, model input -> ``features``.
        suffix: model ``features`` -> the model's outputs.
        cut_tensor: the tensor name in the original model that became ``features``.
        features_shape: its shape, ``None`` for a symbolic axis (the batch).
    """

    prefix: onnx.ModelProto
    suffix: onnx.ModelProto
    cut_tensor: str
    features_shape: tuple[int | None, ...]


def cut_tensor_of_node(model: onnx.ModelProto, node_name: str) -> str:
    """The (first) output tensor of the node called ``node_name``.

    Raises:
        CutError: no node has that name.
    """
    for node in model.graph.node:
        if node.name == node_name:
            return node.output[0]
    raise CutError(f"the model has no node named {node_name!r}; the plan's cut does not belong to this model")


def _value_info(model: onnx.ModelProto, name: str) -> onnx.ValueInfoProto:
    inferred = onnx.shape_inference.infer_shapes(model)
    for v in (*inferred.graph.value_info, *inferred.graph.output, *inferred.graph.input):
        if v.name == name:
            return v
    raise CutError(f"shape inference gives no type for tensor {name!r}; it cannot be a model boundary")


def _shape_of(v: onnx.ValueInfoProto) -> tuple[int | None, ...]:
    return tuple(d.dim_value if d.HasField("dim_value") else None for d in v.type.tensor_type.shape.dim)


def _ancestors(nodes: list[onnx.NodeProto], tensor: str) -> set[int]:
    producer = {out: i for i, n in enumerate(nodes) for out in n.output if out}
    seen: set[int] = set()
    stack = [tensor]
    while stack:
        t = stack.pop()
        i = producer.get(t)
        if i is None or i in seen:
            continue
        seen.add(i)
        stack.extend(x for x in nodes[i].input if x)
    return seen


def _renamed(node: onnx.NodeProto, old: str, new: str) -> onnx.NodeProto:
    copy = onnx.NodeProto()
    copy.CopyFrom(node)
    for k, name in enumerate(copy.input):
        if name == old:
            copy.input[k] = new
    for k, name in enumerate(copy.output):
        if name == old:
            copy.output[k] = new
    return copy


def _model(source: onnx.ModelProto, graph: onnx.GraphProto) -> onnx.ModelProto:
    model = helper.make_model(graph, opset_imports=list(source.opset_import), producer_name="edgeadapt")
    model.ir_version = source.ir_version
    onnx.checker.check_model(model)
    return model


def split_model(model: onnx.ModelProto, cut_tensor: str, *, trained_initializers: Iterable[str] = (),
                features_name: str = FEATURES_NAME) -> SplitModel:
    """Split ``model`` at ``cut_tensor`` into a prefix and a suffix model.

    Args:
        model: a single-input forward model (initializers included).
        cut_tensor: the tensor that becomes the prefix's output and the suffix's input.
        trained_initializers: initializers that train; none may be read by the prefix.
        features_name: the name of the cut tensor in both halves.

    Raises:
        CutError: the cut tensor is not an intermediate tensor, something else crosses the
            cut (the message names the node and tensor), or a trained parameter is in the prefix.
    """
    g = model.graph
    if len(g.input) != 1:
        raise CutError(f"a model with {len(g.input)} inputs cannot be cut; export a single-input forward")
    input_name = g.input[0].name
    outputs = {o.name for o in g.output}
    if cut_tensor in outputs or cut_tensor == input_name:
        raise CutError(f"the cut tensor {cut_tensor!r} is the model's input or output; nothing to split")
    names = {t for n in g.node for t in (*n.input, *n.output)} | {i.name for i in g.initializer}
    if features_name in names and features_name != cut_tensor:
        raise CutError(f"the model already has a tensor named {features_name!r}; choose another features_name")

    nodes = list(g.node)
    prefix_idx = _ancestors(nodes, cut_tensor)
    if not prefix_idx:
        raise CutError(f"no node produces {cut_tensor!r}")
    inits = {i.name: i for i in g.initializer}
    produced_by = {out: i for i, n in enumerate(nodes) for out in n.output if out}

    # Nodes that do not depend on the model input (constants, parameter-only arithmetic such as a
    # frozen BatchNorm's scale) may be computed on both sides of the cut.
    depends_on_input: set[str] = {input_name}
    for node in nodes:
        if any(t in depends_on_input for t in node.input):
            depends_on_input.update(o for o in node.output if o)
    if cut_tensor not in depends_on_input:
        raise CutError(f"the cut tensor {cut_tensor!r} does not depend on the model input; cut at an activation")
    suffix_idx: list[int] = []
    copied: set[int] = set()
    for i, node in enumerate(nodes):
        if i in prefix_idx:
            continue
        suffix_idx.append(i)
        for t in node.input:
            if not t or t == cut_tensor or t in inits:
                continue
            j = produced_by.get(t)
            if t == input_name or (j is not None and j in prefix_idx):
                if t not in depends_on_input:
                    copied |= _ancestors(nodes, t)
                    continue
                raise CutError(
                    f"cannot cut at {cut_tensor!r}: node {node.name or node.op_type!r} after the cut also reads "
                    f"{t!r} from before it (a connection crosses the cut); cut after the branches join"
                )
    prefix_nodes = [nodes[i] for i in sorted(prefix_idx)]
    suffix_nodes = [nodes[i] for i in sorted(copied)] + [nodes[i] for i in suffix_idx]

    trained = set(trained_initializers)
    in_prefix = trained & {t for n in prefix_nodes for t in n.input}
    if in_prefix:
        raise CutError(f"trained parameters {sorted(in_prefix)} are read before the cut {cut_tensor!r}; "
                       "the prefix must be frozen (cut earlier)")

    features = _value_info(model, cut_tensor)
    if not features.type.tensor_type.HasField("shape"):
        raise CutError(f"the shape of the cut tensor {cut_tensor!r} is unknown to ONNX shape inference (its rank "
                       "depends on computed values); the features cannot be a model output")
    feat_type = onnx.TypeProto()
    feat_type.CopyFrom(features.type)
    feat_vi = helper.make_value_info(features_name, feat_type)

    def used_inits(ns: list[onnx.NodeProto]) -> list[onnx.TensorProto]:
        used = {t for n in ns for t in n.input}
        return [inits[name] for name in inits if name in used]

    prefix_graph = helper.make_graph(
        [_renamed(n, cut_tensor, features_name) for n in prefix_nodes], f"{g.name}_prefix",
        [g.input[0]], [feat_vi], initializer=used_inits(prefix_nodes))
    suffix_graph = helper.make_graph(
        [_renamed(n, cut_tensor, features_name) for n in suffix_nodes], f"{g.name}_suffix",
        [feat_vi], list(g.output), initializer=used_inits(suffix_nodes))
    split = SplitModel(_model(model, prefix_graph), _model(model, suffix_graph), cut_tensor, _shape_of(features))
    log.debug("cut at %s: %d prefix nodes, %d suffix nodes, features %s", cut_tensor, len(prefix_nodes),
              len(suffix_nodes), split.features_shape)
    return split
