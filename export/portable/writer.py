"""Write the portable backend's files into a staged bundle: the step graphs, the optimizer graph
and ``portable_state.npz``, and return what the manifest records about them."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from ...bundle import ParameterEntry
from ...runtime.head_features import HEAD_FEATURES_OUTPUT, HEAD_FEATURES_ROLE, LinearHead, add_head_output
from .optimizer_graph import optimizer_graph
from .step_graphs import OPSET, PortableGraph, build_step_graphs, graph_parameters, trained_names

__all__ = ["PORTABLE_FILES", "PortableFiles", "write_portable", "example_labels"]

log = logging.getLogger(__name__)

PORTABLE_FILES = {
    "portable_train": "portable_train.onnx", "portable_eval": "portable_eval.onnx",
    "portable_stats": "portable_stats.onnx", "portable_optimizer": "portable_optimizer.onnx",
    "portable_state": "portable_state.npz",
}
STEP_KEY = "step"


@dataclass(frozen=True)
class PortableFiles:
    """What :func:`write_portable` wrote: ``files`` (role -> file name), the manifest's
    ``portable`` entry, the node count per graph, the seconds it took and the linear head whose
    input the eval graph also returns (``None``: the model ends in none)."""

    files: dict[str, str]
    portable: dict
    node_counts: dict[str, int]
    seconds: float
    head: LinearHead | None = None


def example_labels(loss: str, label: dict | None, n: int) -> np.ndarray | None:
    """Labels of the right dtype and shape for tracing (their values do not matter)."""
    if label is None:
        return None
    if loss == "cross_entropy":
        return (np.arange(n) % label["n_classes"]).astype(np.int64)
    return np.full([n, *label["shape"][1:]], 0.25, dtype=np.float32)


def write_portable(stage: Path, model: onnx.ModelProto, entries: Sequence[ParameterEntry], loss: str, batchnorm: str,
                   optimizer: dict, data: np.ndarray, labels: np.ndarray | None) -> PortableFiles:
    """Build the portable graphs of ``model`` and write them and their state into ``stage``.

    Args:
        stage: the staged bundle directory.
        model: the ONNX model the bundle trains (the suffix when the prefix's features are cached).
        entries: the manifest's parameter entries.
        loss, batchnorm, optimizer: the manifest's settings (``optimizer`` as its dict).
        data: an example batch of ``model``'s input; labels: example labels or ``None``.
    """
    start = time.perf_counter()
    graphs: dict[str, PortableGraph] = build_step_graphs(model, entries, loss, batchnorm, data, labels)
    inits = {i.name: i for i in model.graph.initializer}
    values = {n: numpy_helper.to_array(inits[n]) for n in graph_parameters(model, entries)}
    shapes = {n: values[n].shape for n in trained_names(entries) if n in values}
    graphs["portable_optimizer"] = optimizer_graph(shapes, optimizer)
    graphs["portable_eval"], head = _with_head_output(graphs["portable_eval"])
    files = {}
    for role, graph in graphs.items():
        files[role] = PORTABLE_FILES[role]
        onnx.save(graph.model, stage / files[role])
    files["portable_state"] = PORTABLE_FILES["portable_state"]
    np.savez(stage / files["portable_state"], **values, **{STEP_KEY: np.array(0, dtype=np.int64)})
    seconds = time.perf_counter() - start
    counts = {role: len(g.model.graph.node) for role, g in graphs.items()}
    log.info("portable graphs built in %.1f s (nodes: %s)", seconds, counts)
    portable = {"opset": OPSET, "recompute": False, "graphs": {role: g.interface() for role, g in graphs.items()}}
    return PortableFiles(files, portable, counts, seconds, head)


def _with_head_output(graph: PortableGraph) -> tuple[PortableGraph, LinearHead | None]:
    """The eval graph also returning its linear head's input (role ``head_features``), and the
    head by parameter name; the graph unchanged and ``None`` when it ends in no linear head."""
    names = {name: role.split(":", 1)[1] for role, name in graph.inputs if role.startswith("param:")}
    head = add_head_output(graph.model, set(names), dict(graph.outputs)["output"])
    if head is None:
        return graph, None
    outputs = (*graph.outputs, (HEAD_FEATURES_ROLE, HEAD_FEATURES_OUTPUT))
    return PortableGraph(graph.model, graph.inputs, outputs), head.renamed(names)
