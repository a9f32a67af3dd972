"""A streamed step is whole or refused: a failure part-way leaves no trainer that could go on from
part-updated state, the taken-over model cannot be trained behind the trainer's back, and a
closed trainer says so."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from server_helpers import MLPBlock, batches, make_mlp

from edgeadapt.server import Trainer

FAIL = {"on": False}


class _FailInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        if FAIL["on"]:
            raise RuntimeError("injected failure in a block's backward")
        return g


class FailingBlock(MLPBlock):
    """An MLP block whose backward raises while ``FAIL["on"]``."""

    def forward(self, x):
        return super().forward(_FailInBackward.apply(x))


@pytest.mark.parametrize("offload", ["host", "disk", None])
def test_a_step_failing_after_some_blocks_were_updated_leaves_a_trainer_that_refuses_to_go_on(offload, tmp_path,
                                                                                              adamw):
    data = batches("mlp", 3)
    t = Trainer(make_mlp(depth=4, block=FailingBlock), optimizer=adamw, offload=offload, offload_dir=tmp_path / "s",
                device="cpu", memory_budget="1MiB" if offload else None, example_input=data[0][0])
    t.step(*data[0])
    before = {k: v.clone() for k, v in t.model().state_dict().items()}
    FAIL["on"] = True
    try:
        with pytest.raises(RuntimeError, match="injected failure") as e:
            t.step(*data[1])
    finally:
        FAIL["on"] = False
    after = t.model().state_dict()
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    if offload is None:  # one optimizer step after the whole backward: nothing applied, training goes on
        assert changed == [] and t.step_count == 1
        t.step(*data[1])
        return
    # the blocks after layers.0 in the forward had their backward, and their update, before it failed
    assert changed and all(not k.startswith("proj.") for k in changed)
    assert any("part old, part new" in n for n in e.value.__notes__)
    with pytest.raises(RuntimeError, match="cannot run: step 2 failed .RuntimeError. after updating"):
        t.step(*data[2])
    with pytest.raises(RuntimeError, match="Trainer.resume"):
        t.save_checkpoint(tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()
    t.close()


@pytest.mark.parametrize("offload", ["host", "disk"])
def test_the_taken_over_model_refuses_a_forward_with_gradients_outside_a_step(offload, tmp_path):
    x, y = batches("mlp", 1)[0]
    model = make_mlp(depth=2)
    with Trainer(model, offload=offload, offload_dir=tmp_path / "s", device="cpu", example_input=x) as t:
        t.step(x, y)
        before = t.model().state_dict()
        with pytest.raises(RuntimeError, match="outside Trainer.step"):
            model(x).sum().backward()
        model.eval()
        with torch.no_grad():
            out = model(x)  # inference streams the weights and updates nothing
        assert np.allclose(out.numpy(), t.predict(x).numpy(), rtol=0, atol=0)
        assert all(torch.equal(before[k], v) for k, v in t.model().state_dict().items())
        t.step(x, y)  # and training goes on


@pytest.mark.parametrize("offload", ["host", "disk", None])
def test_a_closed_trainer_says_so(offload, tmp_path):
    x, y = batches("mlp", 1)[0]
    t = Trainer(make_mlp(depth=2), offload=offload, offload_dir=tmp_path / "s", device="cpu", example_input=x)
    t.step(x, y)
    t.close()
    with pytest.raises(RuntimeError, match="cannot run: it was closed"):
        t.step(x, y)
    with pytest.raises(RuntimeError, match="it was closed"):
        t.save_checkpoint(tmp_path / "ckpt")


@pytest.mark.parametrize("offload", ["host", "disk", None])
def test_a_closed_trainer_refuses_its_model_and_predict_and_the_taken_over_model_says_why(offload, tmp_path):
    x, y = batches("mlp", 1)[0]
    model = make_mlp(depth=2)
    with Trainer(model, offload=offload, offload_dir=tmp_path / "s", device="cpu", example_input=x) as t:
        t.step(x, y)
    t.close()  # a second close (after the with block's) does nothing
    for call in (t.model, lambda: t.predict(x), t.state_dict, lambda: t.block_state(0)):
        with pytest.raises(RuntimeError, match="cannot .*: it was closed .*before closing it"):
            call()
    if offload is None:  # trained in place: the model is the caller's ordinary module
        model(x)
        return
    for grad in (False, True):  # its weights went with the trainer: a clear error, not one from the closed store
        with torch.set_grad_enabled(grad), pytest.raises(RuntimeError, match="taken over by a Trainer that was "
                                                                             "closed.*Trainer.model"):
            model(x)


def test_the_process_baseline_is_taken_after_a_lazy_trace(monkeypatch):
    import edgeadapt.server.trainer as trainer_module

    kept = []
    real = trainer_module.trace_graph

    def tracing_that_keeps_memory(*args, **kwargs):  # as the first trace's lazily built state does
        kept.append(np.ones(32 * 2**20 // 8))  # 32 MiB, touched
        return real(*args, **kwargs)

    monkeypatch.setattr(trainer_module, "trace_graph", tracing_that_keeps_memory)
    x, y = batches("mlp", 1)[0]
    with Trainer(make_mlp(depth=2), offload="host", device="cpu") as t:  # no example_input: traced at step 1
        t.step(x, y)
        assert kept and t.process_peak_bytes < 16 * 2**20


def test_a_weight_buffer_that_cannot_be_allocated_leaves_nothing_reserved(tmp_path, monkeypatch):
    from edgeadapt.server.coordinator import ResidencyCoordinator

    real, calls = ResidencyCoordinator._compute_buffer, []

    def failing_once(self, slot):
        calls.append(slot.name)
        if len(calls) == 2:  # the second block's weights, in the forward, before any update
            raise MemoryError("simulated: no memory for the block's weights")
        return real(self, slot)

    monkeypatch.setattr(ResidencyCoordinator, "_compute_buffer", failing_once)
    data = batches("mlp", 2, batch=16)
    t = Trainer(make_mlp(width=32, depth=3), optimizer={"name": "adamw", "lr": 1e-2}, offload="disk",
                offload_dir=tmp_path, device="cpu", example_input=data[0][0])
    with pytest.raises(MemoryError, match="simulated"):
        t.step(*data[0])
    assert t.ledger.held("weights:") == 0
    t.step(*data[1])  # the next step runs within the budget's account, nothing counted twice
    assert t.ledger.held("weights:") == 0
    t.close()
