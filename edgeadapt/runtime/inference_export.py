"""A plain ONNX inference model from a bundle's eval graph and the runner's current parameters.

The eval graph takes every parameter as a graph input (the training API feeds them from the
checkpoint). An inference model bakes them in as initializers and keeps only what the requested
outputs need, so the loss and the label input go. Uses the ``onnx`` package (installed with
onnxruntime-training), imported only when a model is exported.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

__all__ = ["export_eval_graph", "prune_to_outputs"]


def prune_to_outputs(nodes, outputs: Sequence[str]) -> list:
    """The nodes that ``outputs`` depend on, in their original order."""
    producer = {o: i for i, n in enumerate(nodes) for o in n.output if o}
    keep: set[int] = set()
    stack = list(outputs)
    while stack:
        i = producer.get(stack.pop())
        if i is None or i in keep:
            continue
        keep.add(i)
        stack.extend(nodes[i].input)
    return [n for i, n in enumerate(nodes) if i in keep]


def export_eval_graph(eval_path, parameters: Mapping[str, np.ndarray],
                      output_names: Sequence[str], path: str | os.PathLike) -> Path:
    """Write ``eval_path``'s graph (a path, or an ``onnx.ModelProto``) with ``parameters`` as
    initializers, pruned to ``output_names``.

    Raises:
        ValueError: an output name is not produced by the graph.
    """
    import onnx
    from onnx import numpy_helper

    model = eval_path if isinstance(eval_path, onnx.ModelProto) else onnx.load(os.fspath(eval_path))
    g = model.graph
    produced = {o for n in g.node for o in n.output} | {i.name for i in g.input}
    missing = [o for o in output_names if o not in produced]
    if missing:
        raise ValueError(f"the eval graph has no output {missing}; choose from {[o.name for o in g.output]}")
    nodes = prune_to_outputs(list(g.node), output_names)
    used = {i for n in nodes for i in n.input} | set(output_names)
    value_info = {v.name: v for v in [*g.output, *g.value_info]}
    inputs = [i for i in g.input if i.name in used and i.name not in parameters]
    inits = [i for i in g.initializer if i.name in used]
    inits += [numpy_helper.from_array(np.asarray(v), n) for n, v in parameters.items() if n in used]
    outputs = [value_info[o] if o in value_info else onnx.helper.make_empty_tensor_value_info(o)
               for o in output_names]
    graph = onnx.helper.make_graph(nodes, g.name or "inference", inputs, outputs, inits)
    out = onnx.helper.make_model(graph, opset_imports=model.opset_import, ir_version=model.ir_version,
                                 producer_name="edgeadapt")
    onnx.save(out, os.fspath(path))
    return Path(path)
