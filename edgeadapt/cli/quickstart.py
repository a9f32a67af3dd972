"""``edgeadapt quickstart``: the main job on built-in data: pretrain, export, adapt, report."""

from __future__ import annotations

import argparse
from pathlib import Path

__all__ = ["cmd_quickstart", "add_parser"]


def cmd_quickstart(args: argparse.Namespace) -> int:
    import matplotlib  # noqa: F401  (the plots, and torch below: missing extras fail before any work)
    import torch  # noqa: F401

    from ..harness.quickstart import QuickstartConfig, run_quickstart

    cfg = QuickstartConfig(dataset=args.dataset, model=args.model, policy=args.policy, out_dir=Path(args.out),
                           k_per_class=args.k_per_class, epochs=args.epochs, seed=args.seed, small=args.small,
                           memory_budget=args.memory_budget, threads=args.threads, progress=not args.no_progress)
    run_quickstart(cfg, echo=print)
    return 0


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """The ``quickstart`` subcommand's parser."""
    p = sub.add_parser("quickstart", help="the main job on built-in data: pretrain, export, adapt, report")
    p.add_argument("--dataset", default="synthetic", help="synthetic | watch | path to a .npz/.csv")
    p.add_argument("--model", default="cnn", choices=("cnn", "mobilenet", "transformer"))
    p.add_argument("--policy", default="sparse",
                   help="sparse (default) | last-layer | bias-norm | full | pattern=mode,...")
    p.add_argument("--k-per-class", type=int, default=5, help="labeled windows per class from the new subject")
    p.add_argument("--epochs", type=int, default=None, help="adaptation epochs (default: chosen for the data)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/quickstart", help="report folder")
    p.add_argument("--memory-budget", metavar="BYTES", default=None,
                   help="also run the planner's choice within this budget per adapt call (e.g. 256KiB)")
    p.add_argument("--small", action="store_true", help="a tiny setting for smoke tests")
    p.add_argument("--threads", type=int, default=1,
                   help="intra-op threads of pretraining and adaptation (default 1; the figures depend on it)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars (pretraining, exports)")
    p.set_defaults(func=cmd_quickstart, extra="server")
    return p
