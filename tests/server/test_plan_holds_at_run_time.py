"""What the planner accepts, the step holds: on seeded random models, tiers and recompute
settings, at the smallest budget the planner names and just above it, the trainer's tracked peak
never exceeds the plan's prediction (nor the budget: no BudgetExceeded). The models: residual
MLPs with a wide or narrow head, a model with parameters and dropout in its own code, a CNN, and
models whose own code does what the blocks do not show: a tuple output, a table built in the
forward that does not grow with the batch, a final output made after the last block, a saved
buffer, blocks called on tensors the model made, recurrent layers, and a GPT with dropout in
attention (saved pieces of a larger tensor)."""

from __future__ import annotations

import random

import pytest
import torch
from server_helpers import Recurrent, Scaled, make_cnn, make_mlp, make_root
from torch import nn

from edgeadapt.models import build_gpt, token_cross_entropy
from edgeadapt.sched import NoFeasiblePlan
from edgeadapt.server import Trainer
from edgeadapt.server.trainer import plan_training


class TupleOut(nn.Module):
    """Returns (logits, features); the loss reads the logits."""

    def __init__(self, width: int = 32, n_classes: int = 300):
        super().__init__()
        self.proj = nn.Linear(12, width)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(2))
        self.head = nn.Linear(width, n_classes)

    def forward(self, x):
        x = self.proj(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x), x


def tuple_loss(out, y):
    return nn.functional.cross_entropy(out[0], y)


class OwnCode(nn.Module):
    """Between the blocks: a table built in the forward (the same for any batch), a saved buffer,
    and a final output made after the last block."""

    def __init__(self, width: int = 16, steps: int = 64, n_classes: int = 20):
        super().__init__()
        self.register_buffer("window", torch.hann_window(steps)[:, None].repeat(1, width).contiguous())
        self.proj = nn.Linear(4, width)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(2))
        self.head = nn.Linear(width, n_classes)

    def forward(self, x):  # (batch, steps, 4)
        pos = torch.arange(x.shape[1], dtype=torch.float32, device=x.device)[:, None] / x.shape[1]
        h = self.proj(x) * self.window * torch.cos(pos)
        for layer in self.layers:
            h = layer(h)
        return self.head(h).mean(1) * 2.0


def _seeded(factory, **kw):
    def make():
        torch.manual_seed(0)
        return factory(**kw)
    return make


def _case(rng: random.Random):
    batch = rng.randint(2, 12)
    kind = rng.choice(["mlp", "root", "cnn", "tuple", "own", "gpt", "scaled", "recurrent"])
    if kind == "recurrent":  # a CPU LSTM keeps a workspace no shape trace sees
        cell, width = rng.choice(["lstm", "gru", "rnn"]), rng.choice([8, 32])
        return _seeded(Recurrent, kind=cell, width=width), torch.randn(batch, 12, 4), torch.randint(0, 5, (batch,)), \
            "cross_entropy"
    if kind == "scaled":  # blocks called on tensors the model's own code made, and a keyword mask
        width, depth = rng.choice([16, 64]), rng.randint(1, 3)
        return _seeded(Scaled, width=width, depth=depth), torch.randn(batch, 12), torch.randint(0, 5, (batch,)), \
            "cross_entropy"
    if kind == "tuple":
        return _seeded(TupleOut), torch.randn(batch, 12), torch.randint(0, 300, (batch,)), tuple_loss
    if kind == "own":
        return _seeded(OwnCode), torch.randn(batch, 64, 4), torch.randint(0, 20, (batch,)), "cross_entropy"
    if kind == "gpt":
        vocab, context = rng.choice([64, 512]), rng.choice([16, 32])
        make = _seeded(build_gpt, name="gpt-nano", vocab_size=vocab, context_len=context, n_layers=2, dropout_p=0.1)
        ids = torch.randint(0, vocab, (batch, context + 1))
        return make, ids[:, :-1], ids[:, 1:], token_cross_entropy
    return (*_plain_case(rng, kind, batch), "cross_entropy")


def _plain_case(rng: random.Random, kind: str, batch: int):
    if kind == "mlp":
        kw = dict(width=rng.choice([16, 32, 64]), depth=rng.randint(1, 4), n_classes=rng.choice([5, 64, 300]))
        return (lambda: make_mlp(**kw)), torch.randn(batch, 12), torch.randint(0, kw["n_classes"], (batch,))
    if kind == "root":
        width = rng.choice([16, 32])
        return (lambda: make_root(width=width)), torch.randn(batch, 12), torch.randint(0, 5, (batch,))
    return make_cnn, torch.randn(batch, 4, 16), torch.randint(0, 3, (batch,))


@pytest.mark.parametrize("seed", range(8))
def test_budgets_the_planner_accepts_hold_in_the_step(seed, tmp_path):
    rng = random.Random(seed)
    for case in range(4):
        make, x, y, loss = _case(rng)
        offload, recompute = rng.choice(["host", "disk"]), rng.choice([True, False, "auto"])
        with pytest.raises(NoFeasiblePlan) as e:
            plan_training(make(), x, offload=offload, memory_budget=100, device="cpu", recompute=recompute,
                          loss=loss, example_target=y)
        need = e.value.need_bytes
        for budget in (need, need + rng.randint(1, 2000), int(need * 1.3)):
            t = Trainer(make(), loss=loss, optimizer={"name": "adamw", "lr": 1e-3}, memory_budget=budget,
                        offload=offload, offload_dir=tmp_path / f"{case}-{budget}", device="cpu",
                        recompute=recompute, example_input=x)
            t.step(x, y)
            assert t.tracked_peak_bytes <= t.plan.predicted.peak_bytes <= budget, (offload, recompute, budget)
            t.close()
