"""The portable optimizer graph: one update of every trained tensor, elementwise standard ONNX ops.

AdamW follows ``torch.optim.AdamW`` (decoupled weight decay before the moment update, the
moments' bias corrections folded into two scalars). The step-dependent scalars are inputs,
computed on the host in float64 and cast (in float32 inside the graph they drift ~6e-4 from
torch over ten steps)::

    decay = 1 - lr * weight_decay
    step_size = lr / (1 - beta1 ** t)
    bias_correction2_sqrt = sqrt(1 - beta2 ** t)

    p = p * decay
    m = m + (g - m) * (1 - beta1)            # torch's lerp
    v = v * beta2 + g * g * (1 - beta2)
    p = p - step_size * (m / (sqrt(v) / bias_correction2_sqrt + eps))

SGD (no momentum, no weight decay, as the ORT-training backend's SGD): ``p = p - lr * g``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .step_graphs import MAX_IR_VERSION, OPSET, PortableGraph

__all__ = ["ADAMW_SCALARS", "optimizer_graph"]

ADAMW_SCALARS = ("decay", "step_size", "bias_correction2_sqrt")


def _value(name: str, shape: Sequence[int]) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, list(shape))


def optimizer_graph(shapes: Mapping[str, Sequence[int]], optimizer: Mapping) -> PortableGraph:
    """The optimizer graph for trained tensors ``shapes`` (onnx name -> shape, in order).

    Args:
        shapes: the trained tensors.
        optimizer: the manifest's ``optimizer`` (``name``, and for AdamW ``betas``, ``eps``).
    """
    nodes, inits, inputs, outputs = [], [], [], []
    in_roles, out_roles = [], []

    def const(name: str, value: float) -> str:
        inits.append(numpy_helper.from_array(np.array(value, dtype=np.float32), name))
        return name

    def node(op: str, ins: list[str], out: str) -> str:
        nodes.append(helper.make_node(op, ins, [out]))
        return out

    adamw = optimizer["name"] == "adamw"
    if adamw:
        beta1, beta2 = (float(b) for b in optimizer["betas"])
        one_minus_beta1, b2 = const("one_minus_beta1", 1.0 - beta1), const("beta2", beta2)
        one_minus_beta2, eps = const("one_minus_beta2", 1.0 - beta2), const("eps", float(optimizer["eps"]))
        scalars = list(ADAMW_SCALARS)
    else:
        scalars = ["lr"]
    for i, (name, shape) in enumerate(shapes.items()):
        p, g = f"param_{i}", f"grad_{i}"
        inputs += [_value(p, shape), _value(g, shape)]
        in_roles += [f"param:{name}", f"grad:{name}"]
        if adamw:
            m, v = f"exp_avg_{i}", f"exp_avg_sq_{i}"
            inputs += [_value(m, shape), _value(v, shape)]
            in_roles += [f"exp_avg:{name}", f"exp_avg_sq:{name}"]
            decayed = node("Mul", [p, "decay"], f"decayed_{i}")
            diff = node("Sub", [g, m], f"g_minus_m_{i}")
            m_new = node("Add", [m, node("Mul", [diff, one_minus_beta1], f"m_step_{i}")], f"new_exp_avg_{i}")
            gg = node("Mul", [node("Mul", [g, g], f"g2_{i}"), one_minus_beta2], f"v_step_{i}")
            v_new = node("Add", [node("Mul", [v, b2], f"v_decayed_{i}"), gg], f"new_exp_avg_sq_{i}")
            denom = node("Add", [node("Div", [node("Sqrt", [v_new], f"v_sqrt_{i}"), "bias_correction2_sqrt"],
                                      f"v_corrected_{i}"), eps], f"denom_{i}")
            update = node("Mul", [node("Div", [m_new, denom], f"ratio_{i}"), "step_size"], f"update_{i}")
            p_new = node("Sub", [decayed, update], f"new_param_{i}")
            outputs += [_value(p_new, shape), _value(m_new, shape), _value(v_new, shape)]
            out_roles += [f"param:{name}", f"exp_avg:{name}", f"exp_avg_sq:{name}"]
        else:
            p_new = node("Sub", [p, node("Mul", [g, "lr"], f"update_{i}")], f"new_param_{i}")
            outputs.append(_value(p_new, shape))
            out_roles.append(f"param:{name}")
    inputs += [_value(s, []) for s in scalars]
    in_roles += scalars
    graph = helper.make_graph(nodes, "portable_optimizer", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="edgeadapt")
    model.ir_version = MAX_IR_VERSION
    onnx.checker.check_model(model, full_check=True)
    return PortableGraph(model, tuple(zip(in_roles, (i.name for i in inputs))),
                         tuple(zip(out_roles, (o.name for o in outputs))))
