"""A forward whose shapes depend on the data (boolean indexing, ``torch.nonzero``) cannot run on
the meta device: the trace falls back to one real window on the CPU, leaves the model untouched,
and the trainer plans and trains such a model under a budget as it trains it in memory."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from edgeadapt.sched import NoFeasiblePlan
from edgeadapt.server import Trainer, trace_graph
from edgeadapt.server.trace import TraceError
from edgeadapt.server.trainer import plan_training


class Sparse(nn.Module):
    """Per window, the negative activations are zeroed through a boolean index (``nonzero`` under
    the hood) and the positions of the positive ones are counted: data-dependent shapes, but no
    coupling between windows."""

    def __init__(self, width: int = 32):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x):
        h = self.lin(x)
        h = h.clone()
        h[h < 0] = 0
        count = torch.stack([row.nonzero().shape[0] * torch.ones((), dtype=h.dtype) for row in h])
        return h + 1e-3 * count[:, None]


def make():
    torch.manual_seed(0)
    return nn.Sequential(Sparse(), Sparse(), Sparse(), nn.Linear(32, 5))


def test_the_trace_falls_back_to_one_real_window_and_leaves_the_model_alone(caplog):
    model = make()
    before = {n: p.detach().clone() for n, p in model.state_dict().items()}
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(0))
    with caplog.at_level(logging.WARNING, logger="edgeadapt.server.trace"):
        g = trace_graph(model, x, device="cpu")
    assert "one real window" in caplog.text
    assert g.traced_windows == 1
    blocks = [op for op in g.ops if op.kind == "block"]
    # per window: each Sparse block outputs 32 floats and keeps its boolean mask (32 bytes) for the
    # backward (its input is the batch or the block before's output, charged there); the head 5 floats
    assert [op.output_bytes for op in blocks] == [32 * 4] * 3 + [5 * 4]
    assert all(op.saved_bytes >= 32 for op in blocks[:3])
    assert all(torch.equal(before[n], t) for n, t in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def test_a_forward_that_cannot_run_at_all_names_both_failures():
    class Broken(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            h = self.lin(x)
            return h[h > 0].reshape(3, -1)  # a shape only some data allows

    with pytest.raises(TraceError, match="(?s)meta device .*one real window on the CPU"):
        trace_graph(nn.Sequential(Broken(), nn.Linear(4, 2)), torch.randn(2, 4), device="cpu")


@pytest.mark.parametrize("offload", ["host", "disk"])
def test_the_trainer_trains_it_under_a_budget_as_in_memory(tmp_path, offload):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 32, generator=g), torch.randint(0, 5, (16,), generator=g)
    reference = Trainer(make(), loss="cross_entropy", optimizer={"name": "adamw", "lr": 1e-2}, memory_budget=None,
                        offload=None, device="cpu")
    expected = [reference.step(x, y) for _ in range(3)]
    with pytest.raises(NoFeasiblePlan) as e:  # the least budget the planner finds for this model
        plan_training(make(), x, offload=offload, memory_budget=100, device="cpu", recompute="auto")
    trainer = Trainer(make(), loss="cross_entropy", optimizer={"name": "adamw", "lr": 1e-2},
                      memory_budget=e.value.need_bytes, offload=offload, offload_dir=tmp_path, device="cpu",
                      example_input=x)
    losses = [trainer.step(x, y) for _ in range(3)]
    assert trainer.plan.micro_batch_windows < 16  # the least budget splits the batch
    assert trainer.tracked_peak_bytes <= e.value.need_bytes
    # micro-batches sum the same per-window losses in another order: float32 rounding of a mean
    # over 16 windows of O(1) values, a few ulps per addition
    assert losses == pytest.approx(expected, rel=1e-5)
    trainer.close()


def test_the_real_trace_leaves_no_tensor_behind():
    """No backward runs in a trace: autograd keeps none of the real window's tensors (a saved
    output handed back to it would form a cycle through its graph that outlives the trace)."""
    import gc
    import weakref

    torch.manual_seed(0)
    # tanh keeps its own output for its backward: the case that formed the cycle
    model = nn.Sequential(nn.Sequential(Sparse(), nn.Tanh()), nn.Sequential(Sparse(), nn.Tanh()), nn.Linear(32, 5))
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(1))
    made: list = []

    def spy(_module, _inputs, out):
        made.append(weakref.ref(out))

    hooks = [m.register_forward_hook(spy) for m in model.modules() if isinstance(m, nn.Tanh)]
    trace_graph(model, x, device="cpu")
    for h in hooks:
        h.remove()
    gc.collect()
    assert made and all(r() is None for r in made)


def test_an_uncopyable_model_traced_in_place_gets_its_caches_back():
    """A model the trace cannot copy runs in place; what its forward cached on a module (a list
    and a dict filled with real tensors) is put back."""

    class Caching(Sparse):
        def __init__(self):
            super().__init__()
            self.seen, self.table = [], {}
            self.lock = __import__("threading").Lock()  # refuses copy.deepcopy

        def forward(self, x):
            out = super().forward(x)
            self.seen.append(out)
            self.table["last"] = out
            return out

    torch.manual_seed(0)
    model = nn.Sequential(Caching(), nn.Linear(32, 5))
    trace_graph(model, torch.randn(4, 32, generator=torch.Generator().manual_seed(2)), device="cpu")
    assert model[0].seen == [] and model[0].table == {}
