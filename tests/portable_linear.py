"""A hand-built portable bundle (onnx.helper graphs, no exporter, no torch): Linear(4 -> 3) with
cross-entropy and AdamW, for testing the portable executor on its own.

Graph tensor names are deliberately generated-looking (``arg0``, ``out_7``) and the parameter
inputs come in a different order in each graph, so only the manifest's role maps can wire them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from edgeadapt.bundle import Manifest, ParameterEntry, TensorSpec, sha256_file, write_manifest

N_IN, N_OUT = 4, 3
W, B = "fc.weight", "fc.bias"  # the ONNX initializer names (what ParameterEntry.onnx_names holds)
BETAS, EPS, WEIGHT_DECAY, LR = (0.9, 0.999), 1e-8, 0.01, 0.05
OPSET = 18


def _model(nodes, inputs, outputs, inits=()) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=10)
    onnx.checker.check_model(model, full_check=True)
    return model


def _vi(name, elem, shape):
    return helper.make_tensor_value_info(name, elem, shape)


def _forward(per_window: bool):
    """Nodes computing logits ``out_7`` and the loss ``loss_3`` (weighted sum of per-window
    cross-entropy with ``arg4`` as weights, or the batch mean)."""
    nodes = [helper.make_node("Gemm", ["arg2", "arg0", "arg1"], ["out_7"], transB=1)]
    if per_window:
        nodes += [helper.make_node("SoftmaxCrossEntropyLoss", ["out_7", "arg3"], ["ce_i"], reduction="none"),
                  helper.make_node("Mul", ["ce_i", "arg4"], ["wce"]),
                  helper.make_node("ReduceSum", ["wce"], ["loss_3"], keepdims=0)]
    else:
        nodes += [helper.make_node("SoftmaxCrossEntropyLoss", ["out_7", "arg3"], ["loss_3"], reduction="mean")]
    return nodes


def train_model(train_weight: bool = True) -> onnx.ModelProto:
    nodes = _forward(True) + [
        helper.make_node("Softmax", ["out_7"], ["sm"], axis=1),
        helper.make_node("OneHot", ["arg3", "depth", "onoff"], ["oh"], axis=-1),
        helper.make_node("Sub", ["sm", "oh"], ["dl0"]),
        helper.make_node("Unsqueeze", ["arg4", "ax1"], ["w2"]),
        helper.make_node("Mul", ["dl0", "w2"], ["dl"]),
        helper.make_node("Gemm", ["dl", "arg2"], ["g_w"], transA=1),
        helper.make_node("ReduceSum", ["dl", "ax0"], ["g_b"], keepdims=0),
    ]
    inits = [numpy_helper.from_array(np.array(N_OUT, np.int64), "depth"),
             numpy_helper.from_array(np.array([0.0, 1.0], np.float32), "onoff"),
             numpy_helper.from_array(np.array([1], np.int64), "ax1"),
             numpy_helper.from_array(np.array([0], np.int64), "ax0")]
    inputs = [_vi("arg0", TensorProto.FLOAT, [N_OUT, N_IN]), _vi("arg1", TensorProto.FLOAT, [N_OUT]),
              _vi("arg2", TensorProto.FLOAT, ["s0", N_IN]), _vi("arg3", TensorProto.INT64, ["s0"]),
              _vi("arg4", TensorProto.FLOAT, ["s0"])]
    outputs = [_vi("loss_3", TensorProto.FLOAT, []), _vi("out_7", TensorProto.FLOAT, ["s0", N_OUT]),
               _vi("g_w", TensorProto.FLOAT, [N_OUT, N_IN]), _vi("g_b", TensorProto.FLOAT, [N_OUT])]
    if not train_weight:
        nodes = [n for n in nodes if "g_w" not in n.output]
        outputs = [o for o in outputs if o.name != "g_w"]
    return _model(nodes, inputs, outputs, inits)


def eval_model() -> onnx.ModelProto:
    inputs = [_vi("arg0", TensorProto.FLOAT, [N_OUT, N_IN]), _vi("arg1", TensorProto.FLOAT, [N_OUT]),
              _vi("arg2", TensorProto.FLOAT, ["s0", N_IN]), _vi("arg3", TensorProto.INT64, ["s0"])]
    outputs = [_vi("loss_3", TensorProto.FLOAT, []), _vi("out_7", TensorProto.FLOAT, ["s0", N_OUT])]
    return _model(_forward(False), inputs, outputs)


def optimizer_model(train_weight: bool = True) -> onnx.ModelProto:
    """AdamW as the spec writes it, for each trained tensor (bias first: an order of its own)."""
    nodes, inputs, outputs = [], [], []
    b1, b2 = BETAS
    inits = [numpy_helper.from_array(np.array(v, np.float32), k) for k, v in
             {"one_m_b1": 1 - b1, "b2": b2, "one_m_b2": 1 - b2, "eps": EPS}.items()]
    for i, (name, shape) in enumerate([(B, [N_OUT]), (W, [N_OUT, N_IN])][:2 if train_weight else 1]):
        p, g, m, v = (f"i{i}_{k}" for k in "pgmv")
        inputs += [_vi(x, TensorProto.FLOAT, shape) for x in (p, g, m, v)]
        nodes += [
            helper.make_node("Mul", [p, "decay"], [f"pd{i}"]),
            helper.make_node("Sub", [g, m], [f"gm{i}"]),
            helper.make_node("Mul", [f"gm{i}", "one_m_b1"], [f"gmb{i}"]),
            helper.make_node("Add", [m, f"gmb{i}"], [f"o{i}_m"]),
            helper.make_node("Mul", [v, "b2"], [f"vb{i}"]),
            helper.make_node("Mul", [g, g], [f"gg{i}"]),
            helper.make_node("Mul", [f"gg{i}", "one_m_b2"], [f"ggb{i}"]),
            helper.make_node("Add", [f"vb{i}", f"ggb{i}"], [f"o{i}_v"]),
            helper.make_node("Sqrt", [f"o{i}_v"], [f"sv{i}"]),
            helper.make_node("Div", [f"sv{i}", "bias_correction2_sqrt"], [f"svc{i}"]),
            helper.make_node("Add", [f"svc{i}", "eps"], [f"den{i}"]),
            helper.make_node("Div", [f"o{i}_m", f"den{i}"], [f"r{i}"]),
            helper.make_node("Mul", [f"r{i}", "step_size"], [f"u{i}"]),
            helper.make_node("Sub", [f"pd{i}", f"u{i}"], [f"o{i}_p"]),
        ]
        outputs += [_vi(f"o{i}_{k}", TensorProto.FLOAT, shape) for k in "pmv"]
    inputs += [_vi(k, TensorProto.FLOAT, []) for k in ("decay", "step_size", "bias_correction2_sqrt")]
    return _model(nodes, inputs, outputs, inits)


def portable_interfaces(train_weight: bool = True) -> dict:
    train = {"inputs": [[f"param:{W}", "arg0"], [f"param:{B}", "arg1"], ["data", "arg2"], ["labels", "arg3"],
                        ["weights", "arg4"]],
             "outputs": [["loss", "loss_3"], ["output", "out_7"], [f"grad:{W}", "g_w"], [f"grad:{B}", "g_b"]]}
    if not train_weight:
        del train["outputs"][2]
    ev = {"inputs": train["inputs"][:4], "outputs": train["outputs"][:2]}
    opt_in, opt_out = [], []
    for i, name in enumerate([B, W][:2 if train_weight else 1]):
        opt_in += [[f"{k}:{name}", f"i{i}_{c}"] for k, c in
                   (("param", "p"), ("grad", "g"), ("exp_avg", "m"), ("exp_avg_sq", "v"))]
        opt_out += [[f"{k}:{name}", f"o{i}_{c}"] for k, c in (("param", "p"), ("exp_avg", "m"), ("exp_avg_sq", "v"))]
    opt_in += [[k, k] for k in ("decay", "step_size", "bias_correction2_sqrt")]
    return {"opset": OPSET, "graphs": {"portable_train": train, "portable_eval": ev,
                                       "portable_optimizer": {"inputs": opt_in, "outputs": opt_out}}}


def initial_parameters(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {W: rng.normal(0, 0.5, (N_OUT, N_IN)).astype(np.float32), B: rng.normal(0, 0.1, N_OUT).astype(np.float32)}


def write_bundle(out: Path, seed: int = 0, train_weight: bool = True) -> Path:
    """Write the bundle into the new directory ``out`` (``train_weight=False``: only the bias
    trains); returns ``out``."""
    out.mkdir(parents=True)
    files = {"portable_train": "portable_train.onnx", "portable_eval": "portable_eval.onnx",
             "portable_optimizer": "portable_optimizer.onnx", "portable_state": "portable_state.npz",
             "masks": "masks.npz"}
    for role, model in (("portable_train", train_model(train_weight)), ("portable_eval", eval_model()),
                        ("portable_optimizer", optimizer_model(train_weight))):
        onnx.save(model, out / files[role])
    params = initial_parameters(seed)
    with open(out / files["portable_state"], "wb") as f:
        np.savez(f, **params, step=np.array(0, np.int64))
    with open(out / files["masks"], "wb") as f:
        np.savez(f, **{"fc.weight": np.full(N_OUT, train_weight), "fc.bias": np.ones(N_OUT, bool)})
    manifest = Manifest(
        files=files, sha256={name: sha256_file(out / name) for name in files.values()},
        input=TensorSpec("input", (None, N_IN), "float32"), output=TensorSpec("logits", (None, N_OUT), "float32"),
        label={"name": "labels", "shape": [None], "dtype": "int64", "n_classes": N_OUT}, loss="cross_entropy",
        optimizer={"name": "adamw", "lr": LR, "weight_decay": WEIGHT_DECAY, "betas": list(BETAS), "eps": EPS},
        batchnorm="frozen", policy={}, versions={},
        parameters=(ParameterEntry("fc.weight", (N_OUT, N_IN), "full" if train_weight else "frozen", {"value": W},
                                   N_OUT * N_IN if train_weight else 0),
                    ParameterEntry("fc.bias", (N_OUT,), "full", {"value": B}, N_OUT)),
        backends=("portable",), portable=portable_interfaces(train_weight))
    write_manifest(out, manifest)
    return out


def reference_steps(params: dict[str, np.ndarray], batches, lr: float = LR) -> dict[str, np.ndarray]:
    """torch.optim.AdamW semantics over mean cross-entropy, in float64 numpy."""
    p = {k: v.astype(np.float64) for k, v in params.items()}
    m = {k: np.zeros_like(v) for k, v in p.items()}
    v2 = {k: np.zeros_like(v) for k, v in p.items()}
    b1, b2 = BETAS
    for t, (x, y) in enumerate(batches, start=1):
        x = x.astype(np.float64)
        logits = x @ p[W].T + p[B]
        e = np.exp(logits - logits.max(1, keepdims=True))
        dl = (e / e.sum(1, keepdims=True) - np.eye(N_OUT)[y]) / len(x)
        grads = {W: dl.T @ x, B: dl.sum(0)}
        for k in p:
            p[k] *= 1 - lr * WEIGHT_DECAY
            m[k] += (grads[k] - m[k]) * (1 - b1)
            v2[k] = v2[k] * b2 + grads[k] ** 2 * (1 - b2)
            denom = np.sqrt(v2[k]) / np.sqrt(1 - b2 ** t) + EPS
            p[k] -= lr / (1 - b1 ** t) * m[k] / denom
    return p
