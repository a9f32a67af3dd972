"""``edgeadapt train``: full training on the server, streaming state from host or disk (the
work is :mod:`edgeadapt.server.train_cli`'s; its options are declared here so that parsing
imports no torch)."""

from __future__ import annotations

import argparse

__all__ = ["cmd_train", "add_train_arguments", "add_parser"]


def cmd_train(args: argparse.Namespace) -> int:
    from ..server.train_cli import cmd_train as run

    return run(args, echo=print)


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    """The options of :mod:`edgeadapt.server.train_cli`."""
    p.add_argument("--model", required=True,
                   choices=("gpt-nano", "gpt-mini", "gpt-small", "cnn", "mobilenet", "transformer"),
                   help="a GPT preset or a biosignal reference model")
    p.add_argument("--data", "--dataset", dest="data", default="synthetic",
                   help="GPT: 'synthetic' (a seeded token stream) or a .npy of int token ids; "
                        "biosignal models: synthetic | watch | a .npz/.csv file (default: synthetic)")
    p.add_argument("--steps", type=int, required=True, help="optimizer steps in all (a resumed run continues to it)")
    p.add_argument("--batch-size", type=int, default=None,
                   help="global batch (sequences or windows over all ranks; default 8 for GPT, 64 otherwise)")
    p.add_argument("--lr", type=float, default=3e-4, help="AdamW learning rate")
    p.add_argument("--weight-decay", type=float, default=0.01, help="AdamW decoupled weight decay")
    p.add_argument("--seed", type=int, default=0, help="seeds the initialisation and the data order")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="compute device; auto: CUDA when available (each torchrun rank takes its LOCAL_RANK GPU)")
    p.add_argument("--memory-budget", default=None,
                   help="bytes the trainer may hold on the compute device, e.g. 2GiB (default: no limit)")
    p.add_argument("--offload", choices=("host", "disk", "none"), default="host",
                   help="where the master weights and optimizer state live (default: host)")
    p.add_argument("--recompute", choices=("auto", "on", "off"), default="auto",
                   help="recompute activations in the backward pass instead of keeping them")
    p.add_argument("--shard-optimizer-state", action="store_true",
                   help="under torchrun, ZeRO-1: each rank keeps the AdamW state of its own blocks only (about "
                        "1/world size of it) and broadcasts their updated weights; needs --offload host|disk")
    p.add_argument("--checkpoint-dir", help="run directory: checkpoints, offload state, weights.pt (required "
                                            "unless --plan-only)")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --checkpoint-dir")
    p.add_argument("--checkpoint-every", type=int, default=0,
                   help="steps between checkpoints (default 0: only at the end)")
    p.add_argument("--hold-out-subject", type=int, default=None,
                   help="biosignal models only (cnn, mobilenet, transformer; refused for GPT): leave this subject "
                        "out; write 5 of its windows per class to held_out_adapt.npz and the others to "
                        "held_out_eval.npz")
    p.add_argument("--context-len", type=int, default=None,
                   help="GPT only: tokens per sequence (default: the preset's)")
    p.add_argument("--n-layers", type=int, default=None, help="GPT only: decoder blocks (default: the preset's)")
    p.add_argument("--d-model", type=int, default=None, help="GPT only: width (default: the preset's)")
    p.add_argument("--vocab-size", type=int, default=None, help="GPT only: vocabulary (default: the preset's)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--plan-only", action="store_true",
                   help="print the offload plan (tiers, recompute per block, update chunk, prefetch, micro-batches, "
                        "predicted peak) for --memory-budget and exit without training or writing anything")


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """The ``train`` subcommand's parser."""
    p = sub.add_parser("train", help="train every parameter on the server, streaming state from host or disk",
                       description="Full training with the streaming/offload trainer; under torchrun, data parallel.")
    add_train_arguments(p)
    p.set_defaults(func=cmd_train, extra="server")
    return p
