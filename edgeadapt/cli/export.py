"""``edgeadapt export``: a torch model (module:factory) to an on-device training bundle."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..units import format_bytes
from .common import data_layout, load_factory

__all__ = ["cmd_export", "add_parser"]


def cmd_export(args: argparse.Namespace) -> int:
    import torch

    from ..export import OptimizerConfig, UpdatePolicy, export_bundle

    shape = _input_shape(args.input_shape)
    model = _build_model(args.model, args.factory_kwargs)
    if args.weights:
        state = torch.load(args.weights, map_location="cpu", weights_only=True)
        model.load_state_dict(state)
    example = torch.randn(args.batch_size, *shape)
    opt = OptimizerConfig(args.optimizer, lr=args.lr,
                          weight_decay=args.weight_decay if args.optimizer == "adamw" else 0.0)
    policy = UpdatePolicy.parse(args.policy) if args.policy else None
    if args.validate_on:
        policy = _validated_policy(args, model, example)
    manifest = export_bundle(model, example, args.out, policy=policy, loss=args.loss, optimizer=opt,
                             batchnorm=args.batchnorm, memory_budget=args.memory_budget, n_windows=args.n_windows,
                             batch_windows=args.batch_windows, recompute=args.recompute,
                             progress=not args.no_progress, backend=args.backend)
    print(f"exported {args.out}: {manifest.trainable_numel:,} of {manifest.total_numel:,} parameter elements train")
    predicted = (manifest.plan or {}).get("predicted_peak_bytes")
    if predicted is not None:
        budget = f" (budget {format_bytes(manifest.plan['budget_bytes'])})" if manifest.plan.get("budget_bytes") else ""
        print(f"predicted peak of an adapt call over {manifest.plan['n_windows']} windows: "
              f"{format_bytes(predicted)}{budget}; details: edgeadapt plan {args.out}")
    return 0


def _validated_policy(args: argparse.Namespace, model, example):
    """``--validate-on``: the update chosen under ``--memory-budget`` by what it gains on the data
    file's subjects (docs/scheduler.md, "Validated selection"), each subject playing the new one
    in turn with a model of the same factory trained on the others."""
    import torch

    from ..datasets import load_dataset
    from ..export.pretrain import pretrain
    from ..harness.validated_selection import (FinetuneRecipe, InnerSubjectScorer, choose_update_for_model,
                                               source_importance)

    if args.memory_budget is None or args.policy:
        raise ValueError("--validate-on chooses what trains under --memory-budget: give --memory-budget and no "
                         "--policy")
    if args.loss != "cross_entropy" or args.optimizer != "adamw" or args.batchnorm != "frozen":
        raise ValueError("--validate-on scores candidates with cross-entropy, AdamW and frozen BatchNorm; use "
                         "--loss cross_entropy --optimizer adamw --batchnorm frozen (the defaults)")
    _, continuous = data_layout(Path(args.validate_on))
    # continuous recordings are cut into windows of the model's length
    ds = load_dataset(args.validate_on, **({"window_length_samples": int(example.shape[-1])} if continuous else {}))
    if list(ds.X.shape[1:]) != list(example.shape[1:]):
        raise ValueError(f"--validate-on windows have shape {list(ds.X.shape[1:])} (channels, time steps), the "
                         f"model takes {list(example.shape[1:])} (--input-shape); an .npz stores windows as "
                         "(windows, time steps, channels)")
    with torch.no_grad():
        n_out = int(model.eval()(example).shape[-1])
    if int(ds.y.max()) >= n_out:
        raise ValueError(f"--validate-on labels go up to class {int(ds.y.max())}, the model has {n_out} outputs; "
                         "give data of the model's classes")

    def train(split):  # a fresh model of the same factory, trained on the other subjects
        torch.manual_seed(args.validate_seed)
        fresh = _build_model(args.model, args.factory_kwargs)
        pretrain(fresh, split.source_train.X, split.source_train.y, epochs=args.validate_pretrain_epochs,
                 batch_size=64, lr=3e-3, weight_decay=1e-2, seed=args.validate_seed)
        return fresh

    recipe = FinetuneRecipe(lr=args.lr, weight_decay=args.weight_decay, epochs=args.validate_epochs,
                            batch_windows=args.batch_windows, seed=args.validate_seed)
    scorer = InnerSubjectScorer(ds, train, recipe, k_per_class=args.validate_k_per_class,
                                validation_subjects=args.validate_subjects, seed=args.validate_seed)
    importance = source_importance(model, example, ds, seed=args.validate_seed)
    choice = choose_update_for_model(model, example, args.memory_budget, scorer, n_windows=args.n_windows,
                                     batch_windows=args.batch_windows, importance=importance, backend=args.backend,
                                     recompute=args.recompute)
    fitting = sorted((c for c in choice.candidates if c.plan is not None), key=lambda c: -c.score)
    chosen = choice.chosen
    print(f"validated on subjects {list(scorer.subjects)} of {args.validate_on}: {len(fitting)} of "
          f"{len(choice.candidates)} candidate updates fit {args.memory_budget}; chosen {chosen.label} "
          f"(mean accuracy gain {chosen.score:+.3f}, predicted {format_bytes(chosen.predicted_peak_bytes)})")
    for c in fitting[:5]:
        print(f"  {c.label:<32} gain {c.score:+.3f}  predicted {format_bytes(c.predicted_peak_bytes)}")
    print(f"  policy: {json.dumps(chosen.policy.to_dict(), sort_keys=True)}")
    return chosen.policy


def _input_shape(text: str) -> list[int]:
    """``--input-shape``: one window's sizes, comma-separated (``8,256``)."""
    try:
        shape = [int(s) for s in text.split(",")]
    except ValueError:
        shape = []
    if not shape or min(shape) < 1:
        raise ValueError(f"--input-shape must be one window's sizes, comma-separated positive integers such as "
                         f"8,256 (channels,time steps), got {text!r}")
    return shape


def _build_model(spec: str, factory_kwargs: str | None):
    """The model the factory ``spec`` (module:factory) returns for ``--factory-kwargs``."""
    from torch import nn

    factory = load_factory(spec)
    try:
        kwargs = json.loads(factory_kwargs) if factory_kwargs else {}
    except json.JSONDecodeError as e:
        raise ValueError(f"--factory-kwargs is not valid JSON ({e}); give an object such as "
                         "'{\"n_classes\": 6}'") from None
    if not isinstance(kwargs, dict):
        raise ValueError(f"--factory-kwargs must be a JSON object of keyword arguments, got {factory_kwargs!r}")
    try:
        model = factory(**kwargs)
    except TypeError as e:  # wrong or missing arguments
        raise ValueError(f"{spec}(**{kwargs}) failed: {e}; pass the factory's arguments with --factory-kwargs") \
            from None
    if not isinstance(model, nn.Module):
        raise ValueError(f"{spec} returned {type(model).__name__}, not a torch.nn.Module")
    return model


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """The ``export`` subcommand's parser."""
    from ..bundle import BATCHNORM_MODES, LOSSES, OPTIMIZERS  # torch- and onnxruntime-free

    p = sub.add_parser("export", help="export a torch model to an on-device training bundle",
                       description="Export a torch model, given as module:factory, to a training bundle.")
    p.add_argument("model", help="module:factory returning a torch.nn.Module, e.g. mypkg.nets:make_cnn")
    p.add_argument("--input-shape", required=True, help="per-window input shape without batch, e.g. 8,256")
    p.add_argument("--out", required=True, help="bundle directory to create (must not exist)")
    p.add_argument("--weights", help="state_dict file saved with torch.save (loaded with weights_only=True)")
    p.add_argument("--factory-kwargs", help="JSON object of keyword arguments for the factory")
    p.add_argument("--policy", default=None,
                   help="full | last-layer | bias-norm | 'pattern=mode,...' with mode frozen|bias|full|"
                        "channels:RATIO|channels:I+J "
                        "(default: last-layer; with --memory-budget: chosen by the planner)")
    p.add_argument("--memory-budget", default=None, metavar="BYTES",
                   help="bound on the peak memory of a whole adapt call, e.g. 512KiB, 2MiB: with --policy the "
                        "policy is checked against it, without one the planner picks what trains")
    p.add_argument("--n-windows", type=int, default=128, help="adaptation windows the plan is made for (default 128)")
    p.add_argument("--batch-windows", type=int, default=32, help="windows per optimizer step the plan is made for")
    p.add_argument("--recompute", action="store_true",
                   help="with --memory-budget, let the planner recompute activations in the backward (off by "
                        "default: ONNX Runtime's buffer reuse often keeps the memory it would save)")
    p.add_argument("--loss", default="cross_entropy", choices=LOSSES)
    p.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS)
    p.add_argument("--lr", type=float, default=1e-3, help="default learning rate stored in the bundle")
    p.add_argument("--weight-decay", type=float, default=0.01, help="AdamW decoupled weight decay")
    p.add_argument("--batchnorm", default="frozen", choices=BATCHNORM_MODES,
                   help="frozen running statistics (default) or batch statistics during adaptation")
    p.add_argument("--batch-size", type=int, default=2, help="batch size of the example input used for tracing")
    p.add_argument("--no-progress", action="store_true", help="no progress bar over the export's stages")
    p.add_argument("--backend", choices=("auto", "portable", "ort-training", "both"), default="auto",
                   help="training engines the bundle holds: portable (step graphs for stock onnxruntime), "
                        "ort-training (onnxruntime-training artifacts) or both; auto (default): both where "
                        "onnxruntime-training is installed, else portable")
    v = p.add_argument_group("validated selection (with --memory-budget)",
                             "choose what trains by what it gains on labelled subjects rather than by importance")
    v.add_argument("--validate-on", metavar="DATA",
                   help="labelled windows of several subjects (.npz/.csv as edgeadapt.datasets.load_dataset reads "
                        "them, or 'synthetic'/'watch'), in the model's input shape and classes (the validation "
                        "models see them normalised per channel on their training subjects, as in the LOSO "
                        "study; the importance is measured on them as given): each of --validate-subjects "
                        "subjects plays the new one, a model of the same factory trained on the others adapts with "
                        "every candidate update that fits the budget, and the best gain wins")
    v.add_argument("--validate-subjects", type=int, default=5, help="subjects that play the new one (default 5)")
    v.add_argument("--validate-k-per-class", type=int, default=5,
                   help="labelled windows per class a validation subject adapts on (default 5)")
    v.add_argument("--validate-epochs", type=int, default=40, help="adaptation epochs of a candidate (default 40)")
    v.add_argument("--validate-pretrain-epochs", type=int, default=15,
                   help="epochs of each validation model's training (default 15)")
    v.add_argument("--validate-seed", type=int, default=0)
    p.set_defaults(func=cmd_export, extra="server")
    return p
