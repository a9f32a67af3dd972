"""``edgeadapt adapt --unlabeled``: safe label-free adaptation from the command line (torch-free).

Adapts a bundle on a data file's windows without their labels (``Runner.adapt_unlabeled``), or,
with ``--stream-batch N``, feeds the file as a stream of ``N``-window batches as they would
arrive on a device (``Runner.adapt_stream``, memory bounded). Prints the safety gate's decision
and its evidence; ``--json`` prints the whole :class:`~edgeadapt.runtime.unlabeled.UnlabeledResult`.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

import numpy as np

__all__ = ["add_unlabeled_arguments", "check_unlabeled_arguments", "run_unlabeled"]


def add_unlabeled_arguments(p: argparse.ArgumentParser) -> None:
    """The ``adapt`` options of label-free adaptation (and ``--json``, which both kinds take)."""
    p.add_argument("--unlabeled", action="store_true",
                   help="safe label-free adaptation (labels ignored): BatchNorm statistics moved as far as "
                        "the evidence of a shift supports, prototype head, "
                        "resets on collapse, a gate that returns to the source model when adaptation looks harmful")
    p.add_argument("--stream-batch", type=int, default=None, metavar="N",
                   help="with --unlabeled: feed the data as a stream of N-window batches (online, memory bounded)")
    p.add_argument("--json", action="store_true",
                   help="print the result as JSON, alone on stdout (AdaptResult, or with --unlabeled "
                        "UnlabeledResult; and saved_to)")


def check_unlabeled_arguments(args: argparse.Namespace) -> None:
    """Refuse inconsistent options before any data is read (``ValueError``: CLI exit 2)."""
    if args.stream_batch is not None and not args.unlabeled:
        raise ValueError("--stream-batch feeds label-free adaptation; add --unlabeled")
    if args.stream_batch is not None and args.stream_batch < 1:
        raise ValueError(f"--stream-batch must be >= 1, got {args.stream_batch}")


def run_unlabeled(args: argparse.Namespace, runner, X: np.ndarray) -> int:
    """Adapt ``runner`` on ``X`` label-free (see module docstring), save it to ``--out``, report."""
    from ..runtime.unlabeled import UnlabeledSettings

    settings = UnlabeledSettings(seed=args.seed)
    where = sys.stderr if args.json else sys.stdout  # --json: stdout holds the JSON alone
    if args.stream_batch is None:
        print(f"adapting label-free on {runner.device}: {len(X)} windows", file=where)
        result = runner.adapt_unlabeled(X, settings)
    else:
        n = args.stream_batch
        print(f"adapting label-free on {runner.device}: a stream of {len(X)} windows in batches of {n}", file=where)
        result = runner.adapt_stream((X[i:i + n] for i in range(0, len(X), n)), settings)
    out = runner.save(args.out)
    if args.json:
        print(json.dumps({**asdict(result), "saved_to": str(out)}))
        return 0
    gate = result.gate
    verdict = ("kept the adaptation" if result.kept else "returned to the source model")
    print(f"{verdict}: stages {', '.join(result.stages) or 'none'}; {result.n_adapt_windows} windows adapted on, "
          + (f"each held back once for the gate (cross-fitted: {result.settings['gate_fraction']:.0%} at a time)"
             if result.cross_fitted
             else f"{result.n_gate_windows} held back for the gate"))
    if result.stats_layer_weights:
        weights = list(result.stats_layer_weights.values())
        layers = f"{len(weights)} BatchNorm layer{'s' * (len(weights) != 1)}"
        print(f"statistics: target weight {result.stats_weight:.2f} on average over {layers} "
              f"({min(weights):.2f}..{max(weights):.2f}; 0 = the source's, 1 = the new windows')")
    if gate is not None:
        print(f"gate: view agreement {gate.source.view_agreement:.3f} (source) -> {gate.adapted.view_agreement:.3f}, "
              f"mean entropy {gate.source.mean_entropy:.3f} -> {gate.adapted.mean_entropy:.3f}, "
              f"{gate.changed_fraction:.0%} of held-back windows changed class"
              + ("" if gate.kept else "; refused: " + "; ".join(gate.reasons)))
    for line in (*result.skipped, *result.resets):
        print(f"note: {line}")
    print(f"saved to {out}")
    return 0
