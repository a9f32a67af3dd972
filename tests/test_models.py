"""Tests for edgeadapt.models: shapes, naming, ONNX export, ORT parity, artifacts."""

from __future__ import annotations

import copy
import io

import numpy as np
import onnx
import onnxruntime
import pytest
import torch
from helpers import as_if_pretrained
from torch import nn

from edgeadapt.models import (
    MODEL_NAMES,
    CNN1d,
    DecomposedLayerNorm,
    MobileNet1d,
    TinyTransformer1d,
    build_model,
    count_parameters,
)

onnxruntime.set_default_logger_severity(3)

N_CHANNELS, N_CLASSES, N_TIME_STEPS = 8, 6, 256

# Every op the three models may export to (legacy exporter, opset 17, EVAL mode). A new op
# here is a change the gradient builder has not been checked against; shape arithmetic
# (Shape/Gather/Slice/Concat) would mean a reshape that no longer uses a constant shape.
ALLOWED_OPS = {
    "Add", "BatchNormalization", "Clip", "Constant", "Conv", "Div", "Erf", "Gemm", "MatMul",
    "Mul", "ReduceMean", "Relu", "Reshape", "Softmax", "Sqrt", "Sub", "Transpose",
}


def _model(name: str, seed: int = 0, **kwargs) -> nn.Module:
    torch.manual_seed(seed)
    return build_model(name, N_CHANNELS, N_CLASSES, N_TIME_STEPS, **kwargs)


def _as_if_pretrained(model: nn.Module, seed: int = 1) -> nn.Module:
    """Distinct norm-layer values (the shared helper) from a generator seeded with ``seed``.

    Fresh BatchNorm/LayerNorm parameters are all ones / all zeros; the legacy exporter in EVAL
    mode merges identical initializers, so those parameters would vanish from the graph.
    """
    return as_if_pretrained(model, torch.Generator().manual_seed(seed))


def _export(model: nn.Module, x: torch.Tensor) -> onnx.ModelProto:
    buf = io.BytesIO()
    torch.onnx.export(
        model.eval(), x, buf, dynamo=False, opset_version=17, do_constant_folding=False,
        training=torch.onnx.TrainingMode.EVAL, input_names=["input"], output_names=["logits"],
        dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}},
    )
    return onnx.load_from_string(buf.getvalue())


@pytest.fixture(scope="module", params=MODEL_NAMES)
def exported(request):
    """(name, pretrained-like model in eval mode, its ONNX export with batch 2)."""
    model = _as_if_pretrained(_model(request.param)).eval()
    x = torch.randn(2, N_CHANNELS, N_TIME_STEPS, generator=torch.Generator().manual_seed(2))
    return request.param, model, _export(model, x)


# ---------------------------------------------------------------------------------------------
# Construction, shapes, names
# ---------------------------------------------------------------------------------------------


def test_model_names_and_types():
    assert MODEL_NAMES == ("cnn", "mobilenet", "transformer")
    assert isinstance(_model("cnn"), CNN1d)
    assert isinstance(_model("mobilenet"), MobileNet1d)
    assert isinstance(_model("transformer"), TinyTransformer1d)


def test_unknown_name_raises():
    with pytest.raises(ValueError, match="unknown model name 'resnet'"):
        build_model("resnet", N_CHANNELS, N_CLASSES, N_TIME_STEPS)


@pytest.mark.parametrize("name", MODEL_NAMES)
@pytest.mark.parametrize("batch", [1, 5])
@pytest.mark.parametrize("train_mode", [False, True])
def test_output_shape(name, batch, train_mode):
    model = _model(name).train(train_mode)
    out = model(torch.randn(batch, N_CHANNELS, N_TIME_STEPS))
    assert out.shape == (batch, N_CLASSES)
    assert out.dtype == torch.float32
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_head_is_the_final_linear(name):
    model = _model(name).eval()
    assert isinstance(model.head, nn.Linear)
    assert model.head.out_features == N_CLASSES
    seen = []
    model.head.register_forward_hook(lambda mod, inp, out: seen.append(out))
    with torch.no_grad():
        out = model(torch.randn(3, N_CHANNELS, N_TIME_STEPS))
    assert len(seen) == 1 and torch.equal(seen[0], out)


@pytest.mark.parametrize(
    ("name", "low", "high"),
    [("cnn", 100_000, 250_000), ("mobilenet", 20_000, 250_000), ("transformer", 20_000, 250_000)],
)
def test_parameter_count_is_small(name, low, high):
    assert low <= count_parameters(_model(name)) <= high


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("cnn", ["blocks.0.conv.weight", "blocks.0.bn.weight", "blocks.3.bn.bias",
                 "head.weight", "head.bias"]),
        ("mobilenet", ["stem.conv.weight", "blocks.0.expand.conv.weight",
                       "blocks.0.depthwise.conv.weight", "blocks.0.project.bn.bias",
                       "last.conv.weight", "head.weight"]),
        ("transformer", ["patch_embed.weight", "pos_embed", "layers.0.norm1.weight",
                         "layers.0.attn.q.weight", "layers.1.attn.out.bias",
                         "layers.1.mlp.fc2.weight", "norm.bias", "head.weight"]),
    ],
)
def test_parameter_names_are_addressable(name, expected):
    names = {n for n, _ in _model(name).named_parameters()}
    assert set(expected) <= names


def test_cnn_has_four_blocks_and_depthwise_in_mobilenet():
    cnn = _model("cnn")
    assert len(cnn.blocks) == 4
    assert [b.conv.out_channels for b in cnn.blocks] == [32, 64, 64, 128]
    mobilenet = _model("mobilenet")
    for block in mobilenet.blocks:
        conv = block.depthwise.conv
        assert conv.groups == conv.in_channels == conv.out_channels
    assert any(b.use_residual for b in mobilenet.blocks)
    assert not all(b.use_residual for b in mobilenet.blocks)


def test_convolutional_models_accept_other_lengths():
    for name in ("cnn", "mobilenet"):
        out = _model(name).eval()(torch.randn(2, N_CHANNELS, 100))
        assert out.shape == (2, N_CLASSES)


def test_transformer_rejects_other_lengths():
    with pytest.raises(ValueError, match="expected 256 time steps"):
        _model("transformer")(torch.randn(2, N_CHANNELS, 128))


def test_transformer_dropout_is_configurable():
    x = torch.randn(4, N_CHANNELS, N_TIME_STEPS)
    model = _model("transformer", dropout_p=0.5).train()
    assert not torch.equal(model(x), model(x))
    model.eval()
    assert torch.equal(model(x), model(x))
    no_dropout = _model("transformer", dropout_p=0.0).train()
    assert torch.equal(no_dropout(x), no_dropout(x))
    assert all(m.p == 0.1 for m in _model("transformer").modules() if isinstance(m, nn.Dropout))


def test_decomposed_layer_norm_matches_torch():
    torch.manual_seed(0)
    ours = DecomposedLayerNorm(64)
    with torch.no_grad():
        ours.weight.uniform_(0.5, 1.5)
        ours.bias.uniform_(-1.0, 1.0)
    ref = nn.LayerNorm(64)
    ref.load_state_dict(ours.state_dict())
    x = 3.0 * torch.randn(4, 16, 64) + 1.0
    torch.testing.assert_close(ours(x), ref(x), atol=1e-5, rtol=1e-5)
    assert isinstance(ours, nn.LayerNorm)


@pytest.mark.parametrize(
    ("factory", "match"),
    [
        (lambda: CNN1d(8, 6, kernel_size=6), "kernel_size must be odd"),
        (lambda: CNN1d(8, 6, widths=()), "at least one block"),
        (lambda: CNN1d(0, 6), "n_channels must be a positive int"),
        (lambda: MobileNet1d(8, 6, block_config=[(4, 16)]), r"block_config\[0\]"),
        (lambda: TinyTransformer1d(8, 6, 256, d_model=60, n_heads=8), "must divide"),
        (lambda: TinyTransformer1d(8, 6, 8, patch_size=16), "shorter than one patch"),
        (lambda: TinyTransformer1d(8, 6, 256, dropout_p=1.0), "dropout_p"),
        (lambda: build_model("cnn", 8, 6, 0), "n_time_steps must be a positive int"),
    ],
)
def test_invalid_arguments_raise(factory, match):
    with pytest.raises(ValueError, match=match):
        factory()


# ---------------------------------------------------------------------------------------------
# ONNX export, ORT inference parity, training artifacts
# ---------------------------------------------------------------------------------------------


def test_export_keeps_every_parameter_and_uses_known_ops(exported):
    name, model, proto = exported
    onnx.checker.check_model(proto)
    initializers = {init.name for init in proto.graph.initializer}
    params = {n for n, _ in model.named_parameters()}
    assert params <= initializers, f"{name}: parameters missing from the graph"
    ops = {node.op_type for node in proto.graph.node}
    assert ops <= ALLOWED_OPS, f"{name}: unexpected ops {sorted(ops - ALLOWED_OPS)}"
    # The EVAL export drops dropout; the gradient builder cannot use LayerNormalization
    # exported without its optional outputs.
    assert "Dropout" not in ops and "LayerNormalization" not in ops


@pytest.mark.parametrize("batch", [1, 5])
def test_ort_inference_matches_torch_with_another_batch_size(exported, batch):
    name, model, proto = exported
    session = onnxruntime.InferenceSession(
        proto.SerializeToString(), providers=["CPUExecutionProvider"]
    )
    x = torch.randn(batch, N_CHANNELS, N_TIME_STEPS, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = model(x).numpy()
    (got,) = session.run(["logits"], {"input": x.numpy()})
    assert got.shape == (batch, N_CLASSES)
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5, err_msg=name)


def test_generate_artifacts_and_one_training_step(exported, tmp_path):
    from onnxruntime.training import artifacts
    from onnxruntime.training.api import CheckpointState, Module

    name, model, proto = exported
    params = [n for n, _ in model.named_parameters()]
    initializers = {init.name for init in proto.graph.initializer}
    out_dir = tmp_path / "artifacts"
    out_dir.mkdir()
    artifacts.generate_artifacts(
        proto,
        requires_grad=[n for n in params if n in initializers],
        frozen_params=sorted(initializers - set(params)),
        loss=artifacts.LossType.CrossEntropyLoss,
        optimizer=artifacts.OptimType.AdamW,
        artifact_directory=out_dir,
    )
    files = {p.name for p in out_dir.iterdir()}
    assert {"checkpoint", "training_model.onnx", "eval_model.onnx",
            "optimizer_model.onnx"} <= files
    for model_file in ("training_model.onnx", "eval_model.onnx", "optimizer_model.onnx"):
        assert onnx.load(out_dir / model_file).ir_version <= 10  # ORT 1.19.2 loads IR <= 10

    # The training graph's loss equals torch's with BatchNorm on batch statistics (ORT trains
    # every BatchNormalization in training mode) and no dropout (the EVAL export dropped it).
    x = torch.randn(4, N_CHANNELS, N_TIME_STEPS, generator=torch.Generator().manual_seed(4))
    y = torch.tensor([0, 1, 5, 2])
    reference = copy.deepcopy(model).train()
    for module in reference.modules():
        if isinstance(module, nn.Dropout):
            module.eval()
    with torch.no_grad():
        expected = nn.functional.cross_entropy(reference(x), y).item()
    state = CheckpointState.load_checkpoint(str(out_dir / "checkpoint"))
    module = Module(str(out_dir / "training_model.onnx"), state,
                    str(out_dir / "eval_model.onnx"), device="cpu")
    module.train()
    loss = float(module(x.numpy(), y.numpy()))
    assert loss == pytest.approx(expected, abs=1e-5), name


def test_transformer_training_mode_export_keeps_dropout_and_builds_gradients(tmp_path):
    from onnxruntime.training import artifacts

    model = _as_if_pretrained(_model("transformer")).train()
    buf = io.BytesIO()
    torch.onnx.export(
        model, torch.randn(2, N_CHANNELS, N_TIME_STEPS), buf, dynamo=False, opset_version=17,
        do_constant_folding=False, training=torch.onnx.TrainingMode.TRAINING,
        input_names=["input"], output_names=["logits"],
        dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}},
    )
    proto = onnx.load_from_string(buf.getvalue())
    dropouts = [node for node in proto.graph.node if node.op_type == "Dropout"]
    n_dropout_modules = sum(isinstance(m, nn.Dropout) for m in model.modules())
    assert len(dropouts) == n_dropout_modules == 9  # embedding + 4 per encoder layer
    assert all(len(node.output) == 2 for node in dropouts)  # the mask the gradient needs
    params = [n for n, _ in model.named_parameters()]
    out_dir = tmp_path / "artifacts"
    out_dir.mkdir()
    artifacts.generate_artifacts(
        proto, requires_grad=params, frozen_params=[],
        loss=artifacts.LossType.CrossEntropyLoss, optimizer=artifacts.OptimType.AdamW,
        artifact_directory=out_dir,
    )
    assert (out_dir / "training_model.onnx").is_file()
