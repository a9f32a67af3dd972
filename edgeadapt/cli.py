"""``edgeadapt`` command line: export, inspect, adapt, evaluate, export-inference, quickstart.

Only ``export`` and ``quickstart`` import torch; the device-side commands (inspect, adapt,
evaluate, export-inference) run with numpy + onnxruntime alone.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
import zipfile
from pathlib import Path

from .interrupt import INTERRUPTED
from .units import format_bytes

__all__ = ["main", "build_parser"]

# Third-party packages a command's extra brings; a command that finds one missing names the
# extra to install (``set_defaults(extra=...)`` on its parser) instead of a traceback.
EXTRA_PACKAGES = {"server": ("torch", "onnx", "onnxruntime", "matplotlib")}

# ---- helpers --------------------------------------------------------------------------
def _load_factory(spec: str):
    if ":" not in spec:
        raise ValueError(f"model {spec!r} must be given as module:factory, e.g. mypkg.models:make_net")
    mod_name, attr = spec.split(":", 1)
    sys.path.insert(0, str(Path.cwd()))
    try:
        module = importlib.import_module(mod_name)
    finally:
        sys.path.pop(0)
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ValueError(f"module {mod_name!r} has no attribute {attr!r}") from None


def _window_length(args: argparse.Namespace, manifest) -> int:
    """Samples per window for continuous data: the bundle's time steps, or ``--window-s`` times
    ``--sample-rate-hz`` (which must then agree with the bundle)."""
    steps = manifest.input.shape[-1]
    if args.window_s is None:
        if steps is None:
            raise ValueError("the bundle's input has a dynamic time axis; pass --window-s and --sample-rate-hz")
        return int(steps)
    if not args.sample_rate_hz:
        raise ValueError("--window-s needs --sample-rate-hz")
    n = round(args.window_s * args.sample_rate_hz)
    if steps is not None and n != steps:
        raise ValueError(f"--window-s {args.window_s} at --sample-rate-hz {args.sample_rate_hz} gives {n} samples per "
                         f"window, the bundle takes {steps}; omit --window-s to use the bundle's")
    return n


def _load_data(args: argparse.Namespace, manifest):
    """(X, y) from an ``.npz``/``.csv`` in the edgeadapt.datasets formats, checked against the
    bundle before any session is opened. Continuous data (CSV, ``signal`` npz) are windowed to
    the bundle's window length."""
    from .datasets import load_dataset
    from .runtime.validate import check_inputs, check_labels

    if args.sample_rate_hz is not None and not (args.sample_rate_hz > 0 and args.sample_rate_hz < float("inf")):
        raise ValueError(f"--sample-rate-hz must be a positive number, got {args.sample_rate_hz}")
    path = Path(args.data)
    kwargs = {"sample_rate_hz": args.sample_rate_hz} if args.sample_rate_hz else {}
    continuous = path.suffix.lower() == ".csv" or (
        path.suffix.lower() == ".npz" and path.is_file() and zipfile.is_zipfile(path)
        and "signal.npy" in zipfile.ZipFile(path).namelist())
    if continuous:
        kwargs["window_length_samples"] = _window_length(args, manifest)
    ds = load_dataset(path, **kwargs)
    y = ds.y if manifest.label is not None else None
    X = check_inputs(manifest, ds.X, what=f"{path} (X)")
    return X, check_labels(manifest, y, len(X), what=f"{path} (y)")


def _printable(text: str, keep: str = "") -> str:
    """``text`` with control and format characters (a terminal's escape sequences, say, from a
    bundle's manifest) written as Python escapes, except those in ``keep``."""
    return "".join(c if c.isprintable() or c in keep else c.encode("unicode_escape").decode("ascii") for c in text)


# ---- commands -------------------------------------------------------------------------
def cmd_export(args: argparse.Namespace) -> int:
    import torch

    from .export import OptimizerConfig, UpdatePolicy, export_bundle

    factory = _load_factory(args.model)
    kwargs = json.loads(args.factory_kwargs) if args.factory_kwargs else {}
    model = factory(**kwargs)
    if args.weights:
        state = torch.load(args.weights, map_location="cpu", weights_only=True)
        model.load_state_dict(state)
    shape = [int(s) for s in args.input_shape.split(",")]
    example = torch.randn(args.batch_size, *shape)
    opt = OptimizerConfig(args.optimizer, lr=args.lr, weight_decay=args.weight_decay if args.optimizer == "adamw" else 0.0)
    policy = UpdatePolicy.parse(args.policy) if args.policy else None
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


def bundle_summary(bundle_dir: str) -> dict:
    """What ``edgeadapt inspect`` reports, as a JSON-able dict (checksums are verified)."""
    from .bundle import read_manifest

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
        print(_printable(text))

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


def cmd_adapt(args: argparse.Namespace) -> int:
    try:
        return _adapt(args)
    except KeyboardInterrupt:  # Ctrl-C outside the training steps (loading, saving): nothing was saved
        print("interrupted; nothing saved", file=sys.stderr)
        return INTERRUPTED


def _adapt(args: argparse.Namespace) -> int:
    from .bundle import read_manifest
    from .runtime import AdaptInterrupted, NonFiniteLossError, Runner
    from .runtime.validate import check_learning_rate

    if args.lr is not None:
        check_learning_rate(args.lr, "--lr")
    if args.epochs < 1 or args.batch_size < 1:
        raise ValueError(f"--epochs and --batch-size must be >= 1, got {args.epochs} and {args.batch_size}")
    from .unlabeled_cli import check_unlabeled_arguments, run_unlabeled

    check_unlabeled_arguments(args)
    X, y = _load_data(args, read_manifest(args.bundle, verify=False))
    runner = Runner.load(args.bundle, device=args.device, threads=args.threads, backend=args.backend)
    runner.check_save_target(args.out)  # refused now, not after training
    if args.unlabeled:
        return run_unlabeled(args, runner, X)
    print(f"adapting on {runner.device}: {len(X)} windows, {args.epochs} epochs, batch {args.batch_size}")
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
    losses = ", ".join(f"{v:.4f}" for v in result.epoch_losses)
    print(f"done: {result.steps} steps in {result.time_s:.1f} s; epoch losses {losses}; saved to {out}")
    return 0


def cmd_evaluate(args: argparse.Namespace) -> int:
    from .bundle import read_manifest
    from .runtime import Runner

    X, y = _load_data(args, read_manifest(args.bundle, verify=False))
    runner = Runner.load(args.bundle, device=args.device, threads=args.threads, backend=args.backend)
    r = runner.evaluate(X, y)
    result = {"loss": r.loss, "accuracy": r.accuracy, "n_windows": r.n_windows}
    print(json.dumps(result) if args.json else
          f"loss {r.loss:.4f}" + (f"  accuracy {r.accuracy:.4f}" if r.accuracy is not None else "") + f"  ({r.n_windows} windows)")
    return 0


def cmd_export_inference(args: argparse.Namespace) -> int:
    from .runtime import Runner

    runner = Runner.load(args.bundle, device="cpu", backend=args.backend)
    path = runner.export_inference(args.output)
    print(f"wrote {path}: a plain ONNX model ({runner.manifest.input.name} -> {runner.manifest.output.name})")
    return 0


def cmd_quickstart(args: argparse.Namespace) -> int:
    import matplotlib  # noqa: F401  (the plots, and torch below: missing extras fail before any work)
    import torch  # noqa: F401

    from .harness.quickstart import QuickstartConfig, run_quickstart

    cfg = QuickstartConfig(dataset=args.dataset, model=args.model, policy=args.policy, out_dir=Path(args.out),
                           k_per_class=args.k_per_class, epochs=args.epochs, seed=args.seed, small=args.small,
                           memory_budget=args.memory_budget, threads=args.threads, progress=not args.no_progress)
    run_quickstart(cfg, echo=print)
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from .server.train_cli import cmd_train as run

    return run(args, echo=print)


# ---- parser ---------------------------------------------------------------------------
def _add_data(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", required=True,
                   help=".npz (X: windows x time x channels, y, subject) or .csv (continuous samples, "
                        "windowed to the bundle's window length); see edgeadapt.datasets")
    p.add_argument("--sample-rate-hz", type=float, default=None,
                   help="sampling rate, for files that do not store it (needed only with --window-s)")
    p.add_argument("--window-s", type=float, default=None,
                   help="window length in seconds for continuous data (default: the bundle's window length)")


def _add_backend(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", choices=("auto", "portable", "ort-training"), default="auto",
                   help="training engine: auto (portable step graphs when the bundle holds them, else "
                        "onnxruntime-training; default), portable or ort-training")


def _add_device(p: argparse.ArgumentParser) -> None:
    _add_backend(p)
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="auto: CUDA if it can run the session, else CPU with a warning (default)")
    p.add_argument("--threads", type=int, default=None, help="intra-op threads (default: ONNX Runtime's choice)")


def _add_train(p: argparse.ArgumentParser) -> None:
    # the options of edgeadapt.server.train_cli, here so that parsing imports no torch
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
    p.add_argument("--checkpoint-dir", required=True, help="run directory: checkpoints, offload state, weights.pt")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --checkpoint-dir")
    p.add_argument("--checkpoint-every", type=int, default=0,
                   help="steps between checkpoints (default 0: only at the end)")
    p.add_argument("--hold-out-subject", type=int, default=None,
                   help="biosignal data: leave this subject out; write 5 of its windows per class to "
                        "held_out_adapt.npz and the others to held_out_eval.npz")
    p.add_argument("--context-len", type=int, default=None, help="GPT: tokens per sequence (default: the preset's)")
    p.add_argument("--n-layers", type=int, default=None, help="GPT: decoder blocks (default: the preset's)")
    p.add_argument("--d-model", type=int, default=None, help="GPT: width (default: the preset's)")
    p.add_argument("--vocab-size", type=int, default=None, help="GPT: vocabulary (default: the preset's)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--plan-only", action="store_true",
                   help="print the offload plan (tiers, recompute per block, update chunk, prefetch, micro-batches, "
                        "predicted peak) for --memory-budget and exit without training or writing anything")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="edgeadapt", description=__doc__.split("\n")[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress details")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    from .bundle import BATCHNORM_MODES, LOSSES, OPTIMIZERS  # torch- and onnxruntime-free

    p = sub.add_parser("export", help="export a torch model to an on-device training bundle",
                       description="Export a torch model, given as module:factory, to a training bundle.")
    p.add_argument("model", help="module:factory returning a torch.nn.Module, e.g. mypkg.nets:make_cnn")
    p.add_argument("--input-shape", required=True, help="per-window input shape without batch, e.g. 8,256")
    p.add_argument("--out", required=True, help="bundle directory to create (must not exist)")
    p.add_argument("--weights", help="state_dict file saved with torch.save (loaded with weights_only=True)")
    p.add_argument("--factory-kwargs", help="JSON object of keyword arguments for the factory")
    p.add_argument("--policy", default=None,
                   help="full | last-layer | bias-norm | 'pattern=mode,...' with mode frozen|bias|full|"
                        "channels:RATIO|channels:I+J (default: last-layer; with --memory-budget: chosen by the planner)")
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
    p.set_defaults(func=cmd_export, extra="server")

    p = sub.add_parser("inspect", help="what trains, how many bytes, versions, checksums")
    p.add_argument("bundle")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--all", action="store_true", help="list frozen parameters too")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("adapt", help="adapt a bundle on new data (torch-free)")
    p.add_argument("bundle")
    _add_data(p)
    p.add_argument("--out", required=True, help="directory for the adapted bundle (new, or the same bundle)")
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default: the bundle's)")
    p.add_argument("--schedule", choices=("constant", "cosine"), default="constant")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    from .unlabeled_cli import add_unlabeled_arguments

    add_unlabeled_arguments(p)
    _add_device(p)
    p.set_defaults(func=cmd_adapt)

    p = sub.add_parser("evaluate", help="loss and accuracy of a bundle on labeled data (torch-free)")
    p.add_argument("bundle")
    _add_data(p)
    p.add_argument("--json", action="store_true")
    _add_device(p)
    p.set_defaults(func=cmd_evaluate)

    p = sub.add_parser("export-inference", help="write a plain ONNX model any onnxruntime can run")
    p.add_argument("bundle")
    p.add_argument("output", help="path of the .onnx file")
    _add_backend(p)
    p.set_defaults(func=cmd_export_inference)

    p = sub.add_parser("quickstart", help="the main job on built-in data: pretrain, export, adapt, report")
    p.add_argument("--dataset", default="synthetic", help="synthetic | watch | path to a .npz/.csv")
    p.add_argument("--model", default="cnn", choices=("cnn", "mobilenet", "transformer"))
    p.add_argument("--policy", default="sparse", help="sparse (default) | last-layer | bias-norm | full | pattern=mode,...")
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

    p = sub.add_parser("train", help="train every parameter on the server, streaming state from host or disk",
                       description="Full training with the streaming/offload trainer; under torchrun, data parallel.")
    _add_train(p)
    p.set_defaults(func=cmd_train, extra="server")

    from .plan_cli import add_plan_parser

    add_plan_parser(sub)
    return parser


def _missing_extra(args: argparse.Namespace, error: ModuleNotFoundError) -> str | None:
    """The one-line error for a command whose extra is not installed; ``None`` when ``error`` is
    not about a package of that extra (a bug or a missing user module: the traceback stays)."""
    extra = getattr(args, "extra", None)
    missing = (error.name or "").split(".")[0]
    if extra is None or missing not in EXTRA_PACKAGES[extra]:
        return None
    return (f"edgeadapt {args.command} needs {missing}, which is not installed here; install the "
            f"{extra} extra: pip install \"edgeadapt[{extra}]\" (a device install has only the runtime)")


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``edgeadapt`` console script."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    from .bundle import BundleError

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
        print(f"error: {_printable(str(e), keep=chr(10))}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
