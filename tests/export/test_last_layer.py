"""The default ``last-layer`` policy trains the model's final trainable layer, whatever its name."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from edgeadapt.export import UpdatePolicy, export_bundle
from edgeadapt.sched.policy import LAST_LAYER


class _Classifier(nn.Module):
    """Conv-BN-ReLU, pooling, then a linear layer called ``name`` (not ``head``)."""

    def __init__(self, name: str):
        super().__init__()
        self.conv = nn.Conv1d(4, 8, 5, padding=2)
        self.bn = nn.BatchNorm1d(8)
        self.name = name
        setattr(self, name, nn.Linear(8, 3))

    def forward(self, x):
        return getattr(self, self.name)(torch.relu(self.bn(self.conv(x))).mean(-1))


class ConvGRU(nn.Module):
    """Conv front end, a GRU over time, the last hidden state into a linear ``out``."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(4, 8, 5, padding=2)
        self.gru = nn.GRU(8, 16, batch_first=True)
        self.out = nn.Linear(16, 3)

    def forward(self, x):
        y, _ = self.gru(torch.relu(self.conv(x)).transpose(1, 2))
        return self.out(y[:, -1])


class _TwoHeads(nn.Module):
    """Two linear layers whose outputs are summed: no single last layer."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(4, 8, 5, padding=2)
        self.left = nn.Linear(8, 3)
        self.right = nn.Linear(8, 3)

    def forward(self, x):
        h = torch.relu(self.conv(x)).mean(-1)
        return self.left(h) + self.right(h)


def _trained(manifest) -> set[str]:
    return {p.name for p in manifest.parameters if p.trainable_numel}


@pytest.mark.parametrize("model, layer", [(_Classifier("classifier"), "classifier"), (_Classifier("fc"), "fc"),
                                          (ConvGRU(), "out")], ids=["classifier", "fc", "ConvGRU"])
@pytest.mark.parametrize("policy", [None, "last-layer"])
def test_the_last_layer_policy_trains_the_layer_nearest_the_output(tmp_path, model, layer, policy):
    torch.manual_seed(0)
    manifest = export_bundle(model, torch.randn(4, 4, 32), tmp_path / "b",
                             policy=None if policy is None else UpdatePolicy.parse(policy))
    assert _trained(manifest) == {f"{layer}.weight", f"{layer}.bias"}
    assert manifest.trainable_numel == sum(p.numel() for p in getattr(model, layer).parameters())
    # the manifest records the rule that was applied, not the placeholder
    assert manifest.policy["rules"] == [{"pattern": layer, "mode": "full"}]
    assert LAST_LAYER not in str(manifest.plan)


def test_an_explicit_layer_name_still_wins(tmp_path):
    manifest = export_bundle(_Classifier("fc"), torch.randn(4, 4, 32), tmp_path / "b",
                             policy=UpdatePolicy.last_layer("conv"))
    assert _trained(manifest) == {"conv.weight", "conv.bias"}


def test_two_layers_feeding_the_output_name_the_rule_to_write(tmp_path):
    with pytest.raises(ValueError, match=r"cannot tell the last layer.*'left', 'right'.*--policy 'right=full'"):
        export_bundle(_TwoHeads(), torch.randn(4, 4, 32), tmp_path / "b")
    assert not (tmp_path / "b").exists()
    # the rule the message names exports
    manifest = export_bundle(_TwoHeads(), torch.randn(4, 4, 32), tmp_path / "c",
                             policy=UpdatePolicy.parse("right=full"))
    assert _trained(manifest) == {"right.weight", "right.bias"}


def test_a_budget_with_the_last_layer_policy_resolves_it_too(tmp_path):
    manifest = export_bundle(_Classifier("classifier"), torch.randn(4, 4, 32), tmp_path / "b",
                             policy=UpdatePolicy.last_layer(), memory_budget="64MiB", n_windows=8, batch_windows=4)
    assert _trained(manifest) == {"classifier.weight", "classifier.bias"}
