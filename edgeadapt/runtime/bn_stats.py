"""Forward-only BatchNorm statistics: the training graph's forward, without backward or optimizer.

A bundle exported with ``batchnorm="batch"`` normalises with batch statistics in its training
graph, where ONNX Runtime turns every BatchNorm into ``com.microsoft.BatchNormInternal``
(``training_mode=1``) whose second and third outputs are the updated running mean and variance.
Re-estimating those statistics on new data (label-free "bn-stats" adaptation) needs only that
forward. :func:`statistics_model` cuts it out of ``training_model.onnx``: the nodes the loss,
the model output and the running-statistics outputs depend on, as an inference model whose
inputs are the data and the parameters. It runs the very nodes (same kernels, same attributes)
a training step runs, so the statistics it yields are bit-identical to a training step's, with no
gradient buffers, no backward pass and no optimizer state.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .inference_export import prune_to_outputs

__all__ = ["StatisticsModel", "statistics_model"]

BN_OP = "BatchNormInternal"


@dataclass(frozen=True)
class StatisticsModel:
    """The forward-only statistics graph (serialised) and what its outputs mean.

    Attributes:
        model_bytes: the ONNX model (empty: nothing to compute).
        loss_output: name of the loss output, or ``None`` when the loss needs labels that
            the caller will not pass.
        updates: ``(graph output, parameter name)`` pairs: running statistic -> the parameter
            it replaces after each batch.
    """

    model_bytes: bytes
    loss_output: str | None
    updates: tuple[tuple[str, str], ...]


def statistics_model(training_model_path: str | os.PathLike, *, label_name: str | None,
                     with_loss: bool) -> StatisticsModel:
    """Build the forward-only statistics model of a bundle's training graph.

    Args:
        training_model_path: the bundle's ``training_model.onnx``.
        label_name: the label input of the graph (``None`` for a label-free loss).
        with_loss: keep the loss (labels are then an input when the loss needs them).
    """
    import onnx

    model = onnx.load(os.fspath(training_model_path))
    g = model.graph
    loss = g.output[0].name
    updates = []
    for node in g.node:
        if node.op_type == BN_OP and len(node.output) >= 3:
            updates += [(node.output[1], node.input[3]), (node.output[2], node.input[4])]
    wanted = [n for n, _ in updates]
    if with_loss:
        wanted.insert(0, loss)
    if not wanted:  # no statistics to update and no loss asked for: nothing to run
        return StatisticsModel(b"", None, ())
    nodes = prune_to_outputs(list(g.node), wanted)
    used = {i for n in nodes for i in n.input}
    if label_name is not None and not with_loss:
        used.discard(label_name)
    inputs = [i for i in g.input if i.name in used]
    inits = [i for i in g.initializer if i.name in used]
    outputs = [onnx.helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None) for n in wanted]
    graph = onnx.helper.make_graph(nodes, "bn_statistics", inputs, outputs, inits)
    out = onnx.helper.make_model(graph, opset_imports=model.opset_import, ir_version=model.ir_version,
                                 producer_name="edgeadapt")
    return StatisticsModel(out.SerializeToString(), loss if with_loss else None, tuple(updates))
