"""``edgeadapt adapt``: adapt a bundle on new data, labeled or not (torch-free)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from ..interrupt import INTERRUPTED
from .common import add_data, add_device, load_data

__all__ = ["cmd_adapt", "add_parser"]


def cmd_adapt(args: argparse.Namespace) -> int:
    try:
        return _adapt(args)
    except KeyboardInterrupt:  # Ctrl-C outside the training steps (loading, saving): nothing was saved
        print("interrupted; nothing saved", file=sys.stderr)
        return INTERRUPTED


def _adapt(args: argparse.Namespace) -> int:
    from ..bundle import read_manifest
    from ..runtime import AdaptInterrupted, NonFiniteLossError, Runner
    from ..runtime.validate import check_learning_rate

    if args.lr is not None:
        check_learning_rate(args.lr, "--lr")
    if args.epochs < 1 or args.batch_size < 1:
        raise ValueError(f"--epochs and --batch-size must be >= 1, got {args.epochs} and {args.batch_size}")
    if args.seed < 0:
        raise ValueError(f"--seed must be >= 0, got {args.seed}")
    from .unlabeled import check_unlabeled_arguments, run_unlabeled

    check_unlabeled_arguments(args)
    X, y = load_data(args, read_manifest(args.bundle, verify=False), labels=not args.unlabeled)
    runner = Runner.load(args.bundle, device=args.device, threads=args.threads, backend=args.backend)
    runner.check_save_target(args.out)  # refused now, not after training
    if args.unlabeled:
        return run_unlabeled(args, runner, X)
    print(f"adapting on {runner.device}: {len(X)} windows, {args.epochs} epochs, batch {args.batch_size}",
          file=sys.stderr if args.json else sys.stdout)  # --json: stdout holds the JSON alone
    try:
        result = runner.adapt(X, y, epochs=args.epochs, batch_size=args.batch_size, lr=args.lr,
                              schedule=args.schedule, seed=args.seed, progress=not args.no_progress)
    except NonFiniteLossError as e:
        out = runner.save(args.out)
        print(f"error: {e}\nthe last good state (step {runner.step}) was saved to {out}", file=sys.stderr)
        return 3
    except AdaptInterrupted as stop:
        if not stop.epochs_done:
            print("interrupted before the first epoch ended; nothing saved", file=sys.stderr)
        else:
            out = runner.save(args.out)
            print(f"interrupted: saved epoch {runner.epoch} (step {runner.step}), the last completed one, to {out}",
                  file=sys.stderr)
        return INTERRUPTED
    out = runner.save(args.out)
    if args.json:
        print(json.dumps({**asdict(result), "saved_to": str(out)}))
        return 0
    losses = ", ".join(f"{v:.4f}" for v in result.epoch_losses)
    print(f"done: {result.steps} steps in {result.time_s:.1f} s; epoch losses {losses}; saved to {out}")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """The ``adapt`` subcommand's parser."""
    p = sub.add_parser("adapt", help="adapt a bundle on new data (torch-free)")
    p.add_argument("bundle")
    add_data(p)
    p.add_argument("--out", required=True, help="directory for the adapted bundle (new, or the same bundle)")
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default: the bundle's)")
    p.add_argument("--schedule", choices=("constant", "cosine"), default="constant")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    from .unlabeled import add_unlabeled_arguments

    add_unlabeled_arguments(p)
    add_device(p)
    p.set_defaults(func=cmd_adapt)
    return p
