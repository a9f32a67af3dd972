"""Progress of a long job made of named stages (an export: tracing, planning, ONNX export, ...).

Library code reports stages to a :class:`Stages`; only a caller that asks for it (the command
line) gets a tqdm bar on stderr. Disabled, nothing of tqdm is built (a disabled tqdm bar still
creates tqdm's write lock), so a process that measures its own memory is not disturbed. Every
stage's time is logged at INFO either way.
"""

from __future__ import annotations

import logging
import time

__all__ = ["Stages"]

log = logging.getLogger(__name__)


class Stages:
    """A context manager over a job's stages; call :meth:`start` as each begins.

    Args:
        desc: the job's name, shown before the bar (``"export"``).
        total: the number of stages the job runs (the bar's length).
        progress: show a tqdm bar on stderr (removed when the job ends).

    Example::

        with Stages("export", 3, progress=True) as stages:
            stages.start("tracing")
            ...
            stages.start("self-check")
    """

    def __init__(self, desc: str, total: int, *, progress: bool = False):
        self.desc = desc
        self._bar = None
        if progress:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, desc=desc, leave=False, bar_format="{desc} ({n}/{total}) [{elapsed}]")
        self._name: str | None = None
        self._t0 = time.perf_counter()

    def start(self, name: str) -> None:
        """End the current stage (logging its time) and show ``name`` as the one running."""
        self._finish()
        self._name, self._t0 = name, time.perf_counter()
        if self._bar is not None:
            self._bar.set_description_str(f"{self.desc}: {name}")

    def _finish(self) -> None:
        if self._name is None:
            return
        log.info("%s: %s took %.1f s", self.desc, self._name, time.perf_counter() - self._t0)
        if self._bar is not None:
            self._bar.update(1)
        self._name = None

    def __enter__(self) -> Stages:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self._finish()
        if self._bar is not None:
            self._bar.close()
