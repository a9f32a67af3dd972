"""Does the memory budget hold on small user models? A check, not a timed test.

Exports a few small, generic, user-style models (none of them one the cost model was fitted
on) with ``export_bundle(net, example, out, memory_budget=B, n_windows=40, batch_windows=16)``
at a few budgets each (the planner picks what trains) and measures each bundle's whole
``adapt`` call with ``edgeadapt.cli.plan.measure_adapt`` (the ``edgeadapt plan --measure`` job:
a fresh torch-free process, one epoch over the planned windows, the measuring protocol of
docs/design.md, "Measuring": freed heap returned to the OS before the baseline). Reports the
predicted peak, the measured anonymous (sampled RssAnon) and total (VmHWM) peaks over the loaded
runner, median of ``--repeats`` processes, and whether the anonymous peak is within the budget.

Models (input shape in brackets):

* ``groupnorm``: Conv1d(4,16,5) + GroupNorm(4,16) + ReLU + mean + Linear(16,3)   [8 x 4 x 32]
  (ONNX Runtime has no InstanceNormalization gradient, so the conv before the norm cannot train);
* ``gru``: GRU(4,16) over the 32 steps + Linear(16,3) on the last state            [8 x 4 x 32]
* ``conv2d``: Conv2d(1,8,3) + BatchNorm2d(8) + ReLU + mean + Linear(8,3)          [8 x 1 x 16 x 16]
* ``mlp``: Flatten + Linear(128,64) + ReLU + Linear(64,32) + ReLU + Linear(32,3)   [8 x 4 x 32]

Usage::

    # writes benchmarks/results/small_models_budget.{json,md}
    .venv/bin/python benchmarks/small_models_budget.py --repeats 3
    .venv/bin/python benchmarks/small_models_budget.py --models gru --budgets 300KiB
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DEFAULT_BUDGETS = ("300KiB", "600KiB", "1MiB", "2MiB")
N_WINDOWS, BATCH_WINDOWS = 40, 16

from edgeadapt.harness.budget_check import USER_MODELS as MODELS, build  # noqa: E402  (after the path setup)


def run(models, budgets, repeats: int, tmp: Path) -> list[dict]:
    from edgeadapt.export import export_bundle
    from edgeadapt.cli.plan import measure_adapt, plan_report
    from edgeadapt.units import parse_bytes

    rows = []
    for name in models:
        for budget in budgets:
            row = {"model": name, "budget": budget, "budget_bytes": parse_bytes(budget)}
            out = tmp / f"{name}-{budget}"
            try:
                net, x = build(name)
                export_bundle(net, x, out, memory_budget=budget, n_windows=N_WINDOWS, batch_windows=BATCH_WINDOWS)
            except Exception as e:  # noqa: BLE001 - a failed export is a result of the check
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
                rows.append(row)
                print(f"{name:<10} {budget:>7}: export failed: {row['error']}", flush=True)
                continue
            rep = plan_report(out)
            peak = rep["predicted_now"] or rep["predicted"]
            runs = [measure_adapt(out) for _ in range(repeats)]
            for r in runs:
                r.pop("timeline", None)
            anon = int(statistics.median(r["call_peak_anon_bytes"] for r in runs))
            total = int(statistics.median(r["call_peak_bytes"] for r in runs))
            row.update({
                "trains": [t["name"] for t in rep["trains"]], "trainable_numel": rep["trainable_numel"],
                "total_numel": rep["total_numel"], "cut": None if rep["cut"] is None else rep["cut"]["index"],
                "cache_features": rep["cache_features"], "micro_batch_windows": rep["micro_batch_windows"],
                "recompute": rep["recompute"], "predicted_bytes": peak["peak_bytes"], "predicted_where": peak["where"],
                "measured_anon_bytes": anon, "measured_total_bytes": total,
                "heap_trimmed": all(r.get("heap_trimmed") for r in runs), "runs": runs,
            })
            rows.append(row)
            print(f"{name:<10} {budget:>7}: trains {rep['trainable_numel']:>6} micro {rep['micro_batch_windows']:>2} "
                  f"cut {row['cut']} predicted {peak['peak_bytes'] / 1024:7.0f} KiB  measured anon "
                  f"{anon / 1024:7.0f} KiB total {total / 1024:7.0f} KiB", flush=True)
    return rows


def to_markdown(rows: list[dict], meta: dict) -> str:
    kib = 1024.0
    out = [f"# Small models: budget vs measured whole adapt call ({meta['date']})", "",
           f"{N_WINDOWS} windows, batch {BATCH_WINDOWS}, 1 epoch, AdamW, 1 thread, median of {meta['repeats']} fresh "
           "torch-free processes (`edgeadapt.cli.plan.measure_adapt`, freed heap trimmed before the baseline). "
           "KiB over the loaded runner.", "",
           "| model | budget | trains (elements) | micro | cut | predicted | measured anon | measured total | "
           "pred/meas | anon/budget |", "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['model']} | {r['budget']} | export failed: {r['error'][:120]} | | | | | | | |")
            continue
        ratio = r["measured_anon_bytes"] / r["budget_bytes"]
        out.append(f"| {r['model']} | {r['budget']} | {', '.join(r['trains'])} ({r['trainable_numel']}) | "
                   f"{r['micro_batch_windows']} | {r['cut'] if r['cut'] is not None else '-'} | "
                   f"{r['predicted_bytes'] / kib:.0f} | {r['measured_anon_bytes'] / kib:.0f} | "
                   f"{r['measured_total_bytes'] / kib:.0f} | "
                   f"{r['predicted_bytes'] / max(1, r['measured_anon_bytes']):.2f} | "
                   + (f"**{ratio:.2f}**" if ratio > 1 else f"{ratio:.2f}") + " |")
    ok = [r for r in rows if "error" not in r]
    kept = sum(r["measured_anon_bytes"] <= r["budget_bytes"] for r in ok)
    close = sum(abs(r["predicted_bytes"] / max(1, r["measured_anon_bytes"]) - 1) <= 0.15 for r in ok)
    out += ["", f"Within the budget (anonymous): {kept} of {len(ok)} measured; predicted within +-15 %: {close} of "
            f"{len(ok)}; failed exports: {len(rows) - len(ok)}."]
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    p.add_argument("--budgets", nargs="+", default=list(DEFAULT_BUDGETS))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = p.parse_args(argv)

    from edgeadapt.atomic import atomic_write_bytes, atomic_write_json
    from edgeadapt.versions import host_info, package_versions

    with tempfile.TemporaryDirectory(prefix="edgeadapt-small-") as tmp:
        rows = run(args.models, args.budgets, args.repeats, Path(tmp))
    meta = {"date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "repeats": args.repeats,
            "command": " ".join(["benchmarks/small_models_budget.py", *(argv or sys.argv[1:])]),
            "versions": package_versions(("edgeadapt", "numpy", "torch", "onnx", "onnxruntime-training-cpu")),
            "host": host_info()}
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out / "small_models_budget.json", {"meta": meta, "rows": rows})
    atomic_write_bytes(args.out / "small_models_budget.md", to_markdown(rows, meta).encode())
    print(to_markdown(rows, meta))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
