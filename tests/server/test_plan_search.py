"""The offload planner searches its knobs (recompute per block, update chunk, prefetch depth,
micro-batches) and refuses only below the smallest budget any combination fits, which it names.

Training under a searched plan is compared with plain in-memory torch AdamW: bit for bit for
one batch per step; with micro-batches, bit for bit against torch accumulating the same
micro-batches' gradients in the same order (``p.grad`` summed micro-batch after micro-batch),
and within a tolerance derived from the summation order against the full batch.
"""

from __future__ import annotations

import functools
import itertools
import math
import re

import pytest
import torch
from server_helpers import MLPStack, reference_train
from torch import nn

from edgeadapt.sched import Graph, NoFeasiblePlan, Op, Param, Plan, UpdateOverlap
from edgeadapt.sched.offload import (CHUNK_CANDIDATES_NUMEL, CHUNK_OVERHEAD_FLOPS, OVERLAP_TEXT, OVERLAPS,
                                     added_step_flops, block_costs, micro_batch_sizes, offload_peak, plan_offload)
from edgeadapt.server import Trainer, trace_graph
from edgeadapt.server.trainer import offload_plan
from edgeadapt.server.updater import BlockUpdater


class PreNormBlock(nn.Module):
    """x + fc2(gelu(fc1(layer_norm(x)))): a pre-norm residual MLP block (no random numbers)."""

    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, x):
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm(x))))


def make_prenorm(seed: int = 0) -> MLPStack:
    """16 pre-norm residual MLP blocks behind a projection, then a layer norm and a head."""
    torch.manual_seed(seed)
    return MLPStack(d_in=24, width=64, depth=16, n_classes=7, block=functools.partial(PreNormBlock, hidden=256))


def prenorm_batches(n: int, batch: int = 32, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 24, generator=g), torch.randint(0, 7, (batch,), generator=g)) for _ in range(n)]


def state_bytes(model: nn.Module) -> int:
    """Weights + gradients + two AdamW moments, float32."""
    return 16 * sum(p.numel() for p in model.parameters())


def _graph(saved: list[int], weight_numel: int = 2048, out: int = 64, flops: int = 0) -> Graph:
    n = len(saved)
    params = [Param(f"b{i}.w", (weight_numel,)) for i in range(n)]
    ops = [Op(f"b{i}", "block", params=(f"b{i}.w",), inputs=() if i == 0 else (f"b{i - 1}",), output_bytes=out,
              saved_bytes=s, workspace_bytes=out, flops=flops) for i, s in enumerate(saved)]
    return Graph(tuple(ops), tuple(params), input_bytes=out, name="g")


def _brute_force_minimum(g: Graph, batch: int, max_micro: int, depth: int, tier: str = "disk") -> int:
    """The least peak over every combination: each recompute subset, prefetch, chunk, micro-batch and
    update overlap."""
    largest = max(g.param(p).param_bytes // 4 for op in g.ops for p in op.params)
    chunks = sorted({min(c, largest) for c in CHUNK_CANDIDATES_NUMEL})
    best = None
    for mb in micro_batch_sizes(batch, max_micro):
        for chunk in chunks:
            costs = block_costs(g, mb, staging=tier == "disk", staging_chunk_bytes=4 * chunk, accumulate=mb < batch)
            for d, overlap in itertools.product(range(depth + 1), OVERLAPS):
                for rec in itertools.product((False, True), repeat=len(costs)):
                    peak = offload_peak(costs, list(rec), d, fixed_bytes=g.input_bytes * batch,
                                        update_overlap=overlap).peak_bytes
                    best = peak if best is None else min(best, peak)
    return best


def test_refusal_names_the_least_budget_over_every_combination():
    g = _graph([3000, 12000, 500, 8000], weight_numel=4096)
    least = _brute_force_minimum(g, batch=4, max_micro=4, depth=2)
    with pytest.raises(NoFeasiblePlan) as e:
        plan_offload(g, least // 2, batch_windows=4, tier="disk", prefetch_depth=2, max_micro_batches=4)
    assert e.value.need_bytes == least and f"{least} bytes" in str(e.value)
    plan = plan_offload(g, least, batch_windows=4, tier="disk", prefetch_depth=2, max_micro_batches=4)
    assert plan.predicted.peak_bytes <= least
    with pytest.raises(NoFeasiblePlan):
        plan_offload(g, least - 1, batch_windows=4, tier="disk", prefetch_depth=2, max_micro_batches=4)


def test_every_budget_from_the_least_up_finds_a_plan_that_fits():
    g = _graph([3000, 12000, 500, 8000], weight_numel=4096)
    least = _brute_force_minimum(g, batch=4, max_micro=4, depth=2)
    roomy = plan_offload(g, 10**9, batch_windows=4, tier="disk", prefetch_depth=2, max_micro_batches=4)
    for budget in range(least, roomy.predicted.peak_bytes + 1, 997):
        plan = plan_offload(g, budget, batch_windows=4, tier="disk", prefetch_depth=2, max_micro_batches=4)
        costs = block_costs(g, plan.micro_batch_windows, staging=True, staging_chunk_bytes=4 * plan.update_chunk_numel,
                            accumulate=plan.micro_batch_windows < 4)
        rec = [plan.action(c.name).value == "recompute" for c in costs]
        # the plan's own numbers re-derived: it fits
        assert offload_peak(costs, rec, plan.prefetch_depth, fixed_bytes=g.input_bytes * 4,
                            update_overlap=plan.update_overlap) == plan.predicted
        assert plan.predicted.peak_bytes <= budget


def test_disk_tier_trades_chunk_prefetch_and_recompute_by_the_time_they_add():
    # a block's forward costs as much as 4 staged chunks: shrinking the chunk in two costs 4 chunk
    # overheads (each block then takes 2), recomputing the cheapest block costs 4 as well; a
    # smaller chunk than that costs more than recomputing a block
    per_block = 4 * CHUNK_OVERHEAD_FLOPS // 4      # flops per window; batch of 4 windows
    g = _graph([3000, 12000, 500, 8000], weight_numel=1 << 16, flops=per_block)
    roomy = plan_offload(g, 10**9, batch_windows=4, tier="disk", prefetch_depth=2, max_micro_batches=4)
    assert (roomy.micro_batch_windows, roomy.prefetch_depth, roomy.recomputed) == (4, 2, ())
    assert roomy.update_chunk_numel == 1 << 16  # the whole block
    for budget in range(roomy.predicted.peak_bytes - 1, roomy.predicted.peak_bytes // 3, -4099):
        try:
            plan = plan_offload(g, budget, batch_windows=4, tier="disk", prefetch_depth=2, max_micro_batches=1)
        except NoFeasiblePlan:
            break
        assert plan.predicted.peak_bytes <= budget
        chosen = _added(g, plan)
        # no other fitting setting of (prefetch, chunk, recompute subset) adds less time
        for depth in range(3):
            for chunk in sorted({min(c, 1 << 16) for c in CHUNK_CANDIDATES_NUMEL}):
                costs = block_costs(g, 4, staging=True, staging_chunk_bytes=4 * chunk)
                for rec in itertools.product((False, True), repeat=4):
                    if offload_peak(costs, list(rec), depth, fixed_bytes=g.input_bytes * 4).peak_bytes <= budget:
                        assert chosen <= added_step_flops(g, rec, 4, chunk, depth, 4), (budget, depth, chunk, rec)
    # (a prefetch deeper than one block adds nothing to hide here: the scenarios below ask for one)
    # recompute that costs nothing next to a chunk: a tight budget recomputes before it shrinks the chunk
    free = _graph([3000, 12000, 500, 8000], weight_numel=1 << 16, flops=1)
    roomy = plan_offload(free, 10**9, batch_windows=4, tier="disk", prefetch_depth=1)
    tight = plan_offload(free, roomy.predicted.peak_bytes - 1, batch_windows=4, tier="disk", prefetch_depth=1)
    assert tight.update_chunk_numel == 1 << 16 and tight.recomputed and tight.prefetch_depth == 1
    # recompute that costs more than any chunk count or weight read: the chunk or the prefetch gives way
    dear = _graph([3000, 12000, 500, 8000], weight_numel=1 << 16, flops=10**6 * CHUNK_OVERHEAD_FLOPS)
    tight = plan_offload(dear, roomy.predicted.peak_bytes - 1, batch_windows=4, tier="disk", prefetch_depth=1)
    assert tight.recomputed == () and (tight.update_chunk_numel < 1 << 16 or tight.prefetch_depth == 0)


def _added(g: Graph, plan) -> int:
    rec = tuple(plan.action(op.name).value == "recompute" for op in g.ops)
    return added_step_flops(g, rec, plan.micro_batch_windows, plan.update_chunk_numel, plan.prefetch_depth,
                            plan.batch_windows)


def test_host_tier_keeps_prefetch_then_least_recompute():
    g = _graph([3000, 12000, 500, 8000], weight_numel=1 << 16)
    # the host tier stages nothing in the compute tier: activations give way, recompute first
    host = plan_offload(g, 10**9, batch_windows=4, tier="host", prefetch_depth=1, max_micro_batches=4)
    costs = block_costs(g, 4)
    keep = offload_peak(costs, [False] * 4, 1, fixed_bytes=g.input_bytes * 4).peak_bytes
    p = plan_offload(g, keep - 1, batch_windows=4, tier="host", prefetch_depth=1, max_micro_batches=4)
    assert host.recomputed == () and p.recomputed and p.prefetch_depth == 1 and p.micro_batch_windows == 4
    # the least recomputed bytes: one block, and the one block with fewer saved bytes would not fit
    assert p.recomputed == ("b0",)
    assert offload_peak(costs, [False, False, True, False], 1, fixed_bytes=g.input_bytes * 4).peak_bytes > keep - 1


def _least(g: Graph, batch: int, overlap: UpdateOverlap, tier: str = "disk", in_place: bool = False,
           chunk_numel: int = CHUNK_CANDIDATES_NUMEL[0]) -> int:
    """The least peak of a whole-batch plan with this update overlap: every other knob at its
    least (all recompute, prefetch 0, the smallest chunk unless given)."""
    costs = block_costs(g, batch, staging=tier == "disk", staging_chunk_bytes=4 * chunk_numel,
                        weights_in_place=in_place)
    return offload_peak(costs, [c.saved_bytes > 0 and not c.resident for c in costs], 0,
                        fixed_bytes=g.input_bytes * batch, update_overlap=overlap).peak_bytes


@pytest.mark.parametrize("tier", ["disk", "host"])
def test_updates_overlap_less_only_where_more_overlap_cannot_fit(tier):
    g = _graph([3000, 12000, 500, 8000], weight_numel=4096)
    least = {o: _least(g, 4, o, tier) for o in OVERLAPS}
    assert least[UpdateOverlap.NONE] <= least[UpdateOverlap.RECOMPUTE] < least[UpdateOverlap.BACKWARD]
    if tier == "disk":  # the update's staged chunk beside the next block's recompute costs bytes
        assert least[UpdateOverlap.NONE] < least[UpdateOverlap.RECOMPUTE]
    else:  # without staging, the next block's own backward holds more than its recompute beside the update
        assert least[UpdateOverlap.NONE] == least[UpdateOverlap.RECOMPUTE]
    assert least[UpdateOverlap.NONE] == _brute_force_minimum(g, batch=4, max_micro=1, depth=1, tier=tier)
    plan = plan_offload(g, least[UpdateOverlap.BACKWARD], batch_windows=4, tier=tier)
    assert plan.update_overlap is UpdateOverlap.BACKWARD
    # each overlap from its own least budget up to one byte below the next one's
    for overlap, upper in ((UpdateOverlap.RECOMPUTE, least[UpdateOverlap.BACKWARD]),
                           (UpdateOverlap.NONE, least[UpdateOverlap.RECOMPUTE])):
        budgets = (least[overlap], (least[overlap] + upper) // 2, upper - 1) if least[overlap] < upper else ()
        for budget in budgets:
            plan = plan_offload(g, budget, batch_windows=4, tier=tier)
            assert plan.update_overlap is overlap and plan.predicted.peak_bytes <= budget
            assert "update" in plan.predicted.phases_bytes     # the updates that are waited for are counted
            assert Plan.from_dict(plan.to_dict()) == plan      # the knob travels with the plan
    # the refusal names the knobs of the least plan: the most overlap among the least ones
    named = UpdateOverlap.NONE if tier == "disk" else UpdateOverlap.RECOMPUTE
    with pytest.raises(NoFeasiblePlan, match=re.escape(OVERLAP_TEXT[named])):
        plan_offload(g, least[UpdateOverlap.NONE] - 1, batch_windows=4, tier=tier)


@pytest.mark.parametrize("offload, overlap", [("disk", UpdateOverlap.RECOMPUTE), ("disk", UpdateOverlap.NONE),
                                              ("host", UpdateOverlap.RECOMPUTE)])
def test_updates_that_overlap_less_train_bit_identically_under_budgets_more_overlap_exceeds(offload, overlap, adamw,
                                                                                          tmp_path):
    """No overlap at all is needed only where the staged update is large beside a block's recompute:
    whole-block update chunks here (at the smallest chunks, and on the host tier, which stages
    nothing, these equal blocks fit no budget without overlap that they do not fit overlapping
    the recompute)."""
    data = prenorm_batches(2)
    graph = trace_graph(make_prenorm(), data[0][0])
    more = OVERLAPS[OVERLAPS.index(overlap) - 1]
    chunk = 1 << 22 if overlap is UpdateOverlap.NONE else None  # whole blocks, or the planner's choice
    # one byte below the smallest whole-batch plan with more overlap (the model has no buffers)
    budget = _least(graph, 32, more, offload, in_place=offload == "host",
                    chunk_numel=chunk or CHUNK_CANDIDATES_NUMEL[0]) - 1
    t = Trainer(make_prenorm(), optimizer=adamw, memory_budget=budget, offload=offload,
                offload_dir=tmp_path / "state", device="cpu", example_input=data[0][0], max_micro_batches=1,
                update_chunk_numel=chunk)
    for x, y in data:
        t.step(x, y)
    assert t.plan.update_overlap is overlap and t.plan.micro_batch_windows == 32
    assert 0 < t.tracked_peak_bytes <= budget
    ref = reference_train(make_prenorm(), data)
    got, want = t.model().state_dict(), ref.state_dict()
    for k in want:
        assert torch.equal(got[k], want[k]), f"{k} differs by {(got[k] - want[k]).abs().max()}"
    t.close()


def test_micro_batches_only_when_a_whole_batch_cannot_fit():
    g = _graph([40000, 40000, 40000], weight_numel=256)
    whole = _brute_force_minimum(g, batch=8, max_micro=1, depth=0, tier="host")
    with pytest.raises(NoFeasiblePlan):
        plan_offload(g, whole - 1, batch_windows=8, tier="host")
    plan = plan_offload(g, whole - 1, batch_windows=8, tier="host", max_micro_batches=8)
    assert plan.micro_batch_windows < 8 and plan.predicted.peak_bytes <= whole - 1
    # the fewest micro-batches that fit
    bigger = [m for m in micro_batch_sizes(8, 8) if m > plan.micro_batch_windows]
    for m in bigger:  # even with every block recomputed and no prefetch a larger micro-batch does not fit
        costs = block_costs(g, m, accumulate=True)
        for overlap in OVERLAPS:
            peak = offload_peak(costs, [True] * 3, 0, fixed_bytes=g.input_bytes * 8, update_overlap=overlap)
            assert peak.peak_bytes > whole - 1


@pytest.mark.parametrize("offload", ["disk", "host"])
def test_prenorm_mlp_at_an_eighth_of_its_state_trains_bit_identically(offload, adamw, tmp_path):
    data = prenorm_batches(3)
    ref = reference_train(make_prenorm(), data)
    model = make_prenorm()
    budget = state_bytes(model) // 8
    t = Trainer(model, optimizer=adamw, memory_budget=budget, offload=offload, offload_dir=tmp_path / "state",
                device="cpu", example_input=data[0][0], max_micro_batches=1)  # recompute, chunk: the planner's
    for x, y in data:
        t.step(x, y)
    plan = t.plan
    assert plan.predicted.peak_bytes <= budget and plan.micro_batch_windows == 32
    assert 0 < t.tracked_peak_bytes <= budget
    got, want = t.model().state_dict(), ref.state_dict()
    for k in want:
        assert torch.equal(got[k], want[k]), f"{k} differs by {(got[k] - want[k]).abs().max()}"
    t.close()


def test_refused_budget_names_one_at_which_the_trainer_then_trains(adamw, tmp_path):
    data = prenorm_batches(1)
    model = make_prenorm()
    graph = trace_graph(model, data[0][0])
    with pytest.raises(NoFeasiblePlan) as e:
        Trainer(make_prenorm(), optimizer=adamw, memory_budget=state_bytes(model) // 64, offload="disk",
                offload_dir=tmp_path / "a", device="cpu", example_input=data[0][0], max_micro_batches=1)
    need = e.value.need_bytes
    assert f"{need} bytes" in str(e.value)
    with pytest.raises(NoFeasiblePlan):
        Trainer(make_prenorm(), optimizer=adamw, memory_budget=need - 1, offload="disk", offload_dir=tmp_path / "b",
                device="cpu", example_input=data[0][0], max_micro_batches=1)
    t = Trainer(make_prenorm(), optimizer=adamw, memory_budget=need, offload="disk", offload_dir=tmp_path / "c",
                device="cpu", example_input=data[0][0], max_micro_batches=1)
    t.step(*data[0])
    assert 0 < t.tracked_peak_bytes <= need
    assert len(graph.ops) == 19
    t.close()


def reference_micro_batched(model: nn.Module, data, micro: int, *, lr=1e-2, weight_decay=0.1) -> nn.Module:
    """In-memory torch AdamW(foreach) with each batch's gradients accumulated in ``p.grad`` over
    micro-batches of ``micro`` windows, each loss weighted by its share of the batch."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, foreach=True)
    for x, y in data:
        opt.zero_grad()
        for a in range(0, len(x), micro):
            xb, yb = x[a:a + micro], y[a:a + micro]
            (nn.functional.cross_entropy(model(xb), yb) * (len(xb) / len(x))).backward()
        opt.step()
    return model


@pytest.mark.parametrize("offload", ["disk", "host", "disk-pipelined"])
def test_micro_batches_when_the_whole_batch_cannot_fit_accumulate_like_torch(offload, adamw, tmp_path, monkeypatch):
    """Bit for bit against torch summing the same micro-batches' gradients in the same order
    (not against one whole batch: the sums are ordered differently). ``disk-pipelined``: the
    disk tier's update with a GPU run's chunk pipeline, run on the CPU."""
    if offload == "disk-pipelined":
        offload = "disk"
        monkeypatch.setattr(BlockUpdater, "_staged_chunks", BlockUpdater._pipelined_chunks)
    data = prenorm_batches(2, batch=30)
    graph = trace_graph(make_prenorm(), data[0][0])
    with pytest.raises(NoFeasiblePlan) as e:
        offload_plan(graph, 30, budget_bytes=1, offload=offload, device=torch.device("cpu"), max_micro_batches=1)
    budget = e.value.need_bytes - 1      # one byte below the least whole-batch plan
    t = Trainer(make_prenorm(), optimizer=adamw, memory_budget=budget, offload=offload,
                offload_dir=tmp_path / "state", device="cpu", example_input=data[0][0])
    micro = t._plan_for(30).micro_batch_windows
    assert micro < 30
    losses = [t.step(x, y) for x, y in data]
    assert 0 < t.tracked_peak_bytes <= budget
    assert t.residency()["tiers"][offload] >= 4 * 4 * sum(p.numel() for p in make_prenorm().parameters())
    ref = reference_micro_batched(make_prenorm(), data, micro)
    got, want = t.model().state_dict(), ref.state_dict()
    for k in want:
        assert torch.equal(got[k], want[k]), f"{k} differs by {(got[k] - want[k]).abs().max()}"
    assert all(map(math.isfinite, losses))
    t.close()


def test_train_plan_only_prints_the_plan_and_writes_nothing(tmp_path, capsys):
    from edgeadapt.cli import main

    run = tmp_path / "run"
    args = ["train", "--model", "gpt-nano", "--steps", "1", "--offload", "disk", "--checkpoint-dir", str(run),
            "--device", "cpu", "--plan-only", "--no-progress"]
    assert main([*args, "--memory-budget", "3MiB"]) == 0
    out = capsys.readouterr().out
    for field in ("tiers:", "micro-batches:", "prefetch depth:", "update chunk:", "update: each update overlapping",
                  "recompute:", "predicted peak:", "blocks.0:", "by phase: forward", ", loss ", ", backward "):
        assert field in out
    assert "of 3.00 MiB" in out and not run.exists()
    assert main([*args, "--memory-budget", "100KiB"]) == 2
    assert "smallest budget" in capsys.readouterr().err and not run.exists()
    no_dir = [a for a in args if a not in ("--checkpoint-dir", str(run))]
    assert main([*no_dir, "--memory-budget", "3MiB"]) == 0  # a plan needs no run directory
    assert "predicted peak:" in capsys.readouterr().out
    assert main([a for a in no_dir if a != "--plan-only"]) == 2  # training does, named
    assert "--checkpoint-dir is required to train" in capsys.readouterr().err


def test_train_progress_shows_the_tracked_peak_against_the_budget_and_the_process_peak(tmp_path, capsys):
    from edgeadapt.cli import main

    assert main(["train", "--model", "gpt-nano", "--vocab-size", "64", "--context-len", "16", "--d-model", "32",
                 "--n-layers", "2", "--batch-size", "4", "--steps", "2", "--offload", "disk", "--device", "cpu",
                 "--memory-budget", "300KiB", "--checkpoint-dir", str(tmp_path / "run"), "--no-progress"]) == 0
    out = capsys.readouterr().out
    final = out.split("tracked peak ")[1].split(" of a ")[0]     # the done line: tracked peak X of a 300 KiB budget
    assert "step 2/2: " in out and f"peak {final} of 300.00 KiB, process +" in out
    assert "the process's anonymous peak: +" in out.split("done: ")[1]
