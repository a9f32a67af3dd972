"""Parameters outside every block (on the root module, on a top-level container): the root block.

They form one more block, held in the compute tier for the whole step: loaded by a forward
pre-hook on the model, updated on the CPU after the backward, counted by the planner.
"""

from __future__ import annotations

import pytest
import torch
from server_helpers import batches, make_root, reference_train
from torch import nn

from edgeadapt.sched.offload import RESIDENT_KIND, BlockTooLarge, plan_offload
from edgeadapt.server import BlockError, Trainer, find_blocks, trace_graph
from edgeadapt.server.trace import ROOT_BLOCK


def test_parameters_outside_blocks_form_the_root_block_first():
    blocks = find_blocks(make_root())
    assert [b.name for b in blocks] == [ROOT_BLOCK, "proj", "layers.0", "layers.1", "layers.2", "head"]
    root = blocks[0]
    assert root.resident and not any(b.resident for b in blocks[1:])
    assert root.param_names == ("pos", "gate", "layers.bias") == root.local_names
    assert [tuple(p.shape) for p in root.parameters()] == [(16,), (), (16,)]
    assert blocks[2].local_names == ("fc.weight", "fc.bias") and blocks[2].full_name("fc.bias") == "layers.0.fc.bias"

    class OnlyRoot(nn.Module):  # nothing but root parameters: one block, the root block
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(3))

        def forward(self, x):
            return x * self.w

    assert [(b.name, b.param_names) for b in find_blocks(OnlyRoot())] == [(ROOT_BLOCK, ("w",))]
    seq = nn.Sequential(nn.Linear(3, 3))
    seq.register_parameter("scale", nn.Parameter(torch.ones(3)))  # a root that is itself a container
    assert [(b.name, b.param_names) for b in find_blocks(seq)] == [(ROOT_BLOCK, ("scale",)),
                                                                   ("0", ("0.weight", "0.bias"))]


def test_a_root_parameter_tied_to_a_block_weight_is_refused():
    model = make_root()
    model.head_w = model.head.weight
    with pytest.raises(BlockError, match="tied"):
        find_blocks(model)


def test_the_graph_and_the_plan_hold_the_root_block_for_the_whole_step():
    model = make_root()
    x = torch.randn(8, 12)
    g = trace_graph(model, x)
    root = g.ops[0]
    assert (root.name, root.kind, root.params) == (ROOT_BLOCK, RESIDENT_KIND, ("pos", "gate", "layers.bias"))
    assert root.output_bytes == root.saved_bytes == 0
    # the root's own code saves for the backward (dropout's mask, the gated sums): planned too
    assert g.outside_saved_bytes > 0
    assert g.ops[1].inputs == ()  # the first streamed block reads the model input
    assert {p.name: p.module_type for p in g.params}["pos"] == "RootModel"
    assert {p.name: p.module for p in g.params}["layers.bias"] == "layers"
    root_bytes = 4 * (16 + 1 + 16)

    plan = plan_offload(g, 10**6, batch_windows=8, tier="disk", prefetch_depth=1)
    assert plan.order == ("proj", "layers.0", "layers.1", "layers.2", "head")
    assert ROOT_BLOCK not in dict(plan.activations)
    assert {p.name for p in plan.params} == {p.name for p in g.params}
    # without the root block the same step is lower by its weights and gradients, everywhere
    from edgeadapt.sched import Graph

    streamed = Graph(g.ops[1:], tuple(p for p in g.params if p.name not in root.params), g.input_bytes, g.name,
                     outside_saved_bytes=g.outside_saved_bytes)
    bare = plan_offload(streamed, 10**6, batch_windows=8, tier="disk", prefetch_depth=1).predicted
    assert plan.predicted.peak_bytes == bare.peak_bytes + 2 * root_bytes
    assert plan.predicted.phases_bytes["update"] >= 2 * root_bytes
    # a budget that cannot hold a large root block (with its staged state) names it
    from edgeadapt.sched import Op, Param

    big = Graph((Op(ROOT_BLOCK, RESIDENT_KIND, params=("emb",)), Op("b0", "block", params=("b0.w",), output_bytes=4)),
                (Param("emb", (4096,)), Param("b0.w", (16,))), input_bytes=4)
    assert plan_offload(big, 8 * 4096 * 4, tier="host").predicted.peak_bytes >= 2 * 4096 * 4
    with pytest.raises(BlockTooLarge, match="outside every block") as e:
        plan_offload(big, 3 * 4096 * 4, tier="disk")   # weights + gradients + staged state: 6x
    assert e.value.block == ROOT_BLOCK


@pytest.mark.parametrize("offload,recompute", [("host", False), ("disk", False), ("disk", True), (None, False)])
def test_training_with_root_parameters_is_bit_identical_to_plain_torch(offload, recompute, adamw, tmp_path):
    data = batches("mlp", 3)
    ref = reference_train(make_root(), data)
    model = make_root()
    torch.manual_seed(123)  # as reference_train: the dropout masks come from the same generator state
    t = Trainer(model, optimizer=adamw, memory_budget="1MiB", offload=offload, offload_dir=tmp_path / "state",
                device="cpu", recompute=recompute, example_input=data[0][0], update_chunk_numel=100)
    for x, y in data:
        t.step(x, y)
    got, want = t.model().state_dict(), ref.state_dict()
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), f"{k} differs by {(got[k] - want[k]).abs().max()}"
    # the trained copy is an ordinary module: no hook of the trainer's left on it
    copy = t.model()
    assert not copy._forward_pre_hooks
    assert torch.equal(copy.eval()(data[0][0]), t.predict(data[0][0]))
    t.close()


@pytest.mark.parametrize("offload", ["host", "disk"])
def test_tracked_peak_with_a_root_block_stays_under_the_budget(offload, adamw, tmp_path):
    data = batches("mlp", 2, batch=4)
    probe = Trainer(make_root(width=64, depth=6), optimizer=adamw, offload=offload, offload_dir=tmp_path / "p",
                    device="cpu", example_input=data[0][0])
    need = probe.plan.predicted.peak_bytes
    probe.close()
    budget = need  # what the root's own code keeps (dropout mask, sums) is planned too
    t = Trainer(make_root(width=64, depth=6), optimizer=adamw, memory_budget=budget, offload=offload,
                offload_dir=tmp_path / "s", device="cpu", example_input=data[0][0])
    root_bytes = 4 * (64 + 1 + 64)
    assert t.plan.predicted.peak_bytes <= budget
    held = []
    t._model.head.register_forward_hook(
        lambda *_: held.append((t.ledger.held(f"weights:{ROOT_BLOCK}"), t.ledger.held(f"grads:{ROOT_BLOCK}"))))
    for x, y in data:
        t.step(x, y)
        r = t.residency()
        assert r["blocks"][ROOT_BLOCK] == "offloaded" and set(r["blocks"].values()) == {"offloaded"}
        assert r["tiers"]["compute"] == t.buffer_bytes  # root weights and gradients released after the step
    # weights and gradients reserved for the whole step; a CPU run from the host tier computes on the master
    # weights in place (no compute-tier copy)
    assert held == [(0 if offload == "host" else root_bytes, root_bytes)] * len(data)
    assert 0 < t.tracked_peak_bytes <= budget
    t.close()


def test_a_root_block_checkpoint_resumes_bit_identically(adamw, tmp_path):
    data = batches("mlp", 4)
    kw = dict(optimizer=adamw, offload="disk", offload_dir=tmp_path / "state", device="cpu")
    torch.manual_seed(5)
    straight = Trainer(make_root(), **kw)
    for x, y in data:
        straight.step(x, y)
    want = straight.model().state_dict()
    straight.close()
    torch.manual_seed(5)
    first = Trainer(make_root(), **kw)
    for x, y in data[:2]:
        first.step(x, y)
    first.save_checkpoint(tmp_path / "ckpt")
    first.close()
    resumed = Trainer.resume(tmp_path / "ckpt", make_root(seed=9), **kw)
    for x, y in data[2:]:
        resumed.step(x, y)
    got = resumed.model().state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
    resumed.close()


def test_edgeadapt_train_runs_the_transformer_with_its_positional_embedding(tmp_path):
    from edgeadapt.cli import main
    from edgeadapt.server.train_cli import load_trained

    run = tmp_path / "run"
    assert main(["train", "--model", "transformer", "--steps", "2", "--batch-size", "4", "--offload", "disk",
                 "--memory-budget", "4MiB", "--checkpoint-dir", str(run), "--no-progress"]) == 0
    model = load_trained(run)
    assert model.pos_embed.shape[1] == model.n_tokens and torch.isfinite(model.pos_embed).all()
    # the root block (pos_embed) was updated at both steps, with the other blocks
    ckpt = sorted((run / "checkpoints").glob("step-*"))[-1]
    root = torch.load(ckpt / "block-00000.pt", weights_only=True)
    assert set(root["param"]) == {"pos_embed"} and int(root["steps"]["pos_embed"]) == 2
    assert torch.equal(root["param"]["pos_embed"], model.pos_embed.detach())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA build of torch and a GPU")
@pytest.mark.parametrize("offload", ["host", "disk"])
def test_cuda_root_block_matches_plain_cuda_training(offload, tmp_path):
    data = [(x.cuda(), y.cuda()) for x, y in batches("mlp", 3, batch=32)]
    ref = reference_train(make_root(width=128).cuda(), data, update_on_cpu=True)
    model = make_root(width=128)
    budget = 8 * sum(p.numel() for p in model.parameters())  # half of weights, gradients and AdamW state
    torch.manual_seed(123)
    torch.cuda.manual_seed_all(123)
    t = Trainer(model, optimizer={"name": "adamw", "lr": 1e-2, "weight_decay": 0.1}, memory_budget=budget,
                offload=offload, offload_dir=tmp_path, device="cuda", example_input=data[0][0])
    assert t.plan.micro_batch_windows == 32  # micro-batches would draw their own dropout masks
    for x, y in data:
        t.step(x, y)
    assert t.tracked_peak_bytes <= budget
    got, want = t.model().state_dict(), {k: v.cpu() for k, v in ref.state_dict().items()}
    for k in want:  # same GPU kernels and the same CPU AdamW: only float32 rounding of the kernels may differ
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-5)
    t.close()
