"""Exporter: bundle contents, manifest, masks, atomic writes, unsupported ops."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch
from helpers import as_if_pretrained, make_cnn, make_two_input_model
from torch import nn

from edgeadapt.bundle import read_manifest
from edgeadapt.export import Rule, UnsupportedOpError, UpdatePolicy, export_bundle

EXAMPLE = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(0))


def test_bundle_layout_manifest_and_masks(cnn_bundle):
    names = sorted(p.name for p in cnn_bundle.iterdir())
    assert names == ["checkpoint", "eval_model.onnx", "manifest.json", "masks.npz",
                     "optimizer_model.onnx", "training_model.onnx"]
    manifest = read_manifest(cnn_bundle)  # schema + checksums
    assert manifest.input.shape == (None, 4, 16) and manifest.label["n_classes"] == 3
    assert set(manifest.sha256) == {n for n in names if n != "manifest.json"}
    assert {"torch", "onnx", "onnxruntime"} <= set(manifest.versions)
    for name in ("training_model.onnx", "eval_model.onnx", "optimizer_model.onnx"):
        assert onnx.load(cnn_bundle / name).ir_version <= 10  # ORT 1.19.2 loads IR <= 10
    masks = np.load(cnn_bundle / "masks.npz", allow_pickle=False)
    assert masks["conv2.weight"].sum() == 6 and masks["conv2.weight"].shape == (12,)
    assert masks["head.weight"].all() and not masks["conv1.weight"].any()
    entries = {p.name: p for p in manifest.parameters}
    assert entries["conv2.weight"].trainable_numel == 6 * 8 * 3
    assert entries["conv2.weight"].onnx_names["trained"] == "conv2.weight.trained"
    # gradient buffers (and so optimizer state) exist for the trained slices only
    train_graph = onnx.load(cnn_bundle / "training_model.onnx").graph
    accumulated = {o.name.split("_grad.")[0] for o in train_graph.output if "_grad.accumulation" in o.name}
    assert accumulated == {"conv2.weight.trained", "conv2.bias.trained", "head.weight", "head.bias"}


def test_channel_ratio_picks_largest_weights():
    model = make_cnn()
    with torch.no_grad():
        model.conv2.weight[[2, 9]] *= 100.0
    from edgeadapt.export.prepare import prepare_model

    prepared = prepare_model(model, UpdatePolicy(rules=(Rule("conv2", "channels", ratio=2 / 12),)))
    assert prepared.trained_channels["conv2.weight"] == (2, 9)
    assert prepared.trained_channels["conv2.bias"] == (2, 9)


def test_export_leaves_the_caller_model_untouched(tmp_path):
    model = make_cnn().train()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    export_bundle(model, EXAMPLE, tmp_path / "b", policy=UpdatePolicy.full())
    assert model.training
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert all(isinstance(m, nn.BatchNorm1d) for m in (model.bn1, model.bn2))


def test_existing_out_dir_is_refused(tmp_path):
    (tmp_path / "b").mkdir()
    with pytest.raises(FileExistsError, match="already exists"):
        export_bundle(make_cnn(), EXAMPLE, tmp_path / "b")


class _Fft(nn.Module):
    def forward(self, x):
        return torch.fft.rfft(x).abs()


class _Atan(nn.Module):
    def forward(self, x):
        return torch.atan(x)


class _WithOp(nn.Module):
    def __init__(self, op: nn.Module):
        super().__init__()
        self.features = nn.Sequential(nn.Conv1d(4, 8, 3, padding=1), op)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.features(x).mean(-1))


@pytest.mark.parametrize(
    "op,name,stage",
    [(_Fft(), "aten::fft_rfft", "has no conversion"), (_Atan(), "Atan", "has no gradient")],
    ids=["export-stage", "gradient-stage"],
)
def test_unsupported_op_names_op_and_module_and_leaves_nothing(tmp_path, op, name, stage):
    model = _WithOp(op).eval()
    with pytest.raises(UnsupportedOpError, match=stage) as info:
        export_bundle(model, EXAMPLE, tmp_path / "b", policy=UpdatePolicy.full())
    assert info.value.op == name
    assert info.value.modules == ["features.1"]
    assert not (tmp_path / "b").exists()
    assert list(tmp_path.iterdir()) == []  # no staging directory left behind


def test_frozen_prefix_needs_no_gradient_through_unsupported_op(tmp_path):
    """Everything before the op frozen: no gradient flows through it, so export succeeds."""
    model = _WithOp(_Atan()).eval()
    export_bundle(model, EXAMPLE, tmp_path / "b", policy=UpdatePolicy.last_layer())
    assert read_manifest(tmp_path / "b").trainable_numel == 8 * 3 + 3


def test_policy_that_trains_nothing_is_refused(tmp_path):
    with pytest.raises(ValueError, match="trains no parameter.*module paths"):
        export_bundle(make_cnn(), EXAMPLE, tmp_path / "b", policy=UpdatePolicy.last_layer("classifier"))


def test_multi_output_model_is_refused(tmp_path):
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.head = nn.Linear(16, 3)

        def forward(self, x):
            return self.head(x), x

    with pytest.raises(ValueError, match="single tensor"):
        export_bundle(Two(), EXAMPLE, tmp_path / "b")


def test_a_model_with_two_inputs_is_refused_before_any_work(tmp_path):
    supported = r"the exporter supports models with one input: a float32 tensor of shape \(batch, \.\.\.\)"
    with pytest.raises(ValueError, match=r"TwoInputs\.forward takes 2 inputs \(x, offset\); " + supported):
        export_bundle(make_two_input_model(), EXAMPLE, tmp_path / "b")
    with pytest.raises(ValueError, match=r"example_input holds 2 inputs; " + supported):
        export_bundle(make_two_input_model(), (EXAMPLE, EXAMPLE[:, :, :1]), tmp_path / "b")

    class Unpacks(nn.Module):  # forward(*inputs): only calling it tells
        def __init__(self):
            super().__init__()
            self.inner = make_two_input_model()

        def forward(self, *inputs):
            return self.inner(*inputs)

    with pytest.raises(ValueError, match=r"calling the model on the example input \(one tensor of shape "
                                         r"\[2, 4, 16\]\) raised TypeError: .*offset.*; if it takes more than one"):
        export_bundle(Unpacks(), EXAMPLE, tmp_path / "b")
    assert list(tmp_path.iterdir()) == []


def test_fresh_batchnorm_parameters_keep_their_own_names(tmp_path):
    """A fresh BN has weight == running_var == ones; the exporter must not merge them."""
    model = nn.Sequential(nn.Conv1d(4, 8, 3), nn.BatchNorm1d(8), nn.ReLU(), nn.Conv1d(8, 8, 3),
                          nn.BatchNorm1d(8), nn.Flatten(), nn.Linear(8 * 12, 3)).eval()
    export_bundle(model, EXAMPLE, tmp_path / "b", policy=UpdatePolicy.bias_and_norm())
    manifest = json.loads((tmp_path / "b" / "manifest.json").read_text())
    trained = {p["name"] for p in manifest["parameters"] if p["trainable_numel"]}
    assert {"1.weight", "1.bias", "4.weight", "4.bias", "0.bias", "3.bias", "6.bias"} == trained


def test_a_grouped_1d_convgrad_is_refused_before_ort_runs(tmp_path, monkeypatch):
    """Without the rewrites, the depthwise Conv1d stays 1-D, and ORT's ConvGrad would write past
    its input gradient (wrong gradients or heap corruption): the exporter refuses the training
    graph before any session runs it, and writes nothing."""
    from edgeadapt.export import UnsupportedOpError, onnx_export

    monkeypatch.setattr(onnx_export, "fit_for_ort_gradients", lambda model: None)
    with pytest.raises(UnsupportedOpError, match=r"'Conv' in module dw: .*ConvGrad writes past .*1-D kernel"):
        export_bundle(make_cnn(), EXAMPLE, tmp_path / "b", policy=UpdatePolicy.full())
    assert not (tmp_path / "b").exists()


def test_session_setting_is_recorded(cnn_bundle):
    manifest = read_manifest(cnn_bundle)
    assert isinstance(manifest.session["enable_mem_pattern"], bool)


def test_channel_ratio_of_one_is_a_full_update(tmp_path):
    export_bundle(make_cnn(), EXAMPLE, tmp_path / "b",
                  policy=UpdatePolicy(rules=(Rule("conv2", "channels", ratio=1.0), Rule("head", "full"))))
    entries = {p.name: p for p in read_manifest(tmp_path / "b").parameters}
    assert entries["conv2.weight"].mode == "full" and not entries["conv2.weight"].is_split
    assert entries["conv2.weight"].trainable_numel == 12 * 8 * 3


class _NormBeforeHead(nn.Module):
    """Conv features pooled over time, a BatchNorm on them, a linear head."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(4, 8, 3, padding=1)
        self.bn = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.bn(torch.relu(self.conv(x)).mean(-1)))


def test_budget_plan_training_a_norm_weight_without_its_bias_records_its_rules(tmp_path):
    """Under a budget too small for both, the planner trains a BatchNorm's weight alone; the
    manifest's policy must still say exactly what trains (it once fell back to an empty policy)."""
    from edgeadapt.export.planning import model_graph
    from edgeadapt.export.prepare import prepare_model
    from edgeadapt.sched import minimum_budget, plan_for_budget

    torch.manual_seed(0)
    model = as_if_pretrained(_NormBeforeHead()).eval()
    importance = {"bn.weight": 1.0, "bn.bias": 0.5}
    graph, _ = model_graph(model, EXAMPLE, "frozen")
    sizes = dict(n_windows=16, batch_windows=8, importance=importance)
    low = minimum_budget(graph, **sizes) - 1
    budget = 2 * low
    while not plan_for_budget(graph, budget, **sizes).param("bn.weight").trains:
        low, budget = budget, 2 * budget
    while budget - low > 1:  # the smallest budget that trains the weight: no room for the bias too
        mid = (low + budget) // 2
        low, budget = (low, mid) if plan_for_budget(graph, mid, **sizes).param("bn.weight").trains else (mid, budget)
    manifest = export_bundle(model, EXAMPLE, tmp_path / "b", memory_budget=budget, **sizes)
    trained = {p.name for p in manifest.parameters if p.trainable_numel}
    assert "bn.weight" in trained and "bn.bias" not in trained
    policy = UpdatePolicy.from_dict(manifest.policy)
    assert Rule("bn", "full", params=("weight",)) in policy.rules
    assert {e.name for e in prepare_model(model, policy).entries if e.trainable_numel} == trained
