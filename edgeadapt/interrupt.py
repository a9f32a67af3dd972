"""Ctrl-C at a step boundary, for the training loops (``train`` on the server, ``adapt`` on the device).

A loop runs inside :class:`StopAtStepBoundary` and reads :attr:`~StopAtStepBoundary.requested`
between steps: the step in progress completes, the loop then stops where its state is
consistent, saves what it keeps, prints one line and exits with :data:`INTERRUPTED`.
Standard library only (the torch-free runtime imports it).
"""

from __future__ import annotations

import signal
import threading

__all__ = ["INTERRUPTED", "StopAtStepBoundary"]

INTERRUPTED = 130  # exit status after Ctrl-C (128 + SIGINT), as shells report it


class StopAtStepBoundary:
    """While active, Ctrl-C (SIGINT) asks the training loop to stop after the step in progress
    (the loop reads :attr:`requested`); a second Ctrl-C interrupts at once. Only the main
    thread can own signal handlers: elsewhere nothing is installed and Ctrl-C acts as usual."""

    def __init__(self) -> None:
        self.requested = False
        self._previous = None

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __enter__(self) -> StopAtStepBoundary:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
