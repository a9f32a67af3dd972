"""torch module -> ONNX ModelProto ready for ONNX Runtime's artifact generator.

Uses the TorchScript-based exporter (``dynamo=False``) in EVAL mode with a dynamic batch axis and
no constant folding (folding would bake trainable parameters into constants). Afterwards:

* initializers the exporter merged because their values were equal (a fresh BatchNorm's
  ``weight`` and ``running_var`` are both ones) are restored under their own names;
* the ops ONNX Runtime cannot differentiate are rewritten (:mod:`.op_rewrites`);
* channel-split tensors get readable names: ``<param>.trained``, ``<param>.frozen``,
  ``<param>.index``.

An op that the exporter or ONNX Runtime's gradient builder cannot handle raises
:class:`~.unsupported.UnsupportedOpError` naming the op and the module path it comes from.
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
import warnings

import onnx
import torch
from onnx import numpy_helper
from torch import nn

from ..bundle import ParameterEntry
from .op_rewrites import fit_for_ort_gradients
from .unsupported import UnsupportedOpError, modules_using_aten_op

__all__ = ["OPSET", "MAX_IR_VERSION", "to_onnx", "split_names"]

log = logging.getLogger(__name__)

OPSET = 17
MAX_IR_VERSION = 10  # ONNX Runtime 1.19.2 loads IR <= 10


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


def _rename(model: onnx.ModelProto, old: str, new: str) -> None:
    for init in model.graph.initializer:
        if init.name == old:
            init.name = new
    for node in model.graph.node:
        for k, name in enumerate(node.input):
            if name == old:
                node.input[k] = new


@torch.onnx.symbolic_helper.parse_args("v", "f", "f")
def _hardtanh_symbolic(g, x, lo: float, hi: float):
    """``hardtanh`` / ``relu6`` (``nn.ReLU6``, ``nn.Hardtanh``) with torch's gradient.

    torch's backward passes the gradient only where ``lo < x < hi``; ONNX Runtime's Clip gradient
    also passes it at ``x == lo`` and ``x == hi`` (torch's ``clamp`` convention, which keeps the
    plain Clip). Ties are common: a ReLU6 after a BatchNorm with zero bias and mean sees exact
    zeros wherever the conv's window read only zeros (a third of MobileNet's depthwise outputs at
    initialisation), and every tie adds ``dy`` to the bias gradients upstream. Written as
    ``Where(x >= hi, hi, Where(x <= lo, lo, x))``: the same values (NaN stays NaN, as in torch, so
    a non-finite input still gives a non-finite loss), and WhereGrad passes ``dy`` to ``x`` exactly
    where ``lo < x < hi`` (it keeps the boolean conditions, not ``x``).
    """
    lo_t = g.op("Constant", value_t=torch.tensor(lo, dtype=torch.float32))
    hi_t = g.op("Constant", value_t=torch.tensor(hi, dtype=torch.float32))
    below_or_at = g.op("Where", g.op("LessOrEqual", x, lo_t), lo_t, x)
    return g.op("Where", g.op("GreaterOrEqual", x, hi_t), hi_t, below_or_at)


@torch.onnx.symbolic_helper.parse_args("v")
def _relu6_symbolic(g, x):
    return _hardtanh_symbolic(g, x, 0.0, 6.0)


@contextlib.contextmanager
def _torch_gradient_symbolics():
    """Export ``aten::hardtanh`` and ``aten::relu6`` with :func:`_hardtanh_symbolic` (only inside)."""
    ops = {"aten::hardtanh": _hardtanh_symbolic, "aten::relu6": _relu6_symbolic}
    for op, fn in ops.items():
        torch.onnx.register_custom_op_symbolic(op, fn, OPSET)
    try:
        yield
    finally:
        for op in ops:
            torch.onnx.unregister_custom_op_symbolic(op, OPSET)


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
        with warnings.catch_warnings(), _torch_gradient_symbolics():
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
        raise UnsupportedOpError(op, modules_using_aten_op(module, example, op),
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

    fit_for_ort_gradients(model)
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
