"""Recurrent nets trained whole under a budget: expected, bound and measured, over hidden and input sizes.

Each net is a GRU or LSTM (``input`` features, ``hidden`` units, ``--time-steps`` steps) and a
``Linear`` head on its last state. It is exported with full fine-tuning at a micro-batch of 1 and of
``--batch`` windows, under a budget 1 KiB over the bound the planner predicts for that plan (so the
planner keeps it), and one ``adapt`` call (``--epochs`` over ``--n-windows`` windows) is measured by
the project's measuring protocol (``edgeadapt.measure``: a fresh torch-free process, progress bar
on, nothing warmed up, freed heap returned to the OS before the baseline: the bound for any history
of the process). Figures are KiB over the process just before the call.

What it checks: a recurrent layer's weights reach its node through per-gate re-ordering
(``Split`` + ``Concat``), which the training graph runs at every step, and its gradient kernel
accumulates through weight-sized buffers of its own; these grow with ``hidden x (input + hidden)``,
not with the windows (``Op.param_copy_bytes`` / ``param_grad_bytes``, docs/cost_model.md).

Usage::

    .venv/bin/python benchmarks/recurrent_budget.py            # writes benchmarks/results/recurrent_budget.{json,md}
    .venv/bin/python benchmarks/recurrent_budget.py --nets gru:4:64 lstm:32:16 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

DEFAULT_NETS = ("gru:4:16", "gru:4:64", "gru:4:128", "gru:32:16", "gru:64:64",
                "lstm:4:16", "lstm:4:64", "lstm:4:128", "lstm:32:16")


def _net(kind: str, inputs: int, hidden: int):
    from torch import nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = (nn.GRU if kind == "gru" else nn.LSTM)(inputs, hidden, batch_first=True)
            self.head = nn.Linear(hidden, 3)

        def forward(self, x):  # x: (batch, inputs, time)
            return self.head(self.rnn(x.transpose(1, 2))[0][:, -1])

    return Net().eval()


def measure_net(spec: str, micro: int, args, workdir: Path, repeat: int) -> dict:
    import torch

    from edgeadapt import sched
    from edgeadapt.export import UpdatePolicy, export_bundle, plan_cost
    from edgeadapt.export.planning import model_graph
    from edgeadapt.measure import MeasureSpec, measure_in_fresh_process

    kind, inputs, hidden = spec.split(":")
    inputs, hidden = int(inputs), int(hidden)
    torch.manual_seed(args.seed)
    model = _net(kind, inputs, hidden)
    example = torch.randn(8, inputs, args.time_steps)
    graph, weights = model_graph(model, example, "frozen")
    plan = sched.plan_from_policy(graph, sched.UpdatePolicy.full(), weights=weights, batch_windows=args.batch,
                                  micro_batch_windows=micro, n_windows=args.n_windows)
    budget = sched.predict(graph, plan, plan_cost("ort-training")).peak_bytes + 1024
    out = workdir / f"{kind}-{inputs}-{hidden}-{micro}-{repeat}"
    manifest = export_bundle(model, example, out, policy=UpdatePolicy.full(), memory_budget=budget,
                             n_windows=args.n_windows, batch_windows=args.batch, backend="ort-training")
    got = measure_in_fresh_process(MeasureSpec(bundle=str(out), epochs=args.epochs, threads=1, seed=args.seed,
                                               backend="ort-training", trim_heap=True, progress=True),
                                   env={"OMP_NUM_THREADS": "1"})
    rnn = next(o for o in graph.ops if o.module == "rnn")
    return {"net": spec, "kind": kind, "inputs": inputs, "hidden": hidden, "repeat": repeat,
            "budget_bytes": budget, "micro_batch_windows": manifest.plan["micro_batch_windows"],
            "predicted_bytes": int(manifest.plan["predicted_peak_bytes"]),
            "expected_bytes": (manifest.plan.get("expected_peak_bytes") or {}).get("ort-training"),
            "param_copy_bytes": rnn.param_copy_bytes, "param_grad_bytes": rnn.param_grad_bytes,
            "recurrent_layers": sum(o.recurrent_layers for o in graph.ops),
            "call_peak_anon_bytes": got["call_peak_anon_bytes"], "call_peak_bytes": got["call_peak_bytes"]}


def to_markdown(rows: list[dict], command: str, args) -> str:
    kib = 1024.0
    out = [f"Command: `{command}` ({args.n_windows} windows, batch {args.batch}, {args.epochs} epochs, "
           f"{args.time_steps} steps, full fine-tuning, onnxruntime-training, 1 thread). KiB over the process "
           "just before the call, freed heap returned to the OS first.", "",
           "| net (input:hidden) | micro | parameter copies + gradient buffers | expected | bound (= budget - 1 KiB) "
           "| measured anon | measured total | bound/anon |",
           "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        anon = r["call_peak_anon_bytes"]
        over = anon > r["budget_bytes"]
        cell = f"**{anon / kib:.0f}** (over)" if over else f"{anon / kib:.0f}"
        expected = "-" if r["expected_bytes"] is None else f"{r['expected_bytes'] / kib:.0f}"
        out.append(f"| {r['kind']} {r['inputs']}:{r['hidden']} | {r['micro_batch_windows']} | "
                   f"{(r['param_copy_bytes'] + r['param_grad_bytes']) / kib:.0f} | {expected} | "
                   f"{r['predicted_bytes'] / kib:.0f} | {cell} | {r['call_peak_bytes'] / kib:.0f} | "
                   f"{r['predicted_bytes'] / max(1, anon):.2f} |")
    within = sum(r["call_peak_anon_bytes"] <= r["budget_bytes"] for r in rows)
    out += ["", f"Measured anonymous within the budget: {within} of {len(rows)}."]
    return "\n".join(out) + "\n"


def parse_net_args(ap: argparse.ArgumentParser, argv: list[str] | None, nets: tuple[str, ...], repeats: int,
                   help_repeats: str) -> argparse.Namespace:
    """Add the options every recurrent-net measurement takes (``nets``, ``repeats``: their
    defaults), parse ``argv`` and check the nets' specs."""
    ap.add_argument("--nets", nargs="+", default=list(nets), help="kind:input:hidden, kind gru or lstm")
    ap.add_argument("--micro", type=int, nargs="+", default=[1, 16], help="micro-batches (windows) to plan")
    ap.add_argument("--time-steps", type=int, default=32)
    ap.add_argument("--n-windows", type=int, default=40)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=repeats, help=help_repeats)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    for spec in args.nets:
        parts = spec.split(":")
        if len(parts) != 3 or parts[0] not in ("gru", "lstm") or not all(p.isdigit() for p in parts[1:]):
            ap.error(f"--nets takes kind:input:hidden with kind gru or lstm, got {spec!r}")
    return args


def measure_nets(args: argparse.Namespace) -> list[dict]:
    """Every net x micro-batch x repeat of ``args``, each measured in a fresh process, printed as it comes."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for spec in args.nets:
            for micro in args.micro:
                for repeat in range(args.repeats):
                    row = measure_net(spec, micro, args, Path(tmp), repeat)
                    row["plan"] = f"{spec} micro {micro}"
                    rows.append(row)
                    print(f"{row['plan']} #{repeat}: expected {row['expected_bytes'] / 1024:.0f} bound "
                          f"{row['predicted_bytes'] / 1024:.0f} measured {row['call_peak_anon_bytes'] / 1024:.0f} "
                          "KiB anon", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "recurrent_budget")
    args = parse_net_args(ap, argv, DEFAULT_NETS, 1, "measurements per net and micro-batch")
    command = "python benchmarks/recurrent_budget.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    rows = measure_nets(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"command": command, "rows": rows}, indent=1))
    args.out.with_suffix(".md").write_text(to_markdown(rows, command, args))
    print(to_markdown(rows, command, args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
