"""Plans that hold where a block's saved bytes do not grow evenly with the windows: a block that
works on the top positions of the whole (micro-)batch (its bytes grow, then level off), and
recurrent layers that fold another axis of each window into their batch, run once per window, or
take sequences of their own beside the windows'; and what a traced forward caches on the model
(in a dict, a tuple, a helper object, an in-place counter) stays off the model."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from edgeadapt.sched import NoFeasiblePlan
from edgeadapt.server import Trainer, trace_graph
from edgeadapt.server.trainer import plan_training

STEPS, WIDTH, TOP = 32, 64, 96


class TopPositions(nn.Module):
    """Updates only the ``TOP`` best-scoring positions of the whole batch (hard-example mining)."""

    def __init__(self):
        super().__init__()
        self.score, self.fc = nn.Linear(WIDTH, 1), nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        flat = x.reshape(-1, WIDTH)
        idx = self.score(flat).squeeze(-1).detach().topk(min(TOP, flat.shape[0])).indices
        return flat.index_add(0, idx, torch.tanh(self.fc(flat[idx]))).view_as(x)


class FoldedRecurrent(nn.Module):
    """An LSTM over each of a window's 8 channels (dual-path style: channels folded into its batch)."""

    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(16, 16, batch_first=True)

    def forward(self, x):  # (windows, 8, steps, 16)
        return self.rnn(x.reshape(-1, x.shape[2], 16))[0].reshape(x.shape)


class PerWindowRecurrent(nn.Module):
    """A small LSTM run on each window in turn (a Python loop)."""

    def __init__(self):
        super().__init__()
        self.down, self.rnn, self.up = nn.Linear(16, 2), nn.LSTM(2, 2, batch_first=True), nn.Linear(2, 16)

    def forward(self, x):  # (windows, steps, 16)
        d = self.down(x)
        return x + self.up(torch.cat([self.rnn(d[i:i + 1])[0] for i in range(len(x))]))


class WithOwnSequences(nn.Module):
    """An LSTM whose batch is the windows and 6 learned sequences of its own."""

    def __init__(self):
        super().__init__()
        self.own = nn.Parameter(torch.randn(6, 10, 16) * 0.1)
        self.rnn = nn.LSTM(16, 16, batch_first=True)

    def forward(self, x):  # (windows, 10, 16)
        out = self.rnn(torch.cat([x, self.own]))[0]
        return x + out[:len(x)] + out[len(x):].mean(0)


class Stack(nn.Module):
    def __init__(self, block: type[nn.Module], width: int, depth: int):
        super().__init__()
        self.proj = nn.Linear(4, width)
        self.layers = nn.ModuleList(block() for _ in range(depth))
        self.head = nn.Linear(width, 5)

    def forward(self, x):
        h = self.proj(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h.flatten(1, -2).mean(1))


def _make(block, width, depth):
    def make():
        torch.manual_seed(0)
        return Stack(block, width, depth)
    return make


@pytest.mark.parametrize("case", ["top", "folded", "loop", "own"])
@pytest.mark.parametrize("recompute", [False, True])
def test_plans_hold_at_every_micro_batch_they_choose(tmp_path, case, recompute):
    g = torch.Generator().manual_seed(0)
    if case == "top":
        make, x = _make(TopPositions, WIDTH, 3), torch.randn(8, STEPS, 4, generator=g)
    elif case == "folded":
        make, x = _make(FoldedRecurrent, 16, 2), torch.randn(4, 8, 10, 4, generator=g)
    else:
        block = PerWindowRecurrent if case == "loop" else WithOwnSequences
        make, x = _make(block, 16, 2), torch.randn(6, 10, 4, generator=g)
    y = torch.randint(0, 5, (len(x),), generator=g)
    with pytest.raises(NoFeasiblePlan) as e:
        plan_training(make(), x, offload="host", memory_budget=100, device="cpu", recompute=recompute,
                      example_target=y)
    # the least budget at which the planner picks each micro-batch size (found on a 2 % grid)
    first: dict[int, int] = {}
    for step in range(80):
        budget = int(e.value.need_bytes * (1 + 0.02 * step))
        plan = plan_training(make(), x, offload="host", memory_budget=budget, device="cpu", recompute=recompute,
                             example_target=y)
        first.setdefault(plan.micro_batch_windows, budget)
    assert len(first) >= 2  # micro-batches and the whole batch
    for micro, budget in first.items():
        t = Trainer(make(), loss="cross_entropy", optimizer={"name": "adamw", "lr": 1e-3}, memory_budget=budget,
                    offload="host", offload_dir=tmp_path / str(micro), device="cpu", recompute=recompute,
                    example_input=x)
        t.step(x, y)
        assert t.plan.micro_batch_windows == micro
        assert t.tracked_peak_bytes <= t.plan.predicted.peak_bytes <= budget, (budget, micro)
        t.close()


def test_what_a_traced_forward_caches_stays_off_the_model():
    class Holder:
        table = None

    class Cached(nn.Module):
        def __init__(self):
            super().__init__()
            self.tables: dict[int, dict[str, torch.Tensor]] = {}
            self.pair: tuple = ()
            self.holder = Holder()
            self.calls = torch.zeros(())
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            steps = x.shape[1]
            if steps not in self.tables:
                self.tables[steps] = {"cos": torch.cos(torch.arange(steps, dtype=x.dtype, device=x.device))[:, None]}
            self.pair = (self.tables[steps]["cos"],)
            self.holder.table = self.pair[0]
            self.calls += 1
            return self.lin(x) * self.holder.table

    model = Cached()
    trace_graph(model, torch.randn(2, 5, 4), device="cpu")
    assert model.tables == {} and model.pair == () and model.holder.table is None and float(model.calls) == 0
    model(torch.randn(2, 5, 4)).sum().backward()  # the real forward builds its own table
    assert model.tables[5]["cos"].device.type == "cpu" and float(model.calls) == 1
