"""The torch adapter (block graph from a module) and the offload planner in edgeadapt.sched.offload."""

from __future__ import annotations

import json

import pytest
import torch
from server_helpers import make_cnn, make_mlp, saved_by_forward
from torch import nn

from edgeadapt.sched import Graph, Op, Param, Plan
from edgeadapt.sched import BudgetExceeded, NoFeasiblePlan
from edgeadapt.sched.offload import BlockTooLarge, block_costs, offload_peak, plan_offload
from edgeadapt.models import build_gpt
from edgeadapt.server import find_blocks, trace_graph
from edgeadapt.server import trace as trace_mod


def test_blocks_are_container_items_and_other_top_level_children():
    assert [b.name for b in find_blocks(make_mlp(depth=3))] == ["proj", "layers.0", "layers.1", "layers.2", "norm",
                                                                 "head"]
    assert [b.name for b in find_blocks(make_cnn())] == ["blocks.0", "blocks.1", "blocks.2", "head"]
    seq = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    assert [b.name for b in find_blocks(seq)] == ["0", "2"]  # parameter-free modules run in between


def test_trace_counts_match_a_hand_count_and_leave_the_model_untouched():
    model = make_mlp(d_in=12, width=32, depth=2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(8, 12)
    rng = torch.get_rng_state()
    g = trace_graph(model, x)
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert [o.name for o in g.ops] == ["proj", "layers.0", "layers.1", "norm", "head"]
    assert g.input_bytes == 12 * 4
    assert g.param_bytes == 4 * sum(p.numel() for p in model.parameters())
    layer = g.ops[1]
    assert layer.output_bytes == 32 * 4
    # per window: the fc output (GELU's input) and dropout's mask (float32 on the CPU, as torch saves it);
    # the fc's input is the block's input (counted as the previous block's output), its weight a parameter
    assert layer.saved_bytes == 32 * 4 + 32 * 4
    assert g.ops[0].saved_bytes == 0  # a Linear on the model input keeps nothing but its weight
    Graph.from_dict(json.loads(json.dumps(g.to_dict())))


@pytest.mark.parametrize("heads,context", [(2, 32), (4, 16)])
def test_a_cpu_trace_counts_what_the_cpu_kernels_save(heads, context):
    # the CPU's fused attention keeps its output and log-sum-exp; the meta device runs the unfused
    # math, which also keeps the attention matrix: the CPU plan is traced with the CPU's kernels
    torch.manual_seed(0)
    model = build_gpt("gpt-nano", vocab_size=64, context_len=context, d_model=32, n_layers=2, n_heads=heads)
    batch = 3
    ids = torch.randint(0, 64, (batch, context))
    on_cpu, on_meta = trace_graph(model, ids, device="cpu"), trace_graph(model, ids)
    hidden = torch.randn(batch, context, 32, requires_grad=True)
    real = saved_by_forward(model.blocks[0], hidden)
    cpu_op = next(o for o in on_cpu.ops if o.name == "blocks.0")
    meta_op = next(o for o in on_meta.ops if o.name == "blocks.0")
    assert cpu_op.saved_bytes * batch == real
    assert meta_op.saved_bytes > cpu_op.saved_bytes  # the attention matrix, per head
    assert [o.output_bytes for o in on_cpu.ops] == [o.output_bytes for o in on_meta.ops]


def test_a_model_the_fake_trace_cannot_run_is_traced_on_meta(monkeypatch):
    model, x = make_mlp(d_in=12, width=16, depth=2), torch.randn(4, 12)
    real = trace_mod._trace_runs

    def no_fake(*args):
        if args[-1] != "meta":
            raise NotImplementedError("no fake kernel for this op")
        return real(*args)

    monkeypatch.setattr(trace_mod, "_trace_runs", no_fake)
    assert trace_graph(model, x, device="cpu") == trace_graph(model, x)


def _chain(n: int, weight_bytes: int, saved: int, out: int) -> Graph:
    params = [Param(f"b{i}.w", (weight_bytes // 4,)) for i in range(n)]
    ops = [Op(f"b{i}", "block", params=(f"b{i}.w",), inputs=() if i == 0 else (f"b{i - 1}",), output_bytes=out,
              saved_bytes=saved, workspace_bytes=out) for i in range(n)]
    return Graph(tuple(ops), tuple(params), input_bytes=out, name="chain")


def test_plan_fits_the_budget_and_round_trips():
    g = _chain(8, 4096, 1000, 100)
    plan = plan_offload(g, 80 * 1024, batch_windows=4, tier="disk", prefetch_depth=2)
    assert plan.order == tuple(f"b{i}" for i in range(8))
    assert {p.tier.value for p in plan.params} == {"disk"} and {p.mode.value for p in plan.params} == {"full"}
    assert plan.prefetch_depth == 2 and plan.recomputed == ()
    assert plan.predicted.peak_bytes <= 80 * 1024
    assert Plan.from_json(plan.to_json()) == plan


def test_auto_recompute_and_prefetch_give_way_in_that_order():
    g = _chain(8, 4096, 4000, 100)
    costs = block_costs(g, 4)
    keep_all = offload_peak(costs, [False] * 8, 1, fixed_bytes=400).peak_bytes
    budget = keep_all - 4 * 4000  # needs at least some recompute
    plan = plan_offload(g, budget, batch_windows=4, recompute="auto", prefetch_depth=1)
    assert plan.recomputed and plan.prefetch_depth == 1
    assert plan.predicted.peak_bytes <= budget
    with pytest.raises(BudgetExceeded, match="recompute='auto'"):
        plan_offload(g, budget, batch_windows=4, recompute=False)
    # recompute never raises a peak: all-recompute is below keep-all here
    assert plan_offload(g, keep_all, batch_windows=4, recompute=True).predicted.peak_bytes < keep_all


def test_block_too_large_names_it_with_bytes_and_budget():
    g = _chain(3, 4096, 0, 4)
    with pytest.raises(BlockTooLarge) as e:
        plan_offload(g, 10_000, tier="disk")
    assert e.value.block == "b0" and e.value.have_bytes == 10_000
    # the block alone at its update: grads + staged master, 2 moments and one temporary + the input
    # window (its weights are released before the update)
    alone = 4096 + 4096 * 4 + 4
    assert "'b0'" in str(e.value) and "9.77 KiB" in str(e.value) and "20.00 KiB" in str(e.value)
    # need_bytes is the smallest budget at which a plan exists (the block alone plus the backward's neighbours)
    assert e.value.need_bytes >= alone and f"{e.value.need_bytes} bytes" in str(e.value)
    assert plan_offload(g, e.value.need_bytes, tier="disk").predicted.peak_bytes == e.value.need_bytes
    with pytest.raises(NoFeasiblePlan):  # the block alone fits there; the neighbours' bytes do not
        plan_offload(g, e.value.need_bytes - 1, tier="disk")
    # staging 1 KiB chunks (two in flight) needs less than the least budget of whole-block updates
    small = plan_offload(g, 10**6, tier="disk", staging_chunk_bytes=1024, prefetch_depth=0)
    assert small.predicted.peak_bytes < e.value.need_bytes


def test_bad_arguments_are_refused():
    g = _chain(2, 64, 0, 4)
    for kw in ({"tier": "gpu"}, {"recompute": "sometimes"}, {"prefetch_depth": -1}, {"optimizer": "lamb"}):
        with pytest.raises(ValueError):
            plan_offload(g, 10**6, **kw)


class _Recurrent(nn.Module):
    """A two-layer recurrent block on batch-first windows (transposed for a time-first layer)."""

    def __init__(self, kind: type[nn.RNNBase], batch_first: bool):
        super().__init__()
        self.rnn = kind(8, 16, batch_first=batch_first, num_layers=2)

    def forward(self, x):
        if self.rnn.batch_first:
            return self.rnn(x)[0]
        return self.rnn(x.transpose(0, 1))[0].transpose(0, 1)


@pytest.mark.parametrize("kind", [nn.LSTM, nn.GRU, nn.RNN])
@pytest.mark.parametrize("batch_first", [True, False])
def test_recurrent_blocks_count_their_kernels_workspace(kind, batch_first):
    # a CPU LSTM keeps a workspace its fake and meta kernels report empty: the trace measures the
    # layer for real, so the plan counts at least what a real forward keeps
    torch.manual_seed(0)
    model = nn.Sequential(_Recurrent(kind, batch_first))
    x = torch.randn(3, 10, 8)
    real = saved_by_forward(model[0], x.clone().requires_grad_())
    for device in ("cpu", None):
        op = trace_graph(model, x, device=device).ops[0]
        assert op.saved_bytes * 3 >= real and op.saved_traced_bytes >= real, (kind, device)


def test_the_trace_puts_back_what_a_forward_caches_on_its_module():
    class Cached(nn.Module):
        def __init__(self):
            super().__init__()
            self.table = None
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            if self.table is None or self.table.device != x.device or self.table.shape[0] != x.shape[1]:
                self.table = torch.cos(torch.arange(x.shape[1], dtype=x.dtype, device=x.device))[:, None]
            return self.lin(x) * self.table

    model = Cached()
    kept = torch.ones(1)
    model.other = kept
    trace_graph(model, torch.randn(2, 5, 4), device="cpu")
    assert model.table is None and model.other is kept
    model(torch.randn(2, 5, 4)).sum().backward()  # the real forward builds its own table
    assert isinstance(model.table, torch.Tensor) and model.table.device.type == "cpu"


class _Table(nn.Module):
    """A block that builds a (steps, width) table in its forward and multiplies by it (the table,
    saved for the backward, does not grow with the windows)."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x):  # (batch, steps, width)
        steps = torch.arange(x.shape[1], dtype=x.dtype, device=x.device)
        table = torch.cos(steps[:, None] * torch.arange(1, x.shape[2] + 1, dtype=x.dtype, device=x.device))
        return torch.tanh(self.lin(x)) * table


@pytest.mark.parametrize("batch", [2, 5, 8])
def test_bytes_that_do_not_grow_with_the_windows_count_once_for_the_traced_batch(batch):
    model = nn.Sequential(nn.Linear(4, 16), _Table())
    graph = trace_graph(model, torch.randn(batch, 12, 4), device="cpu")
    op, window, table = graph.ops[1], 12 * 16 * 4, 12 * 16 * 4
    # the traced batch: tanh's output per window (its backward reads it) and the (12, 16) table
    # once (the product's backward reads it for the factor that needs a gradient)
    assert graph.traced_windows == batch and op.saved_traced_bytes == batch * window + table
    # any other number of windows: the first window's bytes per window, an upper bound
    assert op.saved_bytes == window + table
    whole = block_costs(graph, batch)[1].saved_bytes
    assert whole == batch * window + table < block_costs(graph, batch - 1)[1].saved_bytes + window + table
    assert Graph.from_dict(json.loads(json.dumps(graph.to_dict()))) == graph
