"""What a training run shows as it goes (the CLI's bar and log lines, :class:`TrainProgress`): loss,
windows (or tokens) per second, the compute tier's tracked peak against the budget beside the
process's own, bytes per tier."""

from __future__ import annotations

import time

from tqdm.auto import tqdm

from ..units import format_bytes

__all__ = ["TrainProgress", "memory_fields"]


def memory_fields(trainer) -> dict[str, str]:
    """The memory a run reports, by name: ``peak`` (the tracked compute-tier peak, of the budget
    when there is one), ``process`` (the process's anonymous peak over the loaded trainer,
    :attr:`~edgeadapt.server.Trainer.process_peak_bytes`, where it can be read), on a GPU ``gpu
    allocated`` (:attr:`~edgeadapt.server.Trainer.gpu_peak_bytes`), the bytes kept in
    host memory and on disk, and with ZeRO-1 this rank's optimizer state."""
    budget = getattr(trainer, "budget_bytes", None)
    fields = {"peak": format_bytes(trainer.tracked_peak_bytes) + (f" of {format_bytes(budget)}" if budget else "")}
    process = getattr(trainer, "process_peak_bytes", None)
    if process is not None:
        fields["process"] = f"+{format_bytes(process)}"
    gpu = getattr(trainer, "gpu_peak_bytes", None)
    if gpu is not None:
        fields["gpu allocated"] = f"+{format_bytes(gpu)}"
    try:
        tiers = trainer.residency()["tiers"]
    except (AttributeError, NotImplementedError):
        tiers = {}
    fields.update({t: format_bytes(int(b)) for t, b in tiers.items() if t != "compute" and b})
    if getattr(trainer, "shards_optimizer_state", False):  # ZeRO-1: this rank's share
        sh = trainer.sharding
        fields["optimizer state"] = (f"{format_bytes(trainer.optimizer_state_bytes)} on rank {sh.rank} of "
                                     f"{sh.world_size} ({len(sh.owned)}/{len(sh.owners)} blocks)")
    return fields


class TrainProgress:
    """Wraps a tqdm bar; call :meth:`update` after each step.

    Args:
        trainer: the :class:`~edgeadapt.server.Trainer` (for residency and bytes per tier).
        total: steps in the run.
        initial: the step the run starts at (a resumed run).
        unit: what the throughput counts (``"windows"`` or ``"tokens"``).
        disable: no bar (non-main ranks, ``--no-progress``).
        **tqdm_kwargs: passed to ``tqdm`` (e.g. ``file``).

    Example::

        with TrainProgress(t, total=steps) as bar:
            for x, y in data:
                bar.update(t.step(x, y), items=x.shape[0])
    """

    def __init__(self, trainer, total: int, *, initial: int = 0, unit: str = "windows", disable: bool = False,
                 **tqdm_kwargs):
        self.trainer, self.unit = trainer, unit
        self.bar = tqdm(total=total, initial=initial, unit="step", desc="train", disable=disable, **tqdm_kwargs)
        self._t0 = time.perf_counter()
        self._items = 0
        self.loss = float("nan")

    def postfix(self) -> dict[str, str]:
        """The fields shown: loss, throughput and :func:`memory_fields`."""
        elapsed = max(time.perf_counter() - self._t0, 1e-9)
        return {"loss": f"{self.loss:.4f}", f"{self.unit}/s": f"{self._items / elapsed:.1f}",
                **memory_fields(self.trainer)}

    def update(self, loss: float, *, items: int) -> None:
        """Record one step's loss and how many windows (or tokens) it processed."""
        self.loss = float(loss)
        self._items += int(items)
        self.bar.set_postfix(self.postfix(), refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()

    def __enter__(self) -> TrainProgress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
