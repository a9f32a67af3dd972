"""The loss's bytes in the plan and the ledger: measured on the meta device, planned as the phase
``loss``, reserved while the loss's backward runs."""

from __future__ import annotations

import pytest
import torch
from server_helpers import batches, make_mlp
from torch import nn

from edgeadapt.models import build_gpt, token_cross_entropy
from edgeadapt.sched.offload import block_costs, offload_peak
from edgeadapt.server import Trainer
from edgeadapt.server.loss_memory import LiveBytes, loss_memory
from edgeadapt.server.residency import LOSS_KEY
from edgeadapt.server.trace import trace_graph
from edgeadapt.server.trainer import plan_training


def test_live_bytes_follow_creation_and_free_and_ignore_aliases():
    a = torch.empty(10, 10, device="meta")
    with LiveBytes() as mode:
        b = a * 2                 # 400 bytes
        c = b.view(100)           # an alias: nothing new
        d = b.detach()            # an alias: nothing new
        e = a + 1                 # 400 more
        assert mode.now_bytes == 800
        del b, c
        assert mode.now_bytes == 800  # d still holds b's storage
        del d
        assert mode.now_bytes == 400
        del e
    assert (mode.now_bytes, mode.peak_bytes) == (0, 800)


def test_token_cross_entropy_holds_three_logit_sized_tensors():
    # forward: log-probabilities (saved); backward: their gradient (nll_loss_backward) and the
    # logits' gradient (log_softmax_backward) beside them
    b, t, v = 3, 16, 1000
    logits = b * t * v * 4
    got = loss_memory(token_cross_entropy, torch.empty(b, t, v), "class")
    assert logits <= got.saved_bytes <= logits + 64            # + the loss value and the weight sum
    assert 3 * logits <= got.peak_bytes <= 3 * logits + 64


def test_targets_of_each_kind_and_a_loss_that_takes_neither():
    out = torch.empty(8, 5)
    assert loss_memory(nn.functional.mse_loss, out, "like").peak_bytes >= 8 * 5 * 4  # the output's gradient
    assert loss_memory(nn.functional.cross_entropy, out, torch.zeros(8, dtype=torch.long)).saved_bytes >= 8 * 5 * 4

    def needs_a_pair(out, target):
        if target.dim() != 2 or target.shape[1] != 2:
            raise ValueError("targets are (window, 2)")
        return (out[:, :2] - target).pow(2).mean()

    assert loss_memory(needs_a_pair, out, None) is None  # neither guess is a pair: left to the first batch


def test_the_plan_holds_the_loss_beside_every_activation():
    model = build_gpt("gpt-nano", vocab_size=2048, context_len=32)
    x = torch.zeros(8, 32, dtype=torch.long)
    graph = trace_graph(model, x, loss_fn=token_cross_entropy, target="class")
    assert graph.loss_peak_bytes == pytest.approx(3 * 32 * 2048 * 4, abs=64)  # per window
    costs = block_costs(graph, 8)
    keep = [False] * len(costs)
    fixed = graph.input_bytes * 8
    without = offload_peak(costs, keep, 1, fixed_bytes=fixed)
    with_loss = offload_peak(costs, keep, 1, fixed_bytes=fixed, loss_saved_bytes=graph.loss_saved_bytes * 8,
                             loss_peak_bytes=graph.loss_peak_bytes * 8)
    # every block's output and saved activations, and the loss's bytes on top
    acts = sum(c.output_bytes + c.saved_bytes for c in costs if not c.resident)
    assert with_loss.phases_bytes["loss"] >= fixed + acts + graph.loss_peak_bytes * 8
    assert with_loss.peak_bytes > without.peak_bytes
    no_prefetch = offload_peak(costs, keep, 0, fixed_bytes=fixed, loss_peak_bytes=graph.loss_peak_bytes * 8)
    assert no_prefetch.phases_bytes["loss"] == fixed + acts + graph.loss_peak_bytes * 8  # nothing prefetched
    # the step holds the targets (a token id per position) beside the input
    assert graph.input_bytes == 2 * 32 * 8
    assert graph.loss_saved_bytes > 0 and graph.to_dict()["loss_peak_bytes"] == graph.loss_peak_bytes
    # a budget that fitted the whole batch before the loss was counted now splits it
    plain = plan_training(model, x, offload="host", memory_budget=None, device="cpu", loss=token_cross_entropy,
                          example_target=x)
    assert plain.predicted.phases_bytes["loss"] >= graph.loss_peak_bytes * 8
    tight = plan_training(model, x, offload="disk", memory_budget=without.peak_bytes + 1024, device="cpu",
                          loss=token_cross_entropy, example_target=x, recompute=False)
    assert tight.micro_batch_windows < 8 and tight.predicted.peak_bytes <= without.peak_bytes + 1024


def test_the_ledger_holds_the_loss_transients_until_the_first_block_backward(tmp_path):
    data = batches("mlp", 2, batch=16)
    model = make_mlp(width=32, depth=3, n_classes=512)  # a wide head: the loss outweighs a block
    t = Trainer(model, optimizer={"name": "adamw", "lr": 1e-2}, offload="disk", offload_dir=tmp_path,
                device="cpu", example_input=data[0][0])
    graph = t._graph
    transient = (graph.loss_peak_bytes - graph.loss_saved_bytes) * 16
    assert transient >= 2 * 16 * 512 * 4  # the log-probabilities' and the logits' gradients
    during, at_first_block = [], []
    reserve = t.ledger.reserve

    def watch(key, nbytes):
        if key == LOSS_KEY:
            during.append(nbytes)
        elif key == "grads:head":  # the last block's backward, the first to run
            at_first_block.append(t.ledger.held(LOSS_KEY))
        return reserve(key, nbytes)

    t.ledger.reserve = watch
    for x, y in data:
        t.step(x, y)
    assert during == [transient] * len(data)
    assert at_first_block == [0] * len(data)  # released as the first block's backward began
    assert t.ledger.held(LOSS_KEY) == 0
    assert t.tracked_peak_bytes >= transient
    t.close()


def test_a_loss_the_meta_device_cannot_run_is_named(caplog):
    def needs_values(out, target):
        return out.sum() * float(target.float().mean())  # reads a value: impossible on the meta device

    x, y = batches("mlp", 1, batch=8)[0]
    with caplog.at_level("WARNING"):
        graph = trace_graph(make_mlp(width=16, depth=2), x, loss_fn=needs_values, target=y)
    assert graph.loss_peak_bytes == 0 and "its memory is not in the plan" in caplog.text


def test_a_custom_loss_is_measured_again_with_the_first_batch(tmp_path):
    data = batches("mlp", 1, batch=8)

    def paired(out, target):  # targets the guesses cannot stand in for
        return nn.functional.cross_entropy(out, target[:, 0]) + 0 * target[:, 1].float().mean()

    y = torch.stack([data[0][1], data[0][1]], 1)
    t = Trainer(make_mlp(width=16, depth=2), loss=paired, optimizer={"name": "adamw", "lr": 1e-2}, offload="host",
                device="cpu", example_input=data[0][0])
    assert t._graph.loss_peak_bytes == 0  # not measurable before the targets are seen
    t.step(data[0][0], y)
    assert t._graph.loss_peak_bytes >= 5 * 4  # per window: at least the output's gradient
    t.close()


@pytest.mark.parametrize("offload,recompute", [("host", True), ("disk", True), ("host", "auto")])
def test_budgets_at_and_just_above_the_smallest_the_planner_names_hold_at_run_time(offload, recompute, tmp_path):
    # micro-batches with the loss the largest phase: what does not grow with the batch (the loss value,
    # the reduction's weight sum, positions built in the forward) must be planned once per micro-batch
    from edgeadapt.sched import NoFeasiblePlan

    # batch 8: the positions the model builds for itself (128 int64) do not grow with it either
    x, y = (torch.randint(0, 4096, (8, 128), generator=torch.Generator().manual_seed(s)) for s in (1, 2))

    def make():
        torch.manual_seed(0)
        return build_gpt("gpt-nano", vocab_size=4096, context_len=128, n_layers=2)

    with pytest.raises(NoFeasiblePlan) as e:
        plan_training(make(), x, offload=offload, memory_budget=1000, device="cpu", recompute=recompute,
                      loss=token_cross_entropy, example_target=y)
    for budget in (e.value.need_bytes, e.value.need_bytes + 1000, e.value.need_bytes + 50_000):
        t = Trainer(make(), loss=token_cross_entropy, optimizer={"name": "adamw", "lr": 1e-3}, memory_budget=budget,
                    offload=offload, offload_dir=tmp_path / str(budget), device="cpu", recompute=recompute,
                    example_input=x)
        assert t._plan_for(8).micro_batch_windows < 8
        t.step(x, y)
        assert t.tracked_peak_bytes <= t.plan.predicted.peak_bytes <= budget
        t.close()
