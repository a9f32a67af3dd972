"""The process peak agrees with the tracked peak: disk tier, state 8x the budget, a fresh process.

The ledger tracks every tensor the executor holds (weights, gradients, staged optimizer state
and one update temporary, saved activations, block outputs). What it does not see are
transients inside one op or block (an intermediate freed before the block returns) and the
allocator's slack, so the anonymous-memory peak over the model-loaded baseline is allowed 25%
over the budget, in the first step and in later ones (both over the one baseline taken before
the first step: what the first step leaves in the heap counts against the later ones); the
tracked peak itself must stay under the budget. Part of what the ledger cannot see is a fixed
cost of about 1-2 MB (worker threads' stacks and heaps, torch's lazily built per-op state), so the
model is sized for a budget of about 25 MB, where that is a few percent and not a quarter.
(Without the trainer's fixed malloc mmap threshold, ``edgeadapt.server.allocator``, the first
step alone left glibc's heap arenas holding 2-3x the budget.)
"""

from __future__ import annotations

import json

import pytest
from helpers import REPO, run_python

SCRIPT = """
import gc, json, sys
sys.path.insert(0, {tests!r})
import torch
torch.set_num_threads(1)
from server_helpers import make_mlp
from edgeadapt.memory import measure_peak
from edgeadapt.server import Trainer

g = torch.Generator().manual_seed(0)
data = [(torch.randn(32, 12, generator=g), torch.randint(0, 5, (32,), generator=g)) for _ in range(4)]
model = make_mlp(width=1024, depth=12)
state = 16 * sum(p.numel() for p in model.parameters())  # weights, gradients, two AdamW moments
budget = state // 8
t = Trainer(model, memory_budget=budget, offload="disk", offload_dir={offload_dir!r}, device="cpu",
            recompute="auto", example_input=data[0][0], update_chunk_numel=1 << 16)
del model
gc.collect()
with measure_peak(anon_interval_s=0.0005) as first:  # the first step too (torch's first backward)
    t.step(*data[0])
with measure_peak(anon_interval_s=0.0005) as pk:
    for x, y in data[1:]:
        t.step(x, y)
base = first.anon_baseline_bytes
print(json.dumps({{"state": state, "budget": budget, "tracked": t.tracked_peak_bytes,
                  "anon_first": first.anon_peak_bytes - base, "anon": pk.anon_peak_bytes - base,
                  "samples": pk.anon_samples, "trainer": t.process_memory.peak_bytes - base,
                  "trainer_samples": t.process_memory.samples}}))
t.close()
"""


@pytest.mark.slow  # ~15 s: a fresh interpreter importing torch
def test_disk_tier_process_peak_agrees_with_the_tracked_peak(tmp_path):
    r = run_python(SCRIPT.format(tests=str(REPO / "tests"), offload_dir=str(tmp_path)), timeout_s=600)
    assert r.returncode == 0, r.stderr
    m = json.loads(r.stdout.strip().splitlines()[-1])
    assert m["state"] >= 8 * m["budget"]
    assert 0 < m["tracked"] <= m["budget"]
    assert m["samples"] > 10
    assert m["anon"] <= 1.25 * m["budget"], m
    assert m["anon_first"] <= 1.25 * m["budget"], m
    # the trainer's own figure (RssAnon at block boundaries) sees most of what the 0.5 ms sampler
    # sees (measured: 96-100 % on 16- and 48-block GPTs)
    assert m["trainer_samples"] > 4 * 12
    assert m["trainer"] >= 0.5 * max(m["anon"], m["anon_first"]), m


@pytest.mark.parametrize("offload, given, applied", [
    ("disk", "auto", [1 << 18]),     # the disk tier returns freed blocks to the OS
    ("host", "auto", []),            # the host tier leaves malloc alone
    ("host", 1 << 20, [1 << 20]),    # a given threshold is applied on either tier
    ("disk", None, []),
])
def test_the_trainer_fixes_the_mmap_threshold_on_the_disk_tier_by_default(offload, given, applied, tmp_path,
                                                                          monkeypatch):
    import torch
    from server_helpers import make_mlp

    import edgeadapt.server.trainer as trainer_module
    from edgeadapt.server import Trainer

    calls = []
    monkeypatch.setattr(trainer_module, "set_mmap_threshold", calls.append)
    Trainer(make_mlp(width=16, depth=2), memory_budget="1MiB", offload=offload, offload_dir=tmp_path / "s",
            device="cpu", example_input=torch.zeros(4, 12), malloc_mmap_threshold_bytes=given).close()
    assert calls == applied


@pytest.mark.parametrize("offload", ["host", "disk", None])
def test_the_trainer_reports_the_process_peak_beside_the_tracked_one(offload, tmp_path):
    import torch
    from server_helpers import make_mlp

    from edgeadapt.server import Trainer
    from edgeadapt.server.progress import memory_fields

    x, y = torch.randn(8, 12), torch.randint(0, 5, (8,))
    model = make_mlp(width=64, depth=3)
    blocks = len(list(model.children()))
    with Trainer(model, memory_budget="4MiB", offload=offload, offload_dir=tmp_path / "s", device="cpu",
                 example_input=x) as t:
        before = t.process_memory.samples
        t.step(x, y)
        after_one = t.process_memory.samples
        t.step(x, y)
        assert isinstance(t.process_peak_bytes, int) and t.process_peak_bytes >= 0
        # sampled at the end of the forward and of the backward, and streamed: at every block's fetch and release
        per_step = 2 + (4 * blocks if offload else 0)
        assert after_one - before >= per_step and t.process_memory.samples - after_one >= per_step
        fields = memory_fields(t)
        assert fields["peak"].endswith("of 4.00 MiB") and fields["process"].startswith("+")
        assert ("disk" in fields) == (offload == "disk") and ("host" in fields) == (offload == "host")
        assert t.gpu_peak_bytes is None and "gpu allocated" not in fields  # a CPU run has no GPU allocator


def test_a_bad_mmap_threshold_is_refused(tmp_path):
    import torch
    from server_helpers import make_mlp

    from edgeadapt.server import Trainer

    with pytest.raises(ValueError, match="malloc_mmap_threshold_bytes"):
        Trainer(make_mlp(width=16, depth=2), offload="host", device="cpu", example_input=torch.zeros(4, 12),
                malloc_mmap_threshold_bytes="big")
