"""torch module -> ONNX ModelProto ready for ONNX Runtime's artifact generator.

Uses the TorchScript-based exporter (``dynamo=False``) in EVAL mode with a dynamic batch axis and
no constant folding (folding would bake trainable parameters into constants). Afterwards:

* initializers the exporter merged because their values were equal (a fresh BatchNorm's
  ``weight`` and ``running_var`` are both ones) are restored under their own names;
* channel-split tensors get readable names: ``<param>.trained``, ``<param>.frozen``,
  ``<param>.index``.

An op that the exporter or ONNX Runtime's gradient builder cannot handle raises
:class:`UnsupportedOpError` naming the op and the module path it comes from.
"""

from __future__ import annotations

import io
import logging
import re
import warnings

import numpy as np
import onnx
import torch
from onnx import numpy_helper
from torch import nn

from ..bundle import ParameterEntry

__all__ = ["UnsupportedOpError", "OPSET", "MAX_IR_VERSION", "to_onnx", "module_of_node", "split_names"]

log = logging.getLogger(__name__)

OPSET = 17
MAX_IR_VERSION = 10  # ONNX Runtime 1.19.2 loads IR <= 10


class UnsupportedOpError(ValueError):
    """An op in the model cannot be exported or differentiated.

    Attributes:
        op: the op name (``aten::fft_rfft`` or the ONNX op type).
        modules: module paths where it occurs (``<root>`` for the top-level forward).
    """

    def __init__(self, op: str, modules: list[str], stage: str):
        self.op, self.modules = op, modules
        where = ", ".join(modules) if modules else "an unknown module"
        super().__init__(
            f"unsupported op {op!r} in module {where}: {stage}. Rewrite that module with supported "
            "ops (Conv, Linear, norms, ReLU/ReLU6/GELU, pooling, add, softmax, matmul) or freeze "
            "everything before it so no gradient has to flow through it"
        )


def _module_from_scope(scope: str) -> str:
    # TorchScript scopes look like "__module.blocks/__module.blocks.0/__module.blocks.0.conv"
    last = scope.split("/")[-1] if scope else ""
    return last.removeprefix("__module.") or "<root>"


def _modules_using_aten_op(model: nn.Module, example: torch.Tensor, op: str) -> list[str]:
    base = op.removeprefix("aten::")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = torch.jit.trace(model, (example,), check_trace=False).inlined_graph
    found = []
    for node in graph.nodes():
        kind = node.kind().removeprefix("aten::")
        if kind == base or kind.endswith("_" + base) or base.endswith("_" + kind):
            path = _module_from_scope(node.scopeName())
            if path not in found:
                found.append(path)
    return found


def module_of_node(node_name: str) -> str:
    """Module path from an exported node name.

    The exporter names nodes by the chain of full module paths: ``/blocks/blocks.0/blocks.0.conv/Conv``
    -> ``blocks.0.conv``; a node of the top-level forward is ``/Atan`` -> ``<root>``.
    """
    parts = [p for p in node_name.split("/") if p]
    return parts[-2] if len(parts) >= 2 else "<root>"


def split_names(param_name: str) -> dict[str, str]:
    """Graph names of the slices of a channel-split parameter."""
    return {"trained": f"{param_name}.trained", "frozen": f"{param_name}.frozen", "index": f"{param_name}.index"}


def _restore_merged_initializers(model: onnx.ModelProto, values: dict[str, torch.Tensor]) -> int:
    inits = {i.name for i in model.graph.initializer}
    restored = 0
    keep = []
    for node in model.graph.node:
        out = node.output[0] if node.output else None
        if node.op_type == "Identity" and out in values and out not in inits and node.input[0] in inits:
            model.graph.initializer.append(numpy_helper.from_array(values[out].detach().cpu().numpy(), out))
            inits.add(out)
            restored += 1
        else:
            keep.append(node)
    if restored:
        del model.graph.node[:]
        model.graph.node.extend(keep)
        used = {i for n in model.graph.node for i in n.input}
        unused = [i for i in model.graph.initializer if i.name not in used]
        for i in unused:
            model.graph.initializer.remove(i)
    return restored


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


def _instance_norms_decomposed(model: onnx.ModelProto) -> int:
    """Replace InstanceNormalization by the same arithmetic in ops ONNX Runtime can differentiate.

    ONNX Runtime 1.19.2 registers no gradient for InstanceNormalization, which torch emits for
    ``GroupNorm`` (``Reshape`` to groups around an InstanceNormalization) and ``InstanceNorm1d/2d``.
    Per sample and channel over the spatial axes: ``(x - mean) / sqrt(var + eps) * scale + B`` with
    the biased variance, the definition both torch and ONNX use.
    """
    norms = [n for n in model.graph.node if n.op_type == "InstanceNormalization"]
    if not norms:
        return 0
    inferred = onnx.shape_inference.infer_shapes(model).graph
    ranks = {v.name: len(v.type.tensor_type.shape.dim) for v in (*inferred.value_info, *inferred.input)}
    nodes: list[onnx.NodeProto] = []
    for node in model.graph.node:
        if node.op_type != "InstanceNormalization":
            nodes.append(node)
            continue
        x, scale, bias = node.input
        rank = ranks.get(x)
        if not rank or rank < 3:
            raise UnsupportedOpError(
                "InstanceNormalization", [module_of_node(node.name)],
                "ONNX Runtime has no gradient for it and its input rank is unknown, so it cannot be rewritten")
        axes = list(range(2, rank))
        base, out = node.name, node.output[0]
        eps, shape = f"{out}__eps", f"{out}__affine_shape"
        model.graph.initializer.extend([
            numpy_helper.from_array(np.array(_attr(node, "epsilon", 1e-5), dtype=np.float32), eps),
            numpy_helper.from_array(np.array([1, -1] + [1] * (rank - 2), dtype=np.int64), shape),
        ])
        t = {k: f"{out}__{k}" for k in ("mean", "centred", "square", "var", "var_eps", "std", "normed", "scale", "bias", "scaled")}
        make = onnx.helper.make_node
        nodes += [
            make("ReduceMean", [x], [t["mean"]], name=f"{base}_mean", axes=axes, keepdims=1),
            make("Sub", [x, t["mean"]], [t["centred"]], name=f"{base}_centre"),
            make("Mul", [t["centred"], t["centred"]], [t["square"]], name=f"{base}_square"),
            make("ReduceMean", [t["square"]], [t["var"]], name=f"{base}_var", axes=axes, keepdims=1),
            make("Add", [t["var"], eps], [t["var_eps"]], name=f"{base}_var_eps"),
            make("Sqrt", [t["var_eps"]], [t["std"]], name=f"{base}_std"),
            make("Div", [t["centred"], t["std"]], [t["normed"]], name=f"{base}_normalise"),
            make("Reshape", [scale, shape], [t["scale"]], name=f"{base}_scale_shape"),
            make("Reshape", [bias, shape], [t["bias"]], name=f"{base}_bias_shape"),
            make("Mul", [t["normed"], t["scale"]], [t["scaled"]], name=f"{base}_scale"),
            make("Add", [t["scaled"], t["bias"]], [out], name=f"{base}_shift"),
        ]
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return len(norms)


def _fit_for_ort_gradients(model: onnx.ModelProto) -> None:
    """Rewrite patterns whose gradients ONNX Runtime 1.19.2 gets wrong or cannot build.

    * AveragePool: see :func:`_average_pools_as_convs` (runs first; yields grouped Convs).
    * InstanceNormalization (GroupNorm, InstanceNorm): no gradient registered; see
      :func:`_instance_norms_decomposed`.
    * Grouped Conv (``group > 1``, e.g. depthwise): its ConvGrad kernel overwrites the incoming
      output-gradient buffer. When that buffer is shared (the conv feeds a residual Add, or has
      several consumers) the other branch receives garbage. A ``Mul`` by a ones tensor after the
      conv gives the ConvGrad a private gradient buffer; forward values are unchanged.
    * LayerNormalization exported with only ``Y``: the gradient builder needs the optional
      ``Mean`` and ``InvStdDev`` outputs, so they are declared.
    """
    _average_pools_as_convs(model)
    _instance_norms_decomposed(model)
    nodes = []
    for node in model.graph.node:
        nodes.append(node)
        if node.op_type == "LayerNormalization" and len(node.output) == 1:
            node.output.extend([f"{node.output[0]}__mean", f"{node.output[0]}__inv_std"])
        group = next((a.i for a in node.attribute if a.name == "group"), 1)
        if node.op_type == "Conv" and group > 1:
            out = node.output[0]
            raw, ones = f"{out}__grouped_conv", f"{out}__ones"
            node.output[0] = raw
            rank = _conv_rank(model, node)
            model.graph.initializer.append(numpy_helper.from_array(np.ones([1] * rank, dtype=np.float32), ones))
            nodes.append(onnx.helper.make_node("Mul", [raw, ones], [out], name=f"{node.name}_private_grad"))
    del model.graph.node[:]
    model.graph.node.extend(nodes)


def _conv_rank(model: onnx.ModelProto, node: onnx.NodeProto) -> int:
    kernel = next((list(a.ints) for a in node.attribute if a.name == "kernel_shape"), None)
    if kernel is None:
        raise RuntimeError(f"Conv node {node.name} has no kernel_shape attribute; cannot rewrite it")
    return 2 + len(kernel)


def _rename(model: onnx.ModelProto, old: str, new: str) -> None:
    for init in model.graph.initializer:
        if init.name == old:
            init.name = new
    for node in model.graph.node:
        for k, name in enumerate(node.input):
            if name == old:
                node.input[k] = new


def to_onnx(
    module: nn.Module, example: torch.Tensor, entries: tuple[ParameterEntry, ...],
    input_name: str = "input", output_name: str = "output",
) -> tuple[onnx.ModelProto, tuple[ParameterEntry, ...]]:
    """Export ``module`` (already prepared) and map ``entries`` to the graph's initializer names.

    Returns:
        The ONNX model and the entries with ``onnx_names`` pointing at graph initializers.

    Raises:
        UnsupportedOpError: the exporter has no ONNX form for an op.
        ValueError: the model does not return a single tensor.
    """
    buf = io.BytesIO()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(
                module, (example,), buf, dynamo=False, opset_version=OPSET,
                do_constant_folding=False, training=torch.onnx.TrainingMode.EVAL,
                input_names=[input_name], output_names=[output_name],
                dynamic_axes={input_name: {0: "batch"}, output_name: {0: "batch"}},
            )
    except torch.onnx.errors.UnsupportedOperatorError as e:
        m = re.search(r"operator '([\w:.]+)'", str(e))
        op = m.group(1) if m else "unknown"
        raise UnsupportedOpError(op, _modules_using_aten_op(module, example, op),
                                 f"the ONNX exporter (opset {OPSET}) has no conversion for it") from None
    model = onnx.load_from_string(buf.getvalue())
    if len(model.graph.output) != 1:
        raise ValueError(
            f"the model returns {len(model.graph.output)} outputs; export a module whose forward "
            "returns one tensor (the logits or regression output)"
        )
    values = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    n = _restore_merged_initializers(model, values)
    if n:
        log.debug("restored %d initializers merged by the exporter", n)

    _fit_for_ort_gradients(model)
    mapped = []
    for e in entries:
        if e.is_split:
            names = split_names(e.name)
            for role in ("trained", "frozen", "index"):
                _rename(model, e.onnx_names[role], names[role])
            mapped.append(ParameterEntry(e.name, e.shape, e.mode, names, e.trainable_numel))
        else:
            mapped.append(e)
    inits = {i.name for i in model.graph.initializer}
    final = []
    for e in mapped:
        if all(name in inits for name in e.onnx_names.values()):
            final.append(e)
            continue
        # The forward never reads this parameter (an auxiliary head, a disabled branch).
        if e.trainable_numel:
            log.warning("parameter %s is not used by the forward pass; it cannot train and is left out", e.name)
        final.append(ParameterEntry(e.name, e.shape, "frozen", {}, 0))
    return model, tuple(final)
