"""The runner's progress bar: a tqdm bar that allocates nothing on first use beyond the bar.

tqdm's first bar in a process builds its default write lock, which imports ``multiprocessing``
(~150 KiB anonymous memory, measured), and starts a monitor thread (its stack). Inside
``Runner.adapt`` that would be memory the plan does not count, paid by the first call only. The
runner's bars therefore use a threading lock made when this module is imported (the runner is
thread-safe, not multi-process-safe: a bar lives in the process that adapts) and no monitor
thread (it only adjusts ``miniters`` for bars that update rarely).
"""

from __future__ import annotations

import threading

from tqdm.auto import tqdm

__all__ = ["AdaptBar"]


class AdaptBar(tqdm):
    """``tqdm.auto.tqdm`` with a threading write lock and no monitor thread."""

    monitor_interval = 0
    _lock = threading.RLock()
