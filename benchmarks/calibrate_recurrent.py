"""Measure the fixed cost of a recurrent layer in the adapt call and write it to the shipped constants.

A GRU's or LSTM's adapt call holds more than the tensors the cost model counts: the small
recurrent nets of ``benchmarks/recurrent_budget.py`` measured 50-130 KiB over their expected
figure, growing the C heap whatever their size. This script fits that as one constant per
recurrent layer (``CostModel.recurrent_layer_bytes``; ``Op.recurrent_layers``) on *calibration*
nets of other sizes than that benchmark's, which stays the held-out check:

* each net (GRU or LSTM, ``input:hidden``, a linear head on the last state) is exported for full
  fine-tuning at micro-batches 1 and ``--batch`` and measured ``--repeats`` times by the
  project's measuring protocol (``recurrent_budget.measure_net``: a fresh torch-free process,
  freed heap returned to the OS before the baseline);
* the **expected** constant is the mean, over plans, of the measured call's mean minus the expected
  figure without the constant (per recurrent layer; at least 0);
* the **bound** constant is the least that puts every plan's *largest* repeat, plus ``--margin``,
  under the bound (and at least the expected constant): the heap's high-water mark varies from
  process to process, so a bound covers the worst repeat seen.

Both are written to ``edgeadapt/sched/cost_model.json`` (the bound at the top level, the point
estimate under ``expected``), with the measurements under ``calibration.recurrent``, atomically.

    .venv/bin/python benchmarks/calibrate_recurrent.py                 # the shipped constant
    .venv/bin/python benchmarks/calibrate_recurrent.py --out /tmp/c.json --nets gru:8:8 --repeats 2
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import shlex
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Other sizes than recurrent_budget.DEFAULT_NETS, whose nets check the fitted constant.
CALIBRATION_NETS = ("gru:8:8", "gru:16:32", "gru:48:24", "lstm:8:8", "lstm:16:32", "lstm:48:24")


def fit(rows: list[dict], current_expected: int, current_bound: int, margin: float) -> tuple[int, int]:
    """(expected, bound) bytes per recurrent layer from measured ``rows`` (one per repeat; each
    with ``plan``, ``recurrent_layers``, ``expected_bytes``, ``predicted_bytes`` made with the current
    constants ``current_expected`` / ``current_bound``, and ``call_peak_anon_bytes``)."""
    plans: dict[str, list[dict]] = {}
    for r in rows:
        plans.setdefault(r["plan"], []).append(r)
    over_expected, needed = [], []
    for reps in plans.values():
        layers = reps[0]["recurrent_layers"]
        measured = [r["call_peak_anon_bytes"] for r in reps]
        expected_without = reps[0]["expected_bytes"] - layers * current_expected
        bound_without = reps[0]["predicted_bytes"] - layers * current_bound
        over_expected.append((statistics.fmean(measured) - expected_without) / layers)
        needed.append(((1.0 + margin) * max(measured) - bound_without) / layers)
    expected = max(0, round(statistics.fmean(over_expected)))
    return expected, max(expected, math.ceil(max(needed)))


def main(argv: list[str] | None = None) -> int:
    from recurrent_budget import measure_nets, parse_net_args  # benchmarks/, the script's directory

    from edgeadapt.atomic import atomic_write_json
    from edgeadapt.sched import CostModel

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--margin", type=float, default=0.05, help="the bound covers each plan's largest repeat by this")
    ap.add_argument("--out", type=Path, default=ROOT / "edgeadapt" / "sched" / "cost_model.json")
    args = parse_net_args(ap, argv, CALIBRATION_NETS, 3, "fresh processes per plan")
    shipped = CostModel.default("ort-training")
    current = (CostModel.expected("ort-training").recurrent_layer_bytes, shipped.recurrent_layer_bytes)
    rows = measure_nets(args)
    expected, bound = fit(rows, *current, args.margin)
    print(f"recurrent_layer_bytes: expected {expected} ({expected / 1024:.0f} KiB), bound {bound} "
          f"({bound / 1024:.0f} KiB); before {current[0]} / {current[1]}")
    d = json.loads(args.out.read_text()) if args.out.exists() else {}
    d["recurrent_layer_bytes"] = bound
    d.setdefault("expected", {})["recurrent_layer_bytes"] = expected
    d.setdefault("calibration", {})["recurrent"] = {
        "command": "benchmarks/calibrate_recurrent.py " + shlex.join(argv if argv is not None else sys.argv[1:]),
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "figure": "call_peak_anon_bytes (edgeadapt.measure, fresh process, heap trimmed)",
        "margin": args.margin, "expected_bytes": expected, "bound_bytes": bound,
        "rows": [{k: r[k] for k in ("plan", "repeat", "expected_bytes", "predicted_bytes", "call_peak_anon_bytes")}
                 for r in rows]}
    atomic_write_json(args.out, d)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
