"""``edgeadapt evaluate``: loss and accuracy of a bundle on labeled data (torch-free)."""

from __future__ import annotations

import argparse
import json

from .common import add_data, add_device, load_data

__all__ = ["cmd_evaluate", "add_parser"]


def cmd_evaluate(args: argparse.Namespace) -> int:
    from ..bundle import read_manifest
    from ..runtime import Runner

    X, y = load_data(args, read_manifest(args.bundle, verify=False), accuracy=True)
    runner = Runner.load(args.bundle, device=args.device, threads=args.threads, backend=args.backend)
    r = runner.evaluate(X, y)
    result = {"loss": r.loss, "accuracy": r.accuracy, "n_windows": r.n_windows}
    print(json.dumps(result) if args.json else
          f"loss {r.loss:.4f}" + (f"  accuracy {r.accuracy:.4f}" if r.accuracy is not None else "")
          + f"  ({r.n_windows} windows)")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """The ``evaluate`` subcommand's parser."""
    p = sub.add_parser("evaluate", help="loss and accuracy of a bundle on labeled data (torch-free)")
    p.add_argument("bundle")
    add_data(p)
    p.add_argument("--json", action="store_true")
    add_device(p)
    p.set_defaults(func=cmd_evaluate)
    return p
