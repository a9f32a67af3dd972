"""edgeadapt.sched.remat_timing: the planner-time figure's chain and the schedules it reports."""

from __future__ import annotations

from edgeadapt.sched.remat import chain_peak, min_flops_schedule, min_peak_schedule
from edgeadapt.sched.remat_timing import synthetic_chain, time_chain_planner


def test_chain_planner_beats_or_matches_sqrt_checkpointing():
    r = time_chain_planner(n_ops=24, seed=1, limit_fractions=(0.9, 0.5, 0.0))
    assert r["min_peak_bytes"] <= min(r["sqrt_peak_bytes"], r["keep_all_peak_bytes"])
    chain = synthetic_chain(24, 1)
    assert r["keep_all_peak_bytes"] == chain_peak(chain, (False,) * 24)
    assert r["min_peak_bytes"] == min_peak_schedule(chain)[0]
    flops = []
    for row, fraction in zip(r["limits"], (0.9, 0.5, 0.0)):
        assert row["fraction"] == fraction
        assert row["limit_bytes"] == r["min_peak_bytes"] + int(fraction * (r["keep_all_peak_bytes"]
                                                                           - r["min_peak_bytes"]))
        assert row["min_flops_peak_bytes"] <= row["limit_bytes"]
        assert row["min_flops_peak_bytes"] == chain_peak(chain, min_flops_schedule(chain, row["limit_bytes"]))
        assert row["min_flops_recompute_flops"] <= r["min_peak_recompute_flops"]
        flops.append(row["min_flops_recompute_flops"])
    assert flops == sorted(flops)  # a tighter limit never costs fewer recompute FLOPs
    assert synthetic_chain(24, 1) == chain and synthetic_chain(24, 2) != chain  # seeded
