"""Unsupported ops: the error that names an op and the module it comes from.

:class:`UnsupportedOpError` is raised when the exporter has no ONNX form for an op, when ONNX
Runtime cannot differentiate one (:func:`unsupported_from_ort_error` reads the node ONNX Runtime
names), or when an op rewrite has no exact form; :func:`module_of_node` maps an exported node
name back to its module path.
"""

from __future__ import annotations

import re
import warnings

import onnx
import torch
from torch import nn

__all__ = ["UnsupportedOpError", "unsupported_from_ort_error", "module_of_node", "modules_using_aten_op"]


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
            "ops (Conv, Linear, norms, ReLU/ReLU6/GELU/ELU/Hardswish, pooling, add, softmax, matmul) or "
            "freeze everything before it so no gradient has to flow through it"
        )


# How ONNX Runtime names the node it failed on: the gradient builder ("for node X", "Error Node (X)"),
# session creation ("node with name 'X'") and the executor ("Name:'X'").
_ORT_NODE_NAME = re.compile(r"for node (\S+)|node with name '([^']+)'|Name:'([^']+)'|Error Node \(([^)]+)\)")


def unsupported_from_ort_error(error: BaseException, model: onnx.ModelProto, stage: str) -> UnsupportedOpError | None:
    """The :class:`UnsupportedOpError` for an ONNX Runtime failure on a node of ``model``.

    ONNX Runtime names the node it failed on; a gradient node is named after its forward node
    (``/act/Slice_Grad/SliceGrad_1`` belongs to ``/act/Slice``). When that forward node is in
    ``model``, the error names its op type and module (:func:`module_of_node`); ``stage`` says what
    failed, and ONNX Runtime's own reason is appended. ``None`` when no node of ``model`` is named
    (the failure is not caused by one op of the user's model).
    """
    text = str(error)
    if re.search(r"allocat|out of memory|bad_alloc", text, re.IGNORECASE):  # memory, not the op
        return None
    nodes = {n.name: n for n in model.graph.node if n.name}
    for m in _ORT_NODE_NAME.finditer(text):
        named = next(g for g in m.groups() if g)
        node = nodes.get(named.split("_Grad/")[0]) or nodes.get(named)  # the forward node, if one
        if node is None:
            continue
        # ONNX Runtime's reason: what follows its error-code prefix, from the node name on if long
        start = max((p.end() for p in re.finditer(r"\[ONNXRuntimeError\] : \d+ : ", text)), default=0)
        reason = text[start:].strip()
        if len(reason) > 200:
            reason = text[m.start():].strip()
        reason = " ".join(reason.split())[:300]
        return UnsupportedOpError(node.op_type, [module_of_node(node.name)], f"{stage} (ONNX Runtime 1.19.2: {reason})")
    return None


def _module_from_scope(scope: str) -> str:
    # TorchScript scopes look like "__module.blocks/__module.blocks.0/__module.blocks.0.conv"
    last = scope.split("/")[-1] if scope else ""
    return last.removeprefix("__module.") or "<root>"


def modules_using_aten_op(model: nn.Module, example: torch.Tensor, op: str) -> list[str]:
    """Module paths whose forward calls the torch op ``op`` (``aten::name``), from a TorchScript trace."""
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
