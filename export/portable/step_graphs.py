"""The portable train / eval / statistics graphs: step functions over the ONNX->torch interpreter,
traced with ``make_fx`` (symbolic shapes) and exported with torch's dynamo ONNX exporter.

Every graph takes every parameter the forward reads as an input (``param:<onnx name>``: trained,
frozen, running statistics, channel-split indices), never as a baked-in initializer, so the
executor holds one copy of each. The batch axis of ``data``, ``labels`` and ``weights`` is dynamic.

Loss of the train graph: ``sum_i weights[i] * loss_i`` with ``loss_i`` the per-window loss
(cross entropy; mse / bce-with-logits averaged over the window's other axes; entropy of the
softmax), written out here rather than through torch's loss functions, whose ONNX lowering of
``nll_loss`` fakes ``total_weight = 1`` (a mean loss's gradient comes out batch-size times too
large). With ``weights = 1 / batch`` it is torch's mean loss.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import onnx
import torch
from onnx import numpy_helper

from ...bundle import ParameterEntry
from .autodiff_decomp import decompositions
from .interpret import BatchNormStats, check_supported, run_graph

__all__ = ["OPSET", "PortableGraph", "graph_parameters", "trained_names", "build_step_graphs", "per_window_loss"]

log = logging.getLogger(__name__)

OPSET = 18
# The dynamo exporter writes IR 10 with onnx 1.17; ONNX Runtime 1.19.2 loads <= 10.
MAX_IR_VERSION = 10
MAX_BATCH = 1 << 20


@dataclass(frozen=True)
class PortableGraph:
    """One exported step graph and its interface: ``(role, graph name)`` per input and output, in
    graph order."""

    model: onnx.ModelProto
    inputs: tuple[tuple[str, str], ...]
    outputs: tuple[tuple[str, str], ...]

    def interface(self) -> dict:
        """The manifest's ``portable.graphs`` entry."""
        return {"inputs": [list(p) for p in self.inputs], "outputs": [list(p) for p in self.outputs]}


def trained_names(entries: Sequence[ParameterEntry]) -> list[str]:
    """The graph tensors the optimizer updates: an unsplit trained parameter, or the trained slice
    of a channel-split one."""
    return [e.onnx_names["trained" if e.is_split else "value"] for e in entries if e.trainable_numel]


def graph_parameters(model: onnx.ModelProto, entries: Sequence[ParameterEntry]) -> list[str]:
    """The initializers of ``model`` that become ``param:`` inputs, in initializer order: every
    floating-point one and every one a parameter entry names (a channel-split index)."""
    named = {n for e in entries for n in e.onnx_names.values()}
    out = []
    for init in model.graph.initializer:
        if init.name in named or onnx.helper.tensor_dtype_to_np_dtype(init.data_type).kind == "f":
            out.append(init.name)
    return out


def per_window_loss(loss: str, output: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
    """The loss of each window (shape ``[batch]``), as torch's mean-reduced loss averages it."""
    if loss == "cross_entropy":
        logp = torch.log_softmax(output, -1)
        return -logp.gather(1, labels.unsqueeze(1)).squeeze(1)
    if loss == "entropy":
        return -(torch.softmax(output, -1) * torch.log_softmax(output, -1)).sum(-1)
    if loss == "mse":
        err = (output - labels) ** 2
    elif loss == "bce_with_logits":
        err = torch.clamp(output, min=0) - output * labels + torch.log1p(torch.exp(-output.abs()))
    else:
        raise ValueError(f"unknown loss {loss!r}")
    return err.flatten(1).mean(1) if err.dim() > 1 else err


class _Traced(torch.nn.Module):
    def __init__(self, gm: torch.fx.GraphModule):
        super().__init__()
        self.gm = gm

    def forward(self, *args):
        return self.gm(*args)


def _trace_batch(arrays: Sequence[np.ndarray], batch_axes: Sequence[bool]) -> int:
    """A batch size for tracing that no other dimension has (symbolic tracing gives equal sizes
    one symbol; the batch must stay its own) and that is not 0 or 1 (specialised)."""
    taken = {d for a, b in zip(arrays, batch_axes) for d in (a.shape[1:] if b else a.shape)}
    size = 2
    while size in taken:
        size += 1
    return size


def _resize_batch(a: np.ndarray, n: int) -> np.ndarray:
    reps = -(-n // len(a))
    return np.concatenate([a] * reps)[:n]


def _export(fn: Callable, args: list[np.ndarray], batch_axes: list[bool], what: str) -> onnx.ModelProto:
    """make_fx (symbolic) + torch.onnx.export(dynamo) of ``fn`` with a dynamic batch axis."""
    from torch.export import Dim
    from torch.fx.experimental.proxy_tensor import make_fx

    n = _trace_batch(args, batch_axes)
    tensors = [torch.from_numpy(np.array(_resize_batch(a, n) if b else a)) for a, b in zip(args, batch_axes)]
    gm = make_fx(fn, decomposition_table=decompositions(), tracing_mode="symbolic")(*tensors)
    batch = Dim("batch", min=1, max=MAX_BATCH)
    shapes = tuple({0: batch} if b else None for b in batch_axes)
    program = torch.onnx.export(_Traced(gm).eval(), tuple(tensors), dynamo=True, optimize=False, opset_version=OPSET,
                                dynamic_shapes=(shapes,), verbose=False)
    model = program.model_proto
    _check(model, what)
    return model


def _drop_identities(model: onnx.ModelProto) -> None:
    """Remove ``Identity`` nodes (torch's ``aten.alias``) whose output is not a graph output,
    reading their input instead.

    onnxruntime 1.19.2's basic graph optimizations break some graphs holding them: a node fused
    with a consumer of an Identity's output kept reading that output after the Identity was
    eliminated ("Missing Input: alias_1" when the eval graph of a channel-subset CNN ran)."""
    graph = model.graph
    outputs = {o.name for o in graph.output}
    source: dict[str, str] = {}
    kept = []
    for node in graph.node:
        if node.op_type == "Identity" and node.domain in ("", "ai.onnx") and node.output[0] not in outputs:
            source[node.output[0]] = source.get(node.input[0], node.input[0])
        else:
            kept.append(node)
    for node in kept:
        for i, name in enumerate(node.input):
            node.input[i] = source.get(name, name)
    del graph.node[:]
    graph.node.extend(kept)


def _check(model: onnx.ModelProto, what: str) -> None:
    _drop_identities(model)
    if model.ir_version > MAX_IR_VERSION:
        model.ir_version = MAX_IR_VERSION  # the exporter's IR 10 features only; checked below
    domains = {n.domain for n in model.graph.node} | {o.domain for o in model.opset_import}
    if domains - {"", "ai.onnx"} or len(model.functions):
        raise RuntimeError(f"internal: the portable {what} graph uses ops outside the default ONNX domain: "
                           f"{sorted(domains - {'', 'ai.onnx'})}")
    onnx.checker.check_model(model, full_check=True)


_LOSSES = "__per_window_loss"  # an extra train output while its forward graphs are cut out


def _batch_from_data(graph: PortableGraph) -> None:
    """Read the batch size from ``data`` wherever the traced train graph reads it from
    ``weights`` (symbolic tracing may keep the weights' batch symbol for every batch axis, so a
    reshape in the model's forward, such as a Flatten, would take ``Shape(weights)``): the cut
    forward graphs have no weights input. ``weights`` is 1-D over the batch, so its shape is
    ``data``'s first dimension (``Shape`` with ``end=1``)."""
    from onnx import helper

    names = dict(graph.inputs)
    for node in graph.model.graph.node:
        if node.op_type == "Shape" and node.input[0] == names["weights"]:
            attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            start, end = attrs.get("start", 0), attrs.get("end", 1)
            del node.attribute[:]
            node.input[0] = names["data"]
            node.attribute.extend([helper.make_attribute("start", start), helper.make_attribute("end", end)])


def _without_output(graph: PortableGraph, role: str) -> PortableGraph:
    """``graph`` without its output of ``role`` (the nodes stay: the loss reads them)."""
    model = onnx.ModelProto()
    model.CopyFrom(graph.model)
    index = [r for r, _ in graph.outputs].index(role)
    del model.graph.output[index]
    return PortableGraph(model, graph.inputs, tuple(p for p in graph.outputs if p[0] != role))


def _forward_of(train: PortableGraph, roles: list[str], what: str) -> PortableGraph:
    """The part of the (full) train graph that computes ``roles`` (``loss``: the mean of its
    per-window losses) from the parameters, data and labels: its forward, without weights."""
    from onnx import helper
    from onnx.utils import Extractor

    names = dict(train.outputs)
    inputs = [(r, n) for r, n in train.inputs if r != "weights"]
    wanted = [names[_LOSSES] if r == "loss" else names[r] for r in roles]
    model = Extractor(train.model).extract_model([n for _, n in inputs], wanted)
    mean = f"{names[_LOSSES]}_mean"
    model.graph.node.append(helper.make_node("ReduceMean", [names[_LOSSES]], [mean], keepdims=0, name=mean))
    for i, r in enumerate(roles):
        if r == "loss":
            model.graph.output[i].CopyFrom(helper.make_tensor_value_info(mean, onnx.TensorProto.FLOAT, []))
    model.ir_version = train.model.ir_version
    model.graph.name = what
    _check(model, what)
    outputs = tuple((r, o.name) for r, o in zip(roles, model.graph.output))
    if [i.name for i in model.graph.input] != [n for _, n in inputs]:
        raise RuntimeError(f"internal: the {what} graph cut from the train graph lost inputs")
    return PortableGraph(model, tuple(inputs), outputs)


def build_step_graphs(model: onnx.ModelProto, entries: Sequence[ParameterEntry], loss: str, batchnorm: str,
                      data: np.ndarray, labels: np.ndarray | None) -> dict[str, PortableGraph]:
    """Trace and export the train, eval and (``batchnorm="batch"``) statistics graphs of ``model``.

    Args:
        model: the ONNX model the bundle trains (the suffix after the prefix when features are
            cached): one data input, one output.
        entries: the manifest's parameter entries (onnx_names into ``model``).
        loss: the manifest's loss.
        batchnorm: ``frozen`` or ``batch``.
        data: an example batch of the model's input (values only shape the tracing).
        labels: example labels (``None`` for a label-free loss).

    Returns:
        ``{"portable_train": ..., "portable_eval": ..., ["portable_stats": ...]}``.
    """
    graph = model.graph
    check_supported(graph)
    inits = {i.name: i for i in graph.initializer}
    data_name = next(i.name for i in graph.input if i.name not in inits)
    output_name = graph.output[0].name
    params = graph_parameters(model, entries)
    trained = [n for n in trained_names(entries) if n in inits]
    param_values = [numpy_helper.to_array(inits[n]) for n in params]
    stat_names = [name for node in graph.node if node.op_type == "BatchNormalization"
                  for name in node.input[3:5]] if batchnorm == "batch" else []
    n_p = len(params)
    with_labels = labels is not None

    def forward(values, x, batch_stats: bool):
        inputs = dict(zip(params, values))
        bn = BatchNormStats(batch=batch_stats, updated={})
        out = run_graph(graph, {**inputs, data_name: x}, bn)[output_name]
        return out, [bn.updated[n] for n in stat_names] if batch_stats else []

    def train(*args):
        values = list(args[:n_p])
        variables = {n: values[params.index(n)].detach().requires_grad_(True) for n in trained}
        for n, v in variables.items():
            values[params.index(n)] = v
        x, rest = args[n_p], args[n_p + 1:]
        y = rest[0] if with_labels else None
        weights = rest[-1]
        out, stats = forward(values, x, batchnorm == "batch")
        per_window = per_window_loss(loss, out, y)
        total = (per_window * weights).sum()
        grads = torch.autograd.grad(total, [variables[n] for n in trained], allow_unused=True)
        grads = [torch.zeros_like(variables[n]) if g is None else g for n, g in zip(trained, grads)]
        return (total.detach(), out.detach(), *grads, *stats, per_window.detach())

    def evaluate(*args):
        out, _ = forward(list(args[:n_p]), args[n_p], False)
        y = args[n_p + 1] if with_labels else None
        return per_window_loss(loss, out, y).mean(), out

    data_roles = [("data", data)] + ([("labels", labels)] if with_labels else [])
    param_roles = [f"param:{n}" for n in params]
    weights = np.full(len(data), 1.0 / len(data), dtype=np.float32)
    out: dict[str, PortableGraph] = {}

    def make(role: str, fn: Callable, extra: list[tuple[str, np.ndarray]], outputs: list[str]) -> None:
        arrays = param_values + [a for _, a in data_roles + extra]
        batch_axes = [False] * n_p + [True] * (len(data_roles) + len(extra))
        proto = _export(fn, arrays, batch_axes, role)
        roles_in = param_roles + [r for r, _ in data_roles + extra]
        if len(proto.graph.input) != len(roles_in) or len(proto.graph.output) != len(outputs):
            raise RuntimeError(f"internal: the {role} graph has {len(proto.graph.input)} inputs / "
                               f"{len(proto.graph.output)} outputs, expected {len(roles_in)} / {len(outputs)}")
        out[role] = PortableGraph(proto, tuple(zip(roles_in, (i.name for i in proto.graph.input))),
                                  tuple(zip(outputs, (o.name for o in proto.graph.output))))

    stat_roles = [f"stat:{n}" for n in stat_names]
    make("portable_train", train, [("weights", weights)],
         ["loss", "output", *[f"grad:{n}" for n in trained], *stat_roles, _LOSSES])
    full_train = out["portable_train"]
    _batch_from_data(full_train)
    out["portable_train"] = _without_output(full_train, _LOSSES)
    # The forward of the train graph normalises as the eval graph (frozen statistics) or as the
    # statistics graph (batch statistics): that graph is cut out of it instead of traced again.
    if batchnorm == "batch" and stat_names:
        make("portable_eval", evaluate, [], ["loss", "output"])
        out["portable_stats"] = _forward_of(full_train, [*stat_roles, "loss"], "portable_stats")
    else:
        out["portable_eval"] = _forward_of(full_train, ["loss", "output"], "portable_eval")
    return out
