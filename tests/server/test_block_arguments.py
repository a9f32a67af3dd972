"""A block holds its arguments until its backward: an argument the model's own code made (scaled,
pooled, a mask built in the forward) is neither a block's output nor the batch, so the trace plans
it and the trainer charges it with what the code between blocks saves."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from server_helpers import Scaled
from torch import nn

from edgeadapt.sched import NoFeasiblePlan
from edgeadapt.server import Trainer, trace_graph
from edgeadapt.server.trainer import plan_training


@pytest.mark.parametrize("batch", [1, 4])
def test_the_trace_plans_arguments_the_model_made(batch):
    x = torch.randn(batch, 12)
    made = trace_graph(Scaled(), x, device="cpu").outside_saved_bytes
    plain = trace_graph(Scaled(own_code=False), x, device="cpu").outside_saved_bytes
    # per window: three scaled inputs (64 floats each) and the gate (1 float), held once
    assert plain == 0
    assert made == 3 * 64 * 4 + 4


@pytest.mark.parametrize("offload,recompute", [("host", False), ("disk", True), ("host", "auto")])
def test_the_trainer_charges_arguments_the_model_made(tmp_path, offload, recompute):
    torch.manual_seed(0)
    model, batch = Scaled(), 8
    x, y = torch.randn(batch, 12), torch.randint(0, 5, (batch,))
    trainer = Trainer(model, loss="cross_entropy", optimizer={"name": "adamw", "lr": 1e-3}, memory_budget="4MiB",
                      offload=offload, offload_dir=tmp_path, device="cpu", recompute=recompute, example_input=x)
    seen = []
    # at the head's forward every layer has run: the three scaled inputs and the gate are charged
    model.head.register_forward_hook(lambda *_: seen.append(trainer.ledger.held("activations:outside")))
    trainer.step(x, y)
    assert seen == [batch * (3 * 64 * 4 + 4)]
    assert trainer.tracked_peak_bytes <= trainer.plan.predicted.peak_bytes
    trainer.close()


@pytest.mark.parametrize("offload", ["host", "disk"])
def test_an_input_and_target_over_one_array_are_charged_once(tmp_path, offload):
    # an autoencoder's input and target made from one numpy array: two storages over the same
    # memory, which the batch's charge already covers (never charged again as an activation)
    arr = np.random.default_rng(0).standard_normal((32, 64)).astype(np.float32)
    x, y = torch.from_numpy(arr), torch.from_numpy(arr)

    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(64, 16), nn.Linear(16, 64))

    with pytest.raises(NoFeasiblePlan) as e:
        plan_training(make(), x, offload=offload, memory_budget=100, device="cpu", recompute=False, loss="mse",
                      example_target=y)
    trainer = Trainer(make(), loss="mse", optimizer={"name": "adamw", "lr": 1e-3}, memory_budget=e.value.need_bytes,
                      offload=offload, offload_dir=tmp_path, device="cpu", recompute=False, example_input=x)
    trainer.step(x, y)
    assert trainer.tracked_peak_bytes <= trainer.plan.predicted.peak_bytes
    trainer.close()
