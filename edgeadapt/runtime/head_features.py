"""The classifier head's input and the logits of the current parameters, in one inference pass.

Label-free adaptation needs the features the linear head reads (class prototypes are means of
them). The exporter makes every eval graph return them (:func:`add_head_output`: an ``Identity``
of the head's input named :data:`HEAD_FEATURES_OUTPUT`, and the head's tensors in the manifest's
``head``), so the runner's eval session gives them at no cost beyond the tensor itself.

For a bundle exported before that (no ``head`` in its manifest), :class:`HeadFeatures` builds, once,
an inference model from the runner's own plain export (:meth:`Runner.export_inference`: prefix and
suffix merged, any backend) with two changes: every tensor the training backend holds becomes a
graph *input* (fed the backend's current values at each run, so BatchNorm statistics or biases
changed later are seen without exporting again), and the head's input is a second output. That
second session costs memory no plan counts (about 2 MiB for a small CNN); re-export to avoid it.

The head is the ``torch.nn.Linear`` that produces the model output: a ``Gemm`` (the
onnxruntime-training graphs), or ``MatMul`` of the weight (or of its ``Transpose``) followed by
``Add`` of the bias (the portable graphs, traced through core aten ops). A model ending in anything
else has no linear head to adjust and :class:`HeadFeatures` refuses it (``ValueError``).
Torch-free: numpy, onnx (installed with onnxruntime-training) and onnxruntime.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .arrays import native_contiguous
from .ort_import import import_onnxruntime

__all__ = ["HEAD_FEATURES_OUTPUT", "HEAD_FEATURES_ROLE", "LinearHead", "HeadFeatures", "find_linear_head",
           "add_head_output"]

# The eval graphs' extra output: the linear head's input, one row per window.
HEAD_FEATURES_OUTPUT = "edgeadapt_head_features"
# Its role in a portable eval graph's interface (manifest portable.graphs).
HEAD_FEATURES_ROLE = "head_features"


@dataclass(frozen=True)
class LinearHead:
    """Where the linear head's weight and bias live: graph tensor names, and whether the weight is
    stored ``(classes, features)`` (``transposed``: ``Gemm`` with ``transB=1``, torch's layout)."""

    weight: str
    bias: str | None
    transposed: bool

    def to_dict(self) -> dict:
        """The manifest's ``head`` entry."""
        return {"weight": self.weight, "bias": self.bias, "transposed": self.transposed}

    @classmethod
    def from_dict(cls, d: dict) -> LinearHead:
        return cls(str(d["weight"]), None if d.get("bias") is None else str(d["bias"]), bool(d["transposed"]))

    def renamed(self, names: dict[str, str]) -> LinearHead:
        """The same head with its tensors renamed by ``names`` (graph names -> parameter names)."""
        return LinearHead(names[self.weight], None if self.bias is None else names[self.bias], self.transposed)


class HeadFeatures:
    """Features before the head and logits, from one inference session (see module docstring).

    Args:
        export: writes the runner's plain inference model to the given path.
        parameter_names: the training backend's tensor names (fed at each run).
        get_tensor: reads a backend tensor's current value.
    """

    def __init__(self, export: Callable[[Path], object], parameter_names: Iterable[str],
                 get_tensor: Callable[[str], np.ndarray]):
        import onnx

        with tempfile.TemporaryDirectory(prefix="edgeadapt-head-") as scratch:
            path = Path(scratch) / "model.onnx"
            export(path)
            model = onnx.load(os.fspath(path))
        graph = model.graph
        params = set(parameter_names)
        self.head, self.features_name = find_linear_head(graph, params)
        moved = [t for t in graph.initializer if t.name in params]
        for t in moved:
            graph.initializer.remove(t)
            graph.input.append(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
        graph.output.append(onnx.helper.make_tensor_value_info(self.features_name, onnx.TensorProto.FLOAT, None))
        ort = import_onnxruntime()
        options = ort.SessionOptions()
        options.enable_cpu_mem_arena = False
        options.enable_mem_pattern = False
        options.intra_op_num_threads = 1
        self._session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        self._input_name = graph.input[0].name
        self._output_names = [graph.output[0].name, self.features_name]
        self._parameter_inputs = [t.name for t in moved]
        self._get_tensor = get_tensor

    def run(self, X: np.ndarray, batch_windows: int = 256) -> tuple[np.ndarray, np.ndarray]:
        """``(features, logits)`` of the windows ``X`` under the backend's current values."""
        feeds = {n: self._get_tensor(n) for n in self._parameter_inputs}
        feats, logits = [], []
        for start in range(0, len(X), batch_windows):
            feeds[self._input_name] = native_contiguous(X[start:start + batch_windows])
            out, f = self._session.run(self._output_names, feeds)
            logits.append(out)
            feats.append(f.reshape(len(f), -1))
        return np.concatenate(feats), np.concatenate(logits)


def add_head_output(model, params: set[str], output: str) -> LinearHead | None:
    """Make ``model`` (an ``onnx.ModelProto``, changed in place) also return the input of the
    linear head producing its output ``output`` as :data:`HEAD_FEATURES_OUTPUT`
    (``(windows, features)``); the head in ``model``'s tensor names, or ``None`` (nothing changed)
    when ``output`` comes from no linear head over 2-D features whose weight and bias are in
    ``params``, or the model already has that output."""
    import onnx

    graph = model.graph
    outputs = {o.name: o for o in graph.output}
    if HEAD_FEATURES_OUTPUT in outputs or output not in outputs:
        return None
    try:
        head, features = find_linear_head(graph, params, output)
    except ValueError:
        return None
    shapes = {v.name: v for v in [*graph.input, *graph.value_info, *graph.output]}
    weight = shapes.get(head.weight)
    if weight is None or len(weight.type.tensor_type.shape.dim) != 2:
        return None
    out_type = outputs[output].type.tensor_type
    if out_type.HasField("shape") and len(out_type.shape.dim) != 2:  # a head over a sequence: no per-window classifier
        return None
    n_features = weight.type.tensor_type.shape.dim[1 if head.transposed else 0].dim_value
    if not n_features:  # a weight of unknown width: the runtime could not size the output
        return None
    graph.node.append(onnx.helper.make_node("Identity", [features], [HEAD_FEATURES_OUTPUT],
                                            name="edgeadapt_head_features_identity"))
    graph.output.append(onnx.helper.make_tensor_value_info(
        HEAD_FEATURES_OUTPUT, onnx.TensorProto.FLOAT, ["batch", n_features]))
    return head


def _over_classes(node) -> bool:
    """Whether a (Log)Softmax node normalises over the last axis of a 2-D output (the classes)."""
    import onnx

    axis = next((onnx.helper.get_attribute_value(a) for a in node.attribute if a.name == "axis"), -1)
    return axis in (-1, 1)


def find_linear_head(graph, params: set[str], output: str | None = None) -> tuple[LinearHead, str]:
    """The linear head producing ``graph``'s output ``output`` (default: its first) and the name of
    its input (features):
    ``Gemm(f, W, b)``, or ``Add(MatMul(f, W or Transpose(W)), b)`` (either ``Add`` operand order),
    possibly followed by ``Identity`` or ``LogSoftmax`` over the classes.

    Raises:
        ValueError: the output comes from no such head, or its weight or bias is not in ``params``.
    """
    import onnx

    producers = {o: n for n in graph.node for o in n.output}
    out = producers.get(output or graph.output[0].name)
    # Through an exporter's alias of the head's output, and a log-softmax over the classes (the
    # class scores up to a per-window constant: the same predictions and softmax).
    while out is not None and (out.op_type == "Identity" or (out.op_type == "LogSoftmax" and _over_classes(out))):
        out = producers.get(out.input[0])
    bias = None
    if out is not None and out.op_type == "Gemm":
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in out.attribute}
        if attrs.get("transA", 0):
            raise ValueError("classifier adjustment needs a head Gemm without transA; re-export the model")
        features, weight, transposed = out.input[0], out.input[1], bool(attrs.get("transB", 0))
        bias = out.input[2] if len(out.input) > 2 else None
    else:
        matmul = out
        if out is not None and out.op_type == "Add":
            a, b = out.input
            matmul, bias = (producers.get(a), b) if b in params else (producers.get(b), a)
        if matmul is None or matmul.op_type != "MatMul":
            found = "nothing" if out is None else out.op_type
            raise ValueError("classifier adjustment needs a model ending in a linear layer (Gemm, or MatMul + Add); "
                             f"this model ends in {found}: use a method without prototypes")
        features, weight = matmul.input
        transpose = producers.get(weight)
        transposed = transpose is not None and transpose.op_type == "Transpose"
        if transposed:
            perm = [list(onnx.helper.get_attribute_value(a)) for a in transpose.attribute if a.name == "perm"]
            if perm not in ([], [[1, 0]]):
                raise ValueError(f"classifier adjustment needs a 2-D head weight; this head transposes it by {perm[0]}")
            weight = transpose.input[0]
    if weight not in params or (bias is not None and bias not in params):
        raise ValueError("the head's weight or bias is not held by the training backend (a frozen prefix); "
                         "export the bundle without cutting at the head")
    return LinearHead(weight, bias, transposed), features
