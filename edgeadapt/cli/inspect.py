"""``edgeadapt inspect``: what a bundle trains, how many bytes, versions, checksums (torch-free)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..units import format_bytes
from .common import printable

__all__ = ["bundle_summary", "cmd_inspect", "add_parser"]


def bundle_summary(bundle_dir: str) -> dict:
    """What ``edgeadapt inspect`` reports, as a JSON-able dict (checksums are verified)."""
    from ..bundle import read_manifest

    m = read_manifest(bundle_dir, verify=True)
    itemsize = 4  # float32 parameters
    return {
        "bundle": str(bundle_dir),
        "checksums": "ok",
        "input": m.input.to_dict(), "output": m.output.to_dict(), "label": m.label,
        "loss": m.loss, "optimizer": m.optimizer, "batchnorm": m.batchnorm, "policy": m.policy,
        "state": m.state, "versions": m.versions,
        "total_numel": m.total_numel, "trainable_numel": m.trainable_numel,
        "trainable_bytes": m.trainable_numel * itemsize,
        "gradient_bytes": m.trainable_numel * itemsize,
        "optimizer_state_bytes": m.optimizer_state_numel * itemsize,
        "parameters": [
            {"name": p.name, "shape": list(p.shape), "mode": p.mode, "trainable_numel": p.trainable_numel}
            for p in m.parameters
        ],
        "files": {name: {"sha256": sha, "bytes": (Path(bundle_dir) / name).stat().st_size}
                  for name, sha in m.sha256.items()},
    }


def cmd_inspect(args: argparse.Namespace) -> int:
    s = bundle_summary(args.bundle)
    if args.json:
        print(json.dumps(s, indent=2))
        return 0

    def echo(text: str) -> None:  # names, specs and versions come from the bundle
        print(printable(text))

    echo(f"bundle      {s['bundle']}  (checksums {s['checksums']})")
    echo(f"input       {s['input']['name']} {s['input']['shape']} {s['input']['dtype']}")
    echo(f"output      {s['output']['name']} {s['output']['shape']} {s['output']['dtype']}")
    echo(f"loss        {s['loss']}   labels: {s['label']}")
    echo(f"optimizer   {s['optimizer']}")
    echo(f"batchnorm   {s['batchnorm']}   state: {s['state']}")
    pct = 100.0 * s["trainable_numel"] / max(1, s["total_numel"])
    echo(f"trains      {s['trainable_numel']:,} of {s['total_numel']:,} elements ({pct:.2f}%)")
    echo(f"update mem  params {format_bytes(s['trainable_bytes'])} + grads {format_bytes(s['gradient_bytes'])}"
         f" + optimizer state {format_bytes(s['optimizer_state_bytes'])}")
    echo("parameters:")
    for p in s["parameters"]:
        if p["trainable_numel"] or args.all:
            echo(f"  {p['name']:<40} {str(p['shape']):<16} {p['mode']:<9} {p['trainable_numel']:>10,}")
    if not args.all:
        n_frozen = sum(1 for p in s["parameters"] if not p["trainable_numel"])
        echo(f"  ... {n_frozen} frozen parameters (--all lists them)")
    echo("files:")
    for name, f in s["files"].items():
        echo(f"  {name:<32} {format_bytes(f['bytes']):>10}  sha256 {f['sha256'][:16]}")
    echo("versions:   " + ", ".join(f"{k} {v}" for k, v in s["versions"].items()))
    return 0


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """The ``inspect`` subcommand's parser."""
    p = sub.add_parser("inspect", help="what trains, how many bytes, versions, checksums")
    p.add_argument("bundle")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--all", action="store_true", help="list frozen parameters too")
    p.set_defaults(func=cmd_inspect)
    return p
