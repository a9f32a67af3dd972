"""``edgeadapt train``: full training of a reference model with the streaming/offload trainer.

One process, or one per rank under ``torchrun`` (data parallel: every rank runs its own
trainer on its shard of each global batch, gradients averaged with torch.distributed). The
run directory (``--checkpoint-dir``) holds::

    checkpoints/       the trainer's atomic, resumable checkpoints (model, optimizer, step, RNG,
                       and this run's options and per-rank random streams as the checkpoint's extra)
    state/rank0/       the offload tier's files (``--offload disk``)
    weights.pt         the final state_dict, for ``edgeadapt export --weights``
    model.json         how to rebuild the model (factory and keyword arguments)
    held_out_adapt.npz ``--hold-out-subject``'s windows, 5 labelled per class, to adapt on (a new person)
    held_out_eval.npz  that subject's other windows, disjoint from those, to evaluate on
    .lock-rank<r>      locked (flock) by rank r of the run while it runs: a second run on the same
                       directory refuses with one line (exit 2) instead of overwriting its state

Multi-rank checkpoints: every rank holds an identical replica (same start, same averaged
gradients, same optimizer arithmetic), so after a barrier rank 0 alone writes the checkpoint
with the trainer's single-process atomic writer; each rank's CPU random stream is gathered
with a collective and stored in it. torch.distributed.checkpoint would write identical bytes
once per rank and offers no atomic switch between complete checkpoints.

With ``--shard-optimizer-state`` (ZeRO-1) no rank holds all of the AdamW state: every rank
calls the trainer's checkpoint writer, which writes each rank's share with
torch.distributed.checkpoint into one staged folder that rank 0 publishes (see
:mod:`edgeadapt.server.checkpoint`); such a run resumes only with the same number of ranks.

The data position is the step number: :mod:`edgeadapt.server.data` sources address batches
by step, so a resumed run sees exactly the batches an uninterrupted run sees.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import errno
import fcntl
import json
import logging
import math
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..atomic import atomic_path, atomic_write_json
from ..datasets import few_shot_split
from ..interrupt import INTERRUPTED, StopAtStepBoundary
from ..models import GPT_PRESETS, MODEL_NAMES, build_gpt, build_model
from ..units import format_bytes, parse_bytes
from .data import TokenArray, TokenStream, WindowSource, load_windows, shard_rows
from .distributed import DistContext, broadcast_parameters, gather_rng_states, init_from_env, shutdown
from .progress import memory_fields

__all__ = ["cmd_train", "load_trained"]

logger = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
HOLD_OUT_K_PER_CLASS = 5
# the options that shape a GPT preset: (attribute, option)
GPT_OPTIONS = (("context_len", "--context-len"), ("n_layers", "--n-layers"), ("d_model", "--d-model"),
               ("vocab_size", "--vocab-size"))
WINDOW_DATASETS = ("synthetic", "watch")  # biosignal --data names that are not files


# ---- the arguments, checked before any work ---------------------------------------------
def _check_args(args: argparse.Namespace) -> None:
    """Refuse what is wrong in the arguments alone, before anything is built, locked or written.

    Raises:
        ValueError: a count or an optimizer setting out of range, an option that does not apply
            to the model, data of the wrong kind for it.
        FileNotFoundError: ``--data`` names a file that does not exist.
        DeviceUnavailableError: ``--device cuda`` without CUDA.
    """
    from dataclasses import replace

    from .trainer import resolve_device

    if args.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {args.steps}")
    if args.batch_size is not None and args.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.checkpoint_every < 0:
        raise ValueError(f"--checkpoint-every must be >= 0 (0: only at the end), got {args.checkpoint_every}")
    if not (math.isfinite(args.lr) and args.lr > 0):
        raise ValueError(f"--lr must be a finite number > 0, got {args.lr}")
    if not (math.isfinite(args.weight_decay) and args.weight_decay >= 0):
        raise ValueError(f"--weight-decay must be a finite number >= 0, got {args.weight_decay}")
    if getattr(args, "shard_optimizer_state", False) and args.offload == "none":
        raise ValueError("--shard-optimizer-state (ZeRO-1) shards the streaming trainer's optimizer state: "
                         "give --offload host or disk, or drop --shard-optimizer-state")
    data = args.data
    if args.model in GPT_PRESETS:
        if args.hold_out_subject is not None:
            raise ValueError(f"--hold-out-subject applies to the biosignal models ({', '.join(MODEL_NAMES)}), "
                             f"whose windows carry subject ids; --model {args.model} trains on a token stream "
                             "without subjects: drop --hold-out-subject")
        for attr, option in GPT_OPTIONS:
            value = getattr(args, attr)
            if value is not None and value < 1:
                raise ValueError(f"{option} must be >= 1, got {value}")
        replace(GPT_PRESETS[args.model], **_gpt_overrides(args))  # the preset's own checks (n_heads | d_model)
        if data != "synthetic" and not data.endswith(".npy"):  # TokenArray.load's rule
            raise ValueError(f"--model {args.model} trains on tokens: give --data synthetic or a .npy of integer "
                             f"token ids, got {data!r}")
    else:
        given = [option for attr, option in GPT_OPTIONS if getattr(args, attr) is not None]
        if given:
            raise ValueError(f"{' and '.join(given)} shape{'s' if len(given) == 1 else ''} a GPT model "
                             f"({', '.join(GPT_PRESETS)}); --model {args.model} takes its sizes from the data: "
                             f"drop {' and '.join(given)}")
        if data not in WINDOW_DATASETS and Path(data).suffix.lower() not in (".npz", ".csv"):
            raise ValueError(f"--model {args.model} trains on labelled windows: "
                             f"give --data synthetic|watch|FILE.npz|FILE.csv, got {data!r}")
    if data not in WINDOW_DATASETS:
        if Path(data).is_dir():
            raise ValueError(f"--data {data} is a directory, not a file")
        if not Path(data).is_file():
            raise FileNotFoundError(f"--data {data}: no such file")
    if args.device == "cuda":
        resolve_device("cuda")


def _gpt_overrides(args: argparse.Namespace) -> dict[str, int]:
    """The GPT preset's fields that the options change."""
    return {attr: getattr(args, attr) for attr, _ in GPT_OPTIONS if getattr(args, attr) is not None}


def _global_batch(args: argparse.Namespace) -> int:
    """``--batch-size``, or the model kind's default (8 sequences for GPT, 64 windows otherwise)."""
    return args.batch_size or (8 if args.model in GPT_PRESETS else 64)


def _check_run_dir(run_dir: Path) -> None:
    """Refuse a ``--checkpoint-dir`` that is, or lies under, something other than a directory.

    Raises:
        NotADirectoryError: ``run_dir`` or one of its parents exists and is not a directory.
    """
    for path in (run_dir, *run_dir.parents):
        if not os.path.lexists(path):
            continue
        if path.is_dir():
            return
        what = "a file" if path.is_file() else "not a directory"
        if path == run_dir:
            raise NotADirectoryError(f"--checkpoint-dir {run_dir} is {what}, not a directory: give a directory "
                                     "(created if missing) for the run's checkpoints, offload state and weights.pt")
        raise NotADirectoryError(f"--checkpoint-dir {run_dir} cannot be created: {path} is {what}, not a "
                                 "directory; choose a --checkpoint-dir under a directory")


# ---- model and data ---------------------------------------------------------------------
def _build(args: argparse.Namespace, ctx: DistContext) -> tuple[torch.nn.Module, Any, dict, Any]:
    """(model, data source, model spec for model.json, loss) for the arguments, seeded."""
    batch = _global_batch(args)
    if args.model in GPT_PRESETS:
        overrides = _gpt_overrides(args)
        torch.manual_seed(args.seed)
        model = build_gpt(args.model, **overrides)
        cfg = model.config
        if args.data == "synthetic":
            source = TokenStream(cfg.vocab_size, cfg.context_len, batch, seed=args.seed,
                                 rank=ctx.rank, world_size=ctx.world_size)
        else:
            source = TokenArray.load(args.data, cfg.context_len, batch, seed=args.seed,
                                     rank=ctx.rank, world_size=ctx.world_size, vocab_size=cfg.vocab_size)
        spec = {"factory": "edgeadapt.models:build_gpt", "kwargs": {"name": args.model, **overrides},
                "config": cfg.to_dict()}
        return model, source, spec, "cross_entropy"     # the trainer's cross-entropy flattens tokens
    train, held_out = load_windows(args.data, hold_out_subject=args.hold_out_subject)
    if held_out is not None and ctx.is_main:
        shot = few_shot_split(held_out, args.hold_out_subject, k_per_class=HOLD_OUT_K_PER_CLASS, seed=args.seed)
        run_dir = Path(args.checkpoint_dir)
        held_out.subset(shot.adapt_idx).save_npz(run_dir / "held_out_adapt.npz")
        held_out.subset(shot.eval_idx).save_npz(run_dir / "held_out_eval.npz")
        logger.info("subject %d: %d windows to adapt on, %d to evaluate on, in %s", args.hold_out_subject,
                    len(shot.adapt_idx), len(shot.eval_idx), run_dir)
    n_channels, n_time_steps = int(train.X.shape[1]), int(train.X.shape[2])
    kwargs = {"name": args.model, "n_channels": n_channels, "n_classes": int(train.n_classes),
              "n_time_steps": n_time_steps}
    torch.manual_seed(args.seed)
    model = build_model(**kwargs)
    source = WindowSource(train.X, train.y, batch, seed=args.seed, rank=ctx.rank, world_size=ctx.world_size)
    spec = {"factory": "edgeadapt.models:build_model", "kwargs": kwargs,
            "input_shape": [n_channels, n_time_steps]}
    return model, source, spec, "cross_entropy"


def _device(args: argparse.Namespace, ctx: DistContext) -> str:
    """The compute device; each torchrun rank takes its LOCAL_RANK GPU. ``cuda`` without CUDA is
    passed on so that the trainer raises the runner's ``DeviceUnavailableError``."""
    if args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available()):
        return "cpu"
    if not torch.cuda.is_available():
        return "cuda"
    return f"cuda:{ctx.local_rank % torch.cuda.device_count()}"


def _run_config(args: argparse.Namespace, spec: dict, source: Any) -> dict:
    """What must match for a checkpoint to be resumed by this run (the world size need not:
    the global batch of a step is the same for any number of ranks)."""
    return {"model": spec["kwargs"], "data": source.describe(),
            "optimizer": {"name": "adamw", "lr": args.lr, "weight_decay": args.weight_decay}}


def _check_same_run(saved: dict, now: dict, where: Path) -> None:
    diffs = [f"{key}: checkpoint {saved.get(key)!r}, now {now[key]!r}" for key in now if saved.get(key) != now[key]]
    if diffs:
        raise ValueError(f"the checkpoint in {where} is of another run ({'; '.join(diffs)}); "
                         f"start a new --checkpoint-dir or pass the same options as that run")


# ---- checkpoints ------------------------------------------------------------------------
def _has_checkpoint(run_dir: Path) -> bool:
    return (run_dir / CHECKPOINTS / "latest.json").is_file()


def _save_checkpoint(trainer, run_dir: Path, run_config: dict, ctx: DistContext) -> None:
    """Gathers every rank's RNG state; after a barrier rank 0 writes the checkpoint; barrier.
    With sharded optimizer state every rank writes its share (a collective of the trainer)."""
    rng_states = gather_rng_states()           # a collective: every rank takes part
    extra = {"run": run_config,
             "rank_rng_b64": [base64.b64encode(s.numpy().tobytes()).decode() for s in rng_states]}
    if getattr(trainer, "shards_optimizer_state", False):
        path = trainer.save_checkpoint(run_dir / CHECKPOINTS, extra=extra)
        if ctx.is_main:
            logger.info("checkpoint at step %d: %s", trainer.step_count, path)
        return
    _barrier(ctx)
    if ctx.is_main:
        path = trainer.save_checkpoint(run_dir / CHECKPOINTS, extra=extra)
        logger.info("checkpoint at step %d: %s", trainer.step_count, path)
    _barrier(ctx)


def _restore_rank_rng(extra: dict, ctx: DistContext) -> None:
    states = extra.get("rank_rng_b64", [])
    if ctx.rank < len(states):
        raw = np.frombuffer(base64.b64decode(states[ctx.rank]), dtype=np.uint8).copy()
        torch.set_rng_state(torch.from_numpy(raw))


def _barrier(ctx: DistContext) -> None:
    if ctx.is_distributed:
        torch.distributed.barrier()


def _save_weights(model: torch.nn.Module, run_dir: Path, spec: dict) -> Path:
    path = run_dir / "weights.pt"
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    with atomic_path(path) as tmp:
        torch.save(state, tmp)
    atomic_write_json(run_dir / "model.json", spec)
    return path


def load_trained(run_dir: str | Path) -> torch.nn.Module:
    """Rebuilds the model of a finished ``edgeadapt train`` run with its final weights (eval mode)."""
    import importlib

    run_dir = Path(run_dir)
    spec = json.loads((run_dir / "model.json").read_text())
    module, attr = spec["factory"].split(":")
    model = getattr(importlib.import_module(module), attr)(**spec["kwargs"])
    model.load_state_dict(torch.load(run_dir / "weights.pt", map_location="cpu", weights_only=True))
    return model.eval()


def _export_hint(run_dir: Path, spec: dict) -> str | None:
    if "input_shape" not in spec:
        return None
    shape = ",".join(str(s) for s in spec["input_shape"])
    return (f"edgeadapt export {spec['factory']} --factory-kwargs '{json.dumps(spec['kwargs'])}' "
            f"--input-shape {shape} --weights {run_dir / 'weights.pt'} --out {run_dir / 'bundle'}")


# ---- the command ------------------------------------------------------------------------
def _print_plan(args: argparse.Namespace, budget: int | None, echo) -> int:
    """``--plan-only``: the plan of the first batch's size, printed; nothing trained or written."""
    from ..sched.offload import OVERLAP_TEXT
    from .trainer import plan_training

    if args.offload == "none":
        raise ValueError("--plan-only plans the streaming trainer: give --offload host or disk")
    ctx = DistContext()  # one process: the plan of one rank's share of the global batch
    plan_args = argparse.Namespace(**{**vars(args), "hold_out_subject": None})  # writes no held-out files
    model, source, _, loss = _build(plan_args, ctx)
    example, target = source.batch(0)[:2]
    plan = plan_training(model, example, offload=args.offload, memory_budget=budget, device=_device(args, ctx),
                         recompute={"on": True, "off": False}.get(args.recompute, "auto"), loss=loss,
                         example_target=target)
    state = 4 * sum(p.numel() for p in model.parameters())
    n_blocks = len(plan.activations)
    micro = plan.micro_batch_windows
    echo(f"plan for {args.model}: {sum(p.numel() for p in model.parameters()):,} parameters, batch "
         f"{plan.batch_windows}, budget {format_bytes(budget) if budget else 'none'}")
    echo(f"  tiers: master weights and AdamW state on {args.offload} ({format_bytes(3 * state)}); "
         f"blocks streamed through the compute tier under the budget")
    echo("  micro-batches: none (whole batch)" if micro == plan.batch_windows else
         f"  micro-batches: {math.ceil(plan.batch_windows / micro)} of up to {micro} windows, gradients summed on "
         f"{args.offload}")
    echo(f"  prefetch depth: {plan.prefetch_depth}")
    echo(f"  update chunk: {plan.update_chunk_numel:,} elements")
    echo(f"  update: {OVERLAP_TEXT[plan.update_overlap]}")
    echo(f"  recompute: {len(plan.recomputed)} of {n_blocks} blocks")
    for name, action in plan.activations:
        echo(f"    {name}: {action.value}")
    echo(f"  predicted peak: {format_bytes(plan.predicted.peak_bytes)}"
         + (f" of {format_bytes(budget)}" if budget else "") + f" at {plan.predicted.where}")
    echo("  by phase: " + ", ".join(f"{phase} {format_bytes(v)}" for phase, v in plan.predicted.phases_bytes.items()))
    return 0


def _process_text(trainer) -> str:
    process = trainer.process_peak_bytes
    if process is None:
        return ""
    return f" (the process's anonymous peak: +{format_bytes(process)} over the loaded trainer)"


def _residency_text(trainer) -> str:
    return ", ".join(f"{name} {value}" for name, value in memory_fields(trainer).items())


def _mean_over_ranks(value: float, ctx: DistContext) -> float:
    if not ctx.is_distributed:
        return value
    t = torch.tensor([value], dtype=torch.float64)
    torch.distributed.all_reduce(t)
    return float(t) / ctx.world_size


def cmd_train(args: argparse.Namespace, echo=print) -> int:
    """Runs ``edgeadapt train`` with the options ``edgeadapt.cli`` parsed; returns the exit status."""
    from ..export import OptimizerConfig
    from .store import OffloadDirError
    from .trainer import Trainer

    _check_args(args)
    budget = parse_bytes(args.memory_budget) if args.memory_budget else None
    if getattr(args, "plan_only", False):
        return _print_plan(args, budget, echo)
    if not args.checkpoint_dir:
        raise ValueError("--checkpoint-dir is required to train (the run's checkpoints, offload state and "
                         "weights.pt go there); --plan-only prints the plan without one")
    run_dir = Path(args.checkpoint_dir)
    _check_run_dir(run_dir)
    device_type = "cuda" if args.device != "cpu" and torch.cuda.is_available() else "cpu"
    ctx = init_from_env(device_type)
    stack = contextlib.ExitStack()
    try:
        shard_rows(_global_batch(args), ctx.rank, ctx.world_size)  # the batch splits evenly over the ranks
        if args.resume and not _has_checkpoint(run_dir):
            raise FileNotFoundError(f"--resume: no checkpoint in {run_dir / CHECKPOINTS}; run without --resume first")
        if not args.resume and _has_checkpoint(run_dir):
            raise FileExistsError(f"{run_dir} already holds a checkpoint; pass --resume to continue it "
                                  f"or choose a new --checkpoint-dir")
        if ctx.is_main:
            run_dir.mkdir(parents=True, exist_ok=True)
        _barrier(ctx)
        stack.enter_context(run_lock(run_dir, ctx.rank))
        device = _device(args, ctx)
        model, source, spec, loss = _build(args, ctx)
        n_params = sum(p.numel() for p in model.parameters())
        broadcast_parameters(model)            # replicas start equal even if initialisation differed
        run_config = _run_config(args, spec, source)
        offload = None if args.offload == "none" else args.offload
        kwargs = dict(loss=loss, optimizer=OptimizerConfig("adamw", lr=args.lr, weight_decay=args.weight_decay),
                      memory_budget=budget, offload=offload, offload_dir=run_dir / "state" / f"rank{ctx.rank}",
                      device=device, recompute={"on": True, "off": False}.get(args.recompute, "auto"),
                      process_group=torch.distributed.group.WORLD if ctx.is_distributed else None,
                      example_input=source.batch(0)[0],
                      shard_optimizer_state=bool(getattr(args, "shard_optimizer_state", False)))
        try:
            trainer = (Trainer.resume(run_dir / CHECKPOINTS, model, **kwargs) if args.resume
                       else Trainer(model, **kwargs))
        except OffloadDirError as e:
            raise RuntimeError(f"the disk tier cannot use {kwargs['offload_dir']}: {e}") from e
        if args.resume:
            _check_same_run(trainer.checkpoint_extra.get("run", {}), run_config, run_dir / CHECKPOINTS)
            _restore_rank_rng(trainer.checkpoint_extra, ctx)
            if trainer.step_count >= args.steps:
                trainer.close()
                raise ValueError(f"--resume: {run_dir} is at step {trainer.step_count} already; give --steps "
                                 f"above it to train on (the run's weights.pt is left as it is)")
            if ctx.is_main:
                echo(f"resuming {run_dir} at step {trainer.step_count}")
        if ctx.is_main:
            echo(f"training {args.model} ({n_params:,} parameters) on {device} x {ctx.world_size} process(es), "
                 f"offload {args.offload}, budget {format_bytes(budget) if budget else 'none'}, "
                 + ("optimizer state sharded over the ranks (ZeRO-1), " if trainer.shards_optimizer_state else "")
                 + f"global batch {source.global_batch_size}, steps {trainer.step_count}..{args.steps}")
        try:
            return _train_loop(trainer, source, args, run_dir, run_config, spec, ctx, echo)
        finally:
            trainer.close()
    except KeyboardInterrupt:  # before the first step, or a second Ctrl-C during one
        if ctx.is_main:
            echo(f"interrupted; nothing written after the last checkpoint in {run_dir / CHECKPOINTS}")
        return INTERRUPTED
    finally:
        stack.close()
        shutdown(ctx)


class RunInUse(RuntimeError):
    """Another ``edgeadapt train`` holds the run directory (its lock file is locked)."""


def run_lock_path(run_dir: Path, rank: int) -> Path:
    """The lock file of rank ``rank`` of the run in ``run_dir``."""
    return Path(run_dir) / f".lock-rank{rank}"


@contextlib.contextmanager
def run_lock(run_dir: Path, rank: int) -> Iterator[None]:
    """Hold an exclusive ``flock`` on :func:`run_lock_path` for the whole run.

    Two runs on one ``--checkpoint-dir`` would overwrite each other's disk-tier state files and
    checkpoints; the second one refuses instead. Each rank locks its own file, so the ranks of one
    torchrun job do not exclude each other while every rank of a second job is refused. The lock
    dies with its process (a killed run leaves nothing to clean up).

    Raises:
        RunInUse: another process holds the lock.
    """
    path = run_lock_path(run_dir, rank)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                raise
            raise RunInUse(f"{run_dir} is in use by another edgeadapt train (rank {rank} holds {path.name}); wait "
                           "for it to finish or choose another --checkpoint-dir") from None
        yield
    finally:
        os.close(fd)


def _any_rank(flag: bool, ctx: DistContext) -> bool:
    """Whether ``flag`` is set on any rank (every rank must stop at the same step)."""
    if not ctx.is_distributed:
        return flag
    t = torch.tensor([float(flag)])
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return bool(t.item())


def _train_loop(trainer, source, args: argparse.Namespace, run_dir: Path, run_config: dict, spec: dict,
                ctx: DistContext, echo) -> int:
    """Steps from the trainer's step to ``--steps``, with progress, checkpoints and the weights file.

    Returns the exit status: 0, or :data:`INTERRUPTED` when Ctrl-C stopped the run at a step
    boundary (a checkpoint of the last completed step is written; ``--resume`` continues it)."""
    from tqdm.auto import tqdm

    budget = trainer.budget_bytes
    start = trainer.step_count
    show_bar = ctx.is_main and not args.no_progress
    log_every = max(1, (args.steps - start) // 10)
    bar = tqdm(range(start, args.steps), desc="train", unit="step", initial=start, total=args.steps,
               disable=not show_bar)
    loss_value = float("nan")
    t0 = time.perf_counter()
    items = 0
    saved_step = start
    with StopAtStepBoundary() as stop:
        for step in bar:
            x, y = source.batch(step)
            loss_value = _mean_over_ranks(float(trainer.step(x, y)), ctx)
            items += source.items_per_step * ctx.world_size
            rate = items / max(time.perf_counter() - t0, 1e-9)
            status = f"loss {loss_value:.4f}, {rate:,.0f} {source.unit}/s, {_residency_text(trainer)}"
            bar.set_postfix_str(status)
            if ctx.is_main and not show_bar and ((step + 1 - start) % log_every == 0 or step + 1 == args.steps):
                echo(f"step {step + 1}/{args.steps}: {status}")
            if args.checkpoint_every and (step + 1) % args.checkpoint_every == 0 and step + 1 < args.steps:
                _save_checkpoint(trainer, run_dir, run_config, ctx)
                saved_step = step + 1
            if step + 1 < args.steps and _any_rank(stop.requested, ctx):
                bar.close()
                if saved_step != step + 1:
                    _save_checkpoint(trainer, run_dir, run_config, ctx)
                if ctx.is_main:
                    echo(f"interrupted: stopped after step {step + 1} of {args.steps}, checkpoint written to "
                         f"{run_dir / CHECKPOINTS}; continue with the same command and --resume")
                return INTERRUPTED
    bar.close()
    elapsed_s = time.perf_counter() - t0
    _save_checkpoint(trainer, run_dir, run_config, ctx)
    if not ctx.is_main:
        return 0
    weights = _save_weights(trainer.model(), run_dir, spec)
    echo(f"done: step {args.steps}, loss {loss_value:.4f}, {items / max(elapsed_s, 1e-9):,.0f} {source.unit}/s, "
         f"tracked peak {format_bytes(trainer.tracked_peak_bytes)}"
         + (f" of a {format_bytes(budget)} budget" if budget else "") + _process_text(trainer) + f"; weights {weights}")
    hint = _export_hint(run_dir, spec)
    if hint:
        echo(f"export it for the device: {hint}")
    return 0
