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

**Sharded optimizer state** (ZeRO-1, ``Trainer(shard_optimizer_state=True)``): no rank holds
all of the AdamW state, so every rank writes its own blocks with torch.distributed.checkpoint
(DCP) into the same staged folder, one DCP checkpoint per block so that a streamed model is
still written one block at a time:

* ``meta.json`` (rank 0): as above, plus ``"zero1": {"world_size": N, "owners": [rank per block]}``;
* ``blocks/00000/`` ...: per block a DCP checkpoint (``.metadata`` and ``__<rank>_0.distcp``)
  of ``param/<name>``, ``exp_avg/<name>``, ``exp_avg_sq/<name>`` and ``steps`` (int64, one
  per parameter), written by the block's owner (the other ranks take part in the collective
  with nothing to write);
* ``ranks/``: one DCP checkpoint of every rank's own ``rank<r>/rng/<generator>`` and
  ``rank<r>/buffers/<name>`` (each rank's random stream and BatchNorm statistics).

Rank 0 creates the staging folder and sends its path to the others
(``broadcast_object_list``); after the last DCP save (a collective) every rank's files are
complete, rank 0 writes ``meta.json``, renames the folder into place and switches
``latest.json``; the ranks then agree on the outcome (``all_gather_object``) so that a failure
on one rank raises on all. Resuming needs the same world size (the assignment of blocks to
ranks depends on it); another world size is refused naming both. A checkpoint without sharding
resumes into a sharded trainer (each rank reads its own blocks' state from the block files).
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import warnings
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from ..atomic import atomic_write_json, staged_directory



class TrainingState(Protocol):
    """What a checkpoint reads from and restores into (a :class:`~edgeadapt.server.trainer.Trainer`).

    ``block_state(i)`` is ``{kind: {param name: CPU tensor}}`` (kinds: ``param`` and the optimizer
    state this process holds) plus ``"steps": {param name: tensor(int)}``; ``set_block_state``
    is its inverse. ``sharding`` is ZeRO-1's assignment of blocks to ranks, or ``None``.
    """

    blocks: list[Any]
    step_count: int
    lr: float
    checkpoint_extra: dict
    sharding: Any

    def block_state(self, index: int) -> dict[str, dict[str, torch.Tensor]]: ...
    def set_block_state(self, index: int, state: dict[str, dict[str, torch.Tensor]]) -> None: ...
    def buffers(self) -> dict[str, torch.Tensor]: ...
    def load_buffers(self, buffers: dict[str, torch.Tensor]) -> None: ...
    def signature(self) -> dict: ...

__all__ = ["CheckpointMismatch", "CheckpointDamaged", "CheckpointWriteError", "save", "save_sharded", "load", "latest",
           "check_signature", "rng_state",
           "set_rng_state", "TrainingState"]

log = logging.getLogger(__name__)

FORMAT = 1


class CheckpointMismatch(ValueError):
    """A checkpoint was written for another model or training configuration."""


class CheckpointDamaged(ValueError):
    """A checkpoint file cannot be read back (damaged, truncated, or not written by edgeadapt)."""


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (a full disk, say); the previous one is kept."""


def _reason(e: BaseException) -> str:
    """The last line of an exception's message, shortened (torch's name C++ sources first)."""
    return ((str(e).strip().splitlines() or [type(e).__name__])[-1])[:200]


def _read_json(path: Path) -> dict:
    """A checkpoint's JSON file; :class:`CheckpointDamaged` naming it when it cannot be read."""
    try:
        value = json.loads(path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise CheckpointDamaged(f"{path} is missing; the checkpoint is incomplete - resume from another or start "
                                "a new run") from None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise CheckpointDamaged(f"{path} is damaged ({type(e).__name__}: {_reason(e)}); resume from another "
                                "checkpoint or start a new run") from None
    if not isinstance(value, dict):
        raise CheckpointDamaged(f"{path} is damaged (not a JSON object); "
                                "resume from another checkpoint or start a new run")
    return value


def _load_tensors(path: Path):
    """``torch.load(path, weights_only=True)``; :class:`CheckpointDamaged` naming the file on failure."""
    try:
        return torch.load(path, weights_only=True)
    except FileNotFoundError:
        raise CheckpointDamaged(f"{path} is missing; the checkpoint is incomplete - resume from another or start "
                                "a new run") from None
    except Exception as e:  # torch raises RuntimeError, pickle.UnpicklingError, EOFError, ... on damaged bytes
        raise CheckpointDamaged(f"{path} is damaged ({type(e).__name__}: {_reason(e)}); resume from another "
                                "checkpoint or start a new run") from None


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


def _point_latest(directory: Path, name: str, step: int) -> None:
    """Switch ``latest.json`` to the checkpoint folder ``name`` (atomically: the last act of a save)."""
    atomic_write_json(directory / "latest.json", {"checkpoint": name, "step": step})


def latest(directory: Path) -> Path:
    """The folder ``latest.json`` points to.

    Raises:
        FileNotFoundError: no complete checkpoint in ``directory``.
        CheckpointDamaged: ``latest.json`` cannot be read or names no checkpoint folder.
    """
    pointer = directory / "latest.json"
    if not pointer.exists():
        raise FileNotFoundError(f"no checkpoint in {str(directory)!r} (no latest.json); start without --resume")
    name = _read_json(pointer).get("checkpoint")
    if not isinstance(name, str) or not name.startswith("step-") or "/" in name:
        raise CheckpointDamaged(f"{pointer} names no checkpoint folder ({str(name)[:40]!r}); start a new run")
    return directory / name


def save(trainer: TrainingState, directory: Path, *, extra: dict, keep: int = 2) -> Path:
    """Write a checkpoint of ``trainer`` under ``directory``; keep the newest ``keep``.

    Raises:
        CheckpointWriteError: a file could not be written (a full disk, say), naming the step and
            the folder; nothing of this checkpoint is left, ``latest.json`` still names the previous.
    """
    directory.mkdir(parents=True, exist_ok=True)
    name = f"step-{trainer.step_count:08d}"
    target = directory / name
    if target.exists():  # a checkpoint of this very step exists: it is complete (renamed last)
        _point_latest(directory, name, trainer.step_count)
        return target
    try:
        with staged_directory(target) as stage:
            for i in range(len(trainer.blocks)):
                torch.save(trainer.block_state(i), stage / f"block-{i:05d}.pt")
            torch.save(trainer.buffers(), stage / "buffers.pt")
            torch.save(rng_state(), stage / "rng.pt")
            meta = {"format": FORMAT, "signature": trainer.signature(), "step": trainer.step_count,
                    "lr": trainer.lr, "extra": extra}
            atomic_write_json(stage / "meta.json", meta)
        _point_latest(directory, name, trainer.step_count)
    except FileExistsError:
        raise
    except (OSError, RuntimeError) as e:  # torch.save reports a full disk as "[enforce fail at inline_container.cc]"
        raise CheckpointWriteError(
            f"could not write the checkpoint of step {trainer.step_count} in {directory} ({_reason(e)}); the disk "
            "may be full - free space and resume from the previous checkpoint, which is kept") from None
    old = sorted(p for p in directory.glob("step-*") if p.is_dir() and p.name != name)
    for p in old[: max(0, len(old) - (keep - 1))]:
        shutil.rmtree(p, ignore_errors=True)
    log.info("checkpoint of step %d written to %s", trainer.step_count, target)
    return target


def load(trainer: TrainingState, directory: Path) -> None:
    """Restore ``trainer`` from the latest checkpoint under ``directory``.

    Raises:
        CheckpointMismatch: another model or configuration.
        CheckpointDamaged: a file of the checkpoint cannot be read, naming it.
        FileNotFoundError: no checkpoint.
    """
    folder = latest(directory)
    meta = _read_json(folder / "meta.json")
    if meta.get("format") != FORMAT:
        raise CheckpointMismatch(f"{folder} has checkpoint format {meta.get('format')!r}; "
                                 f"this edgeadapt reads {FORMAT}")
    zero, sharding = meta.get("zero1"), getattr(trainer, "sharding", None)
    if zero is not None and sharding is None:
        raise CheckpointMismatch(
            f"{folder} holds optimizer state sharded over {zero['world_size']} rank(s) (ZeRO-1) and this trainer "
            f"does not shard it; resume it with shard_optimizer_state=True (--shard-optimizer-state) under "
            f"{zero['world_size']} rank(s)")
    if zero is not None and zero["world_size"] != sharding.world_size:
        raise CheckpointMismatch(
            f"{folder} was written by {zero['world_size']} ranks with sharded optimizer state (ZeRO-1), and this "
            f"run has {sharding.world_size} rank(s); each rank holds the optimizer state of its own blocks, so "
            f"resume with {zero['world_size']} ranks (torchrun --nproc-per-node={zero['world_size']}) or start a "
            f"new run")
    check_signature(meta["signature"], trainer.signature())
    if zero is not None:
        if list(zero["owners"]) != list(sharding.owners):
            raise CheckpointMismatch(f"{folder} assigns blocks to ranks as {zero['owners']}, this trainer as "
                                     f"{sharding.owners}; resume with the same model and world size")
        _load_sharded(trainer, folder)
    else:
        for i in range(len(trainer.blocks)):
            trainer.set_block_state(i, _load_tensors(folder / f"block-{i:05d}.pt"))
        trainer.load_buffers(_load_tensors(folder / "buffers.pt"))
        set_rng_state(_load_tensors(folder / "rng.pt"))
    trainer.step_count = int(meta["step"])
    trainer.lr = float(meta["lr"])
    trainer.checkpoint_extra = dict(meta.get("extra", {}))
    log.info("resumed from %s (step %d)", folder, trainer.step_count)


# ---- sharded optimizer state (ZeRO-1): torch.distributed.checkpoint -----------------------
BLOCKS_DIR, RANKS_DIR = "blocks", "ranks"


def _from_rank0(value, sharding):
    """``value`` as rank 0 has it, on every rank (``broadcast_object_list``)."""
    if not sharding.distributed:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=sharding._global(0), group=sharding.group)
    return box[0]


def _agree(failure: BaseException | None, sharding) -> None:
    """Raise on every rank when any rank failed (``all_gather_object``)."""
    if not sharding.distributed:
        if failure is not None:
            raise failure
        return
    got = [None] * sharding.world_size
    dist.all_gather_object(got, None if failure is None else f"{type(failure).__name__}: {failure}",
                           group=sharding.group)
    if failure is not None:
        raise failure
    bad = [f"rank {r}: {m}" for r, m in enumerate(got) if m is not None]
    if bad:
        raise RuntimeError("writing the sharded checkpoint failed on another rank (" + "; ".join(bad) + ")")


def _dcp_kwargs(sharding) -> dict:
    return {"process_group": sharding.group, "no_dist": not sharding.distributed}


@contextlib.contextmanager
def _quiet_single_process(sharding):
    """One process (world size 1) uses DCP with ``no_dist``; silence its warning about that."""
    with warnings.catch_warnings():
        if not sharding.distributed:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _block_shard(trainer: TrainingState, index: int) -> dict[str, torch.Tensor]:
    """What the owner of block ``index`` writes (empty on the other ranks)."""
    if index not in trainer.sharding.owned:
        return {}
    st = trainer.block_state(index)
    out = {f"{k}/{n}": t for k, d in st.items() if k != "steps" for n, t in d.items()}
    out["steps"] = torch.tensor([int(st["steps"][n]) for n in trainer.blocks[index].param_names], dtype=torch.int64)
    return out


def _rank_shard(trainer: TrainingState) -> dict[str, torch.Tensor]:
    r = trainer.sharding.rank
    out = {f"rank{r}/rng/{k}": v for k, v in rng_state().items()}
    out.update({f"rank{r}/buffers/{n}": b for n, b in trainer.buffers().items()})
    return out


def save_sharded(trainer: TrainingState, directory: Path, *, extra: dict, keep: int = 2) -> Path:
    """Every rank writes its share of ``trainer`` (ZeRO-1) under ``directory``; rank 0 publishes.

    A collective: all ranks of the trainer's group call it after the same step.
    """
    import torch.distributed.checkpoint as dcp

    sh = trainer.sharding
    name = f"step-{trainer.step_count:08d}"
    target = directory / name
    failure: BaseException | None = None
    if _from_rank0(target.exists(), sh):  # complete already (renamed last): only the pointer
        if sh.rank == 0:
            try:
                _point_latest(directory, name, trainer.step_count)
            except Exception as e:  # noqa: BLE001 - every rank must learn of it
                failure = e
        _agree(failure, sh)
        return target
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(_quiet_single_process(sh))
            stage, why = None, None
            if sh.rank == 0:
                try:
                    directory.mkdir(parents=True, exist_ok=True)
                    stage = stack.enter_context(staged_directory(target))
                except Exception as e:  # noqa: BLE001 - sent to the other ranks below
                    why, failure = f"{type(e).__name__}: {e}", e
            stage_name, why = _from_rank0((None if stage is None else str(stage), why), sh)
            if why is not None:
                raise failure or RuntimeError(f"rank 0 could not stage the checkpoint {target}: {why}")
            stage = Path(stage_name)
            for i in range(len(trainer.blocks)):
                dcp.save(_block_shard(trainer, i), checkpoint_id=stage / BLOCKS_DIR / f"{i:05d}", **_dcp_kwargs(sh))
            dcp.save(_rank_shard(trainer), checkpoint_id=stage / RANKS_DIR, **_dcp_kwargs(sh))
            if sh.rank == 0:  # every DCP save above ended with a collective: all ranks' files are complete
                meta = {"format": FORMAT, "signature": trainer.signature(), "step": trainer.step_count,
                        "lr": trainer.lr, "extra": extra, "zero1": sh.describe()}
                atomic_write_json(stage / "meta.json", meta)
        if sh.rank == 0:
            _point_latest(directory, name, trainer.step_count)
            old = sorted(p for p in directory.glob("step-*") if p.is_dir() and p.name != name)
            for p in old[: max(0, len(old) - (keep - 1))]:
                shutil.rmtree(p, ignore_errors=True)
    except Exception as e:  # noqa: BLE001 - every rank must learn of it
        failure = e
    _agree(failure, sh)
    log.info("sharded checkpoint of step %d written to %s (rank %d of %d)", trainer.step_count, target, sh.rank,
             sh.world_size)
    return target


def _load_sharded(trainer: TrainingState, folder: Path) -> None:
    """Every rank reads all weights, its own blocks' optimizer state, its random stream and buffers."""
    import torch.distributed.checkpoint as dcp

    sh = trainer.sharding
    with _quiet_single_process(sh):
        _read_shards(trainer, folder, dcp, sh)


def _read_shards(trainer: TrainingState, folder: Path, dcp, sh) -> None:
    for i, b in enumerate(trainer.blocks):
        names = b.param_names
        # the trainer's current state is the destination: the kinds this rank holds, their shapes
        st = trainer.block_state(i)
        sd = {f"{k}/{n}": v for k, vs in st.items() if k != "steps" for n, v in vs.items()}
        steps = torch.zeros(len(names), dtype=torch.int64)
        sd["steps"] = steps
        dcp.load(sd, checkpoint_id=folder / BLOCKS_DIR / f"{i:05d}", **_dcp_kwargs(sh))
        st["steps"] = {n: steps[j] for j, n in enumerate(names)}
        trainer.set_block_state(i, st)
    where = folder / RANKS_DIR
    saved = dcp.FileSystemReader(where).read_metadata().state_dict_metadata
    prefix = f"rank{sh.rank}/"
    sd = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in saved.items() if k.startswith(prefix)}
    dcp.load(sd, checkpoint_id=where, **_dcp_kwargs(sh))
    trainer.load_buffers({k[len(prefix + "buffers/"):]: v for k, v in sd.items()
                          if k.startswith(prefix + "buffers/")})
    set_rng_state({k[len(prefix + "rng/"):]: v for k, v in sd.items() if k.startswith(prefix + "rng/")})
