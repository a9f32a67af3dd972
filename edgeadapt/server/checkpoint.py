"""Resumable, atomic checkpoints of a :class:`~edgeadapt.server.trainer.Trainer`.

Layout of a checkpoint folder ``<dir>/step-00000042/``:

* ``meta.json``: the trainer's signature (model class, parameter and buffer shapes, blocks,
  optimizer and loss), the step, the learning rate and the caller's ``extra`` (e.g. the data
  position);
* ``block-00000.pt`` ...: per block ``{"param"|"exp_avg"|"exp_avg_sq"|"steps": {name: tensor}}``,
  written one block at a time so that a streamed model is never gathered in memory;
* ``buffers.pt`` and ``rng.pt``: module buffers and the torch random generators.

Tensor files are plain ``torch.save`` dicts of tensors and are read back with
``torch.load(weights_only=True)``. A checkpoint is built in a hidden staging folder and renamed
into place (:func:`edgeadapt.atomic.staged_directory`); then ``<dir>/latest.json`` is switched
to it atomically. A run killed at any moment leaves the previous checkpoint as ``latest``.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..atomic import atomic_write_json, staged_directory

if TYPE_CHECKING:
    from .trainer import Trainer

__all__ = ["CheckpointMismatch", "save", "load", "latest", "check_signature", "rng_state", "set_rng_state"]

log = logging.getLogger(__name__)

FORMAT = 1


class CheckpointMismatch(ValueError):
    """A checkpoint was written for another model or training configuration."""


def rng_state() -> dict[str, torch.Tensor]:
    """The torch CPU generator's state and, where present, each CUDA generator's."""
    st = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            st[f"cuda:{i}"] = s
    return st


def set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["cpu"])
    cuda = [state[k] for k in sorted(state) if k.startswith("cuda:")]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda[: torch.cuda.device_count()])


def _differences(saved, current, path: str = "") -> list[str]:
    if isinstance(saved, dict) and isinstance(current, dict):
        out: list[str] = []
        for k in sorted(set(saved) | set(current), key=str):
            where = f"{path}.{k}" if path else str(k)
            if k not in current:
                out.append(f"{where} is in the checkpoint but not in this trainer")
            elif k not in saved:
                out.append(f"{where} is in this trainer but not in the checkpoint")
            else:
                out.extend(_differences(saved[k], current[k], where))
        return out
    if saved != current:
        return [f"{path}: checkpoint {saved!r}, this trainer {current!r}"]
    return []


def check_signature(saved: dict, current: dict) -> None:
    """Refuse a checkpoint whose signature differs; the message names the differences.

    Raises:
        CheckpointMismatch: listing up to 5 differences.
    """
    diffs = _differences(json.loads(json.dumps(saved)), json.loads(json.dumps(current)))
    if diffs:
        more = f" (and {len(diffs) - 5} more)" if len(diffs) > 5 else ""
        raise CheckpointMismatch("the checkpoint was written for another model or configuration: "
                                 + "; ".join(diffs[:5]) + more
                                 + ". Resume with the same model and optimizer settings, or start a new run")


def latest(directory: Path) -> Path:
    """The folder ``latest.json`` points to.

    Raises:
        FileNotFoundError: no complete checkpoint in ``directory``.
    """
    pointer = directory / "latest.json"
    if not pointer.exists():
        raise FileNotFoundError(f"no checkpoint in {str(directory)!r} (no latest.json); start without --resume")
    return directory / json.loads(pointer.read_text())["checkpoint"]


def save(trainer: Trainer, directory: Path, *, extra: dict, keep: int = 2) -> Path:
    """Write a checkpoint of ``trainer`` under ``directory``; keep the newest ``keep``."""
    directory.mkdir(parents=True, exist_ok=True)
    name = f"step-{trainer.step_count:08d}"
    target = directory / name
    if target.exists():  # a checkpoint of this very step exists: it is complete (renamed last)
        atomic_write_json(directory / "latest.json", {"checkpoint": name, "step": trainer.step_count})
        return target
    with staged_directory(target) as stage:
        for i in range(len(trainer.blocks)):
            torch.save(trainer.block_state(i), stage / f"block-{i:05d}.pt")
        torch.save(trainer.buffers(), stage / "buffers.pt")
        torch.save(rng_state(), stage / "rng.pt")
        meta = {"format": FORMAT, "signature": trainer.signature(), "step": trainer.step_count,
                "lr": trainer.lr, "extra": extra}
        atomic_write_json(stage / "meta.json", meta)
    atomic_write_json(directory / "latest.json", {"checkpoint": name, "step": trainer.step_count})
    old = sorted(p for p in directory.glob("step-*") if p.is_dir() and p.name != name)
    for p in old[: max(0, len(old) - (keep - 1))]:
        shutil.rmtree(p, ignore_errors=True)
    log.info("checkpoint of step %d written to %s", trainer.step_count, target)
    return target


def load(trainer: Trainer, directory: Path) -> None:
    """Restore ``trainer`` from the latest checkpoint under ``directory``.

    Raises:
        CheckpointMismatch: another model or configuration.
        FileNotFoundError: no checkpoint.
    """
    folder = latest(directory)
    meta = json.loads((folder / "meta.json").read_text())
    if meta.get("format") != FORMAT:
        raise CheckpointMismatch(f"{folder} has checkpoint format {meta.get('format')!r}; this edgeadapt reads {FORMAT}")
    check_signature(meta["signature"], trainer.signature())
    for i in range(len(trainer.blocks)):
        trainer.set_block_state(i, torch.load(folder / f"block-{i:05d}.pt", weights_only=True))
    trainer._load_buffers(torch.load(folder / "buffers.pt", weights_only=True))
    set_rng_state(torch.load(folder / "rng.pt", weights_only=True))
    trainer.step_count = int(meta["step"])
    trainer.lr = float(meta["lr"])
    trainer.checkpoint_extra = dict(meta.get("extra", {}))
    log.info("resumed from %s (step %d)", folder, trainer.step_count)
