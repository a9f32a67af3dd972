"""``edgeadapt`` command line: export, inspect, adapt, evaluate, export-inference, quickstart.

One module per subcommand (``cmd_<verb>`` and ``add_parser``); this package assembles the parser
and runs ``main``, the console script's entry point.

Only ``export`` and ``quickstart`` import torch; the device-side commands (inspect, adapt,
evaluate, export-inference) run with numpy + onnxruntime alone.
"""

from __future__ import annotations

import argparse
import logging
import sys

from . import adapt, evaluate, export, export_inference, inspect, plan, quickstart, train
from .common import printable

__all__ = ["main", "build_parser"]

# Third-party packages a command's extra brings; a command that finds one missing names the
# extra to install (``set_defaults(extra=...)`` on its parser) instead of a traceback.
EXTRA_PACKAGES = {"server": ("torch", "onnx", "onnxruntime", "matplotlib")}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="edgeadapt", description=__doc__.split("\n")[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress details")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for verb in (export, inspect, adapt, evaluate, export_inference, quickstart, train):
        verb.add_parser(sub)
    plan.add_plan_parser(sub)
    return parser


def _missing_extra(args: argparse.Namespace, error: ModuleNotFoundError) -> str | None:
    """The one-line error for a command whose extra is not installed; ``None`` when ``error`` is
    not about a package of that extra (a bug or a missing user module: the traceback stays)."""
    extra = getattr(args, "extra", None)
    missing = (error.name or "").split(".")[0]
    if extra is None or missing not in EXTRA_PACKAGES[extra]:
        return None
    return (f"edgeadapt {args.command} needs {missing}, which is not installed here; install the "
            f"{extra} extra: pip install \".[{extra}]\" in an edgeadapt checkout "
            "(a device install has only the runtime)")


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``edgeadapt`` console script."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    from ..bundle import BundleError

    known = (BundleError, ValueError, OSError, RuntimeError)
    try:
        return args.func(args)
    except ModuleNotFoundError as e:
        hint = _missing_extra(args, e)
        if hint is None or args.verbose:
            raise
        print(f"error: {hint}", file=sys.stderr)
        return 2
    except known as e:
        if args.verbose:
            raise
        print(f"error: {printable(str(e), keep=chr(10))}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
