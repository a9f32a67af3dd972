"""README's device budget table: per model and budget, predicted / measured anonymous / measured total.

A thin script over ``edgeadapt.harness.budget_check``: each reference model (cnn, mobilenet,
transformer; ``--channels`` x ``--time-steps``) and each user-style net (gru, groupnorm, conv2d,
mlp) is exported at ``--budgets`` budgets from its smallest feasible one to full fine-tuning's
predicted peak, and one ``Runner.adapt`` call (``--epochs`` epochs over ``--n-windows`` windows,
batch ``--batch``) is measured by the project's measuring protocol (``edgeadapt.measure``: fresh
torch-free processes, progress bar on, nothing warmed up): the bound (freed heap returned to
the OS before the baseline: what the call allocates) and a user's process (a prediction first,
heap as it is). ``--batchnorm batch`` exports BatchNorm with batch statistics (then the smallest
budgets of the ladder may have no plan); ``--label-free`` also measures, per bundle, one
``Runner.adapt_unlabeled`` call with the recommended settings (``loss="entropy"`` export), which
either stays within the budget or is refused before any work.
Memory figures are robust to machine load; no times are reported.

Usage::

    .venv/bin/python benchmarks/budget_table.py            # writes benchmarks/results/budget_table_<backend>.{json,md}
    .venv/bin/python benchmarks/budget_table.py --models gru mlp --budgets 2
    .venv/bin/python benchmarks/budget_table.py --models cnn mobilenet conv2d --batchnorm batch --label-free
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from edgeadapt.harness.budget_check import (REFERENCE_MODELS, USER_MODELS, CheckSettings, build,  # noqa: E402
                                            check_budget, check_label_free_budget, model_budgets, summarize)


def to_markdown(rows: list[dict], command: str, settings: CheckSettings) -> str:
    kib = 1024.0
    s = summarize(rows)
    free = any("label_free" in r for r in rows)
    out = [f"Command: `{command}` ({settings.n_windows} windows, batch {settings.batch_windows}, {settings.epochs} "
           f"epochs, backend {settings.backend}, BatchNorm {settings.batchnorm}, 1 thread). KiB over the process "
           "just before the call.", "",
           "*expected*: the cost model's point estimate of the whole call; *bound*: the prediction the "
           "plan was made and checked with (the budget holds if the measured peak stays under it).", "",
           "| model | budget | trains (elements) | micro | expected | bound | measured anon | measured total "
           "| expected/anon | bound/anon | user process anon / total |"
           + (" label-free anon / user anon |" if free else ""),
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if free else "")]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['model']} | {r['budget_bytes'] / kib:.0f} | failed: {r['error'][:120]} | | | | | | | | |"
                       + (" |" if free else ""))
            continue
        over = r["call_peak_anon_bytes"] > r["budget_bytes"]
        anon = f"{r['call_peak_anon_bytes'] / kib:.0f}"
        out.append(f"| {r['model']} | {r['budget_bytes'] / kib:.0f} | {r['trainable_numel']:,} | "
                   f"{r['micro_batch_windows']} | {_kib(r.get('expected_bytes'))} | {r['predicted_bytes'] / kib:.0f} | "
                   f"{'**' + anon + '** (over)' if over else anon} | {r['call_peak_bytes'] / kib:.0f} | "
                   f"{_ratio(r.get('expected_over_anon'))} | {r['predicted_over_anon']:.2f} | "
                   f"{r['user_anon_bytes'] / kib:.0f} / "
                   f"{r['user_total_bytes'] / kib:.0f} |"
                   + (f" {_label_free_cell(r.get('label_free'))} |" if free else ""))
    out += ["", f"Measured anonymous within the budget: {s['within_budget']} of {s['rows']} (user process: "
            f"{s['user_within_budget']}); expected within +-15 % of it: {s['within_tolerance']} of {s['rows']} "
            f"(the bound: {s['bound_within_tolerance']})."]
    return "\n".join(out) + "\n"


def _kib(value: int | None) -> str:
    return "-" if value is None else f"{value / 1024:.0f}"


def _ratio(value: float | None) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:.2f}"


def _label_free_cell(row: dict | None) -> str:
    if row is None:
        return ""
    if row.get("error"):
        return f"failed: {row['error'][:80]}"
    if row["refused"]:
        return "refused before any work"
    anon = f"{row['call_peak_anon_bytes'] / 1024:.0f}"
    over = row["call_peak_anon_bytes"] > row["budget_bytes"]
    return f"{'**' + anon + '** (over)' if over else anon} / {row['user_anon_bytes'] / 1024:.0f}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=list(REFERENCE_MODELS + USER_MODELS),
                   choices=REFERENCE_MODELS + USER_MODELS)
    p.add_argument("--budgets", type=int, default=3, help="budgets per model, >= 2 (default 3)")
    p.add_argument("--n-windows", type=int, default=40)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--channels", type=int, default=8)
    p.add_argument("--time-steps", type=int, default=256)
    p.add_argument("--backend", choices=("ort-training", "portable"), default="ort-training")
    p.add_argument("--batchnorm", choices=("frozen", "batch"), default="frozen")
    p.add_argument("--label-free", action="store_true", help="also measure one label-free call per bundle")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = p.parse_args(argv)
    from edgeadapt.atomic import atomic_write_bytes, atomic_write_json
    from edgeadapt.versions import host_info

    settings = CheckSettings(n_windows=args.n_windows, batch_windows=args.batch, epochs=args.epochs,
                             channels=args.channels, time_steps=args.time_steps, backend=args.backend,
                             batchnorm=args.batchnorm)
    command = " ".join([".venv/bin/python", "benchmarks/budget_table.py", *map(shlex.quote, argv)])
    rows = []
    with tempfile.TemporaryDirectory(prefix="edgeadapt-budget-table-") as tmp:
        for name in args.models:
            model, example = build(name, settings)
            for budget in model_budgets(model, example, settings, args.budgets):
                try:
                    row = check_budget(name, budget, Path(tmp), settings)
                except Exception as e:  # noqa: BLE001 - a failed export or run is a row of the table
                    last = (str(e).strip().splitlines() or [""])[-1]  # a failed process: its error's last line
                    row = {"model": name, "budget_bytes": budget, "error": f"{type(e).__name__}: {last[:300]}"}
                if args.label_free and "error" not in row:
                    try:
                        row["label_free"] = check_label_free_budget(name, budget, Path(tmp), settings)
                    except Exception as e:  # noqa: BLE001 - as above
                        last = (str(e).strip().splitlines() or [""])[-1]
                        row["label_free"] = {"error": f"{type(e).__name__}: {last[:300]}"}
                rows.append(row)
                print({k: v for k, v in row.items() if k not in ("graph", "plan")}, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / ("budget_table_" + args.backend + ("_batch" if args.batchnorm == "batch" else "")
                       + ("_label_free" if args.label_free else ""))
    # the measurements first: a table that cannot be drawn must not lose them
    atomic_write_json(f"{stem}.json", {"command": command, "settings": asdict(settings), "host": host_info(),
                                       "rows": rows})
    md = to_markdown(rows, command, settings)
    atomic_write_bytes(f"{stem}.md", md.encode())
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
