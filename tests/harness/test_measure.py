"""The measuring protocol (edgeadapt.measure): the span it measures, and a fresh torch-free
process as a user has it (nothing of the runner warmed up before the baseline)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from edgeadapt.measure import MeasureSpec, measure_call, measure_in_fresh_process

MIB = 2**20


def test_measure_call_sees_what_the_body_allocates_over_the_baseline():
    with measure_call(trim_heap=True, timeline=True) as m:
        block = np.ones(8 * MIB, dtype=np.uint8)  # 8 MiB written: resident, anonymous
        time.sleep(0.05)  # held for many sampling intervals (a sampled peak is a lower bound)
        del block
    if not m.samples:
        pytest.skip("/proc/self/status has no RssAnon here")
    # the block's pages are anonymous and all touched: the sampled peak holds them, total too, less
    # what the kernel's per-thread RSS counters may not have folded in yet (up to 64 pages each,
    # two threads: this one and the sampler)
    slack = 2 * 64 * 4096
    assert m.call_peak_anon_bytes >= 8 * MIB - slack
    assert m.call_peak_bytes >= 8 * MIB - slack if m.peak_reset_ok else True
    assert m.baseline_anon_bytes > 0 and m.samples >= 2
    assert m.timeline and m.timeline[0][0] == 0.0 and max(r[2] for r in m.timeline) == m.call_peak_anon_bytes
    assert set(m.figures()) >= {"call_peak_bytes", "call_peak_anon_bytes", "baseline_anon_bytes", "heap_trimmed"}


def test_measure_call_without_allocation_stays_small():
    with measure_call() as m:
        pass
    assert m.call_peak_anon_bytes < MIB and m.heap_trimmed is False


def test_spec_round_trips_and_refuses_unknown_keys():
    spec = MeasureSpec(bundle="b", n_windows=3, progress=False)
    from dataclasses import asdict

    assert MeasureSpec.from_dict(asdict(spec)) == spec
    with pytest.raises(TypeError):
        MeasureSpec.from_dict({"bundle": "b", "warm_up": True})


def test_a_fresh_process_measures_the_whole_adapt_call(cnn_bundle):
    spec = MeasureSpec(bundle=str(cnn_bundle), n_windows=12, batch_windows=4, epochs=2, timeline=True)
    r = measure_in_fresh_process(spec, env={"OMP_NUM_THREADS": "1"})
    assert r["torch_imported"] is False and r["spec"]["progress"] is True
    assert r["steps"] == 6 and len(r["epoch_losses"]) == 2 and r["n_windows"] == 12
    # the caller's view holds the runner's own view of the call (it starts earlier, ends later)
    assert r["call_peak_anon_bytes"] > 0
    assert r["call_peak_anon_bytes"] + 64 * 1024 >= r["runner_call_peak_anon_bytes"]
    assert r["step_peak_anon_bytes"] <= r["runner_call_peak_anon_bytes"]
    assert r["timeline"] and r["heap_trimmed"] is False
