"""``edgeadapt export-inference``: a plain ONNX model any onnxruntime can run, from a bundle."""

from __future__ import annotations

import argparse

from .common import add_backend

__all__ = ["cmd_export_inference", "add_parser"]


def cmd_export_inference(args: argparse.Namespace) -> int:
    from ..runtime import Runner

    runner = Runner.load(args.bundle, device="cpu", backend=args.backend)
    path = runner.export_inference(args.output)
    print(f"wrote {path}: a plain ONNX model ({runner.manifest.input.name} -> {runner.manifest.output.name})")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """The ``export-inference`` subcommand's parser."""
    p = sub.add_parser("export-inference", help="write a plain ONNX model any onnxruntime can run")
    p.add_argument("bundle")
    p.add_argument("output", help="path of the .onnx file")
    add_backend(p)
    p.set_defaults(func=cmd_export_inference)
    return p
