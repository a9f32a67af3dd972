"""A plan is made for windows of one shape: a later batch of longer sequences is planned again
(traced anew) instead of running on the short sequences' plan, and a shape met before reuses
its graph and plans."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from edgeadapt.sched import NoFeasiblePlan
from edgeadapt.server import Trainer
from edgeadapt.server.trainer import plan_training


def make():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(6)], nn.Linear(16, 3))


def batch(length: int):
    g = torch.Generator().manual_seed(length)
    return torch.randn(8, length, 16, generator=g), torch.randint(0, 3, (8, length), generator=g)


def loss(out, y):  # a per-position classification: the batch's sequences share no term
    return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


@pytest.mark.parametrize("offload", ["host", "disk"])
def test_longer_sequences_are_planned_again_within_the_budget(tmp_path, offload):
    x_long, y_long = batch(256)
    with pytest.raises(NoFeasiblePlan) as e:  # the least budget a batch of long sequences needs
        plan_training(make(), x_long, offload=offload, memory_budget=100, device="cpu", recompute="auto",
                      loss=loss, example_target=y_long)
    budget = e.value.need_bytes
    trainer = Trainer(make(), loss=loss, optimizer={"name": "adamw", "lr": 1e-3}, memory_budget=budget,
                      offload=offload, offload_dir=tmp_path, device="cpu")
    x_short, y_short = batch(8)
    trainer.step(x_short, y_short)
    short_micro = trainer.plan.micro_batch_windows
    trainer.step(x_long, y_long)  # the short sequences' plan would not fit: planned again
    long_micro = trainer.plan.micro_batch_windows
    assert long_micro < short_micro == 8
    assert trainer.tracked_peak_bytes <= budget
    short_graph = next(iter(trainer._other_shapes.values()))[0]
    trainer.step(x_short, y_short)  # a shape met before: its graph and plan come back, no new trace
    assert trainer.plan.micro_batch_windows == short_micro and trainer._graph is short_graph
    trainer.close()
