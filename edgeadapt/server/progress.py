"""A tqdm progress bar for training: loss, windows (or tokens) per second, bytes per tier."""

from __future__ import annotations

import time

from tqdm.auto import tqdm

from ..units import format_bytes

__all__ = ["TrainProgress"]


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
        """The fields shown: loss, throughput, compute-tier tracked peak (of the budget) and bytes in host/disk."""
        elapsed = max(time.perf_counter() - self._t0, 1e-9)
        tiers = self.trainer.residency()["tiers"]
        fields = {"loss": f"{self.loss:.4f}", f"{self.unit}/s": f"{self._items / elapsed:.1f}",
                  "compute peak": format_bytes(self.trainer.tracked_peak_bytes)}
        budget = getattr(self.trainer, "budget_bytes", None)
        if budget:
            fields["compute peak"] += f" of {format_bytes(budget)}"
        fields.update({t: format_bytes(b) for t, b in tiers.items() if t != "compute" and b})
        if getattr(self.trainer, "shards_optimizer_state", False):  # ZeRO-1: this rank's share
            fields["optimizer state"] = format_bytes(self.trainer.optimizer_state_bytes)
        return fields

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
