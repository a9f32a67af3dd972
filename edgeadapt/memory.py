"""Process memory figures from ``/proc/self/status`` (Linux), as DESIGN.md's "Measuring" asks.

Peak figures are VmHWM (the resident high-water mark). Writing ``5`` to ``/proc/self/clear_refs``
resets VmHWM to the current RSS, so a peak *delta* over a baseline state (model loaded, no step
run) can be taken inside one fresh process.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["status_bytes", "rss_bytes", "peak_rss_bytes", "reset_peak_rss", "PeakDelta", "measure_peak"]

_STATUS = "/proc/self/status"


def status_bytes(field: str) -> int:
    """A ``kB`` field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``...) in bytes."""
    with open(_STATUS) as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(f"{field} not found in {_STATUS}")


def rss_bytes() -> int:
    """Current resident set size."""
    return status_bytes("VmRSS")


def peak_rss_bytes() -> int:
    """Resident high-water mark since start or the last :func:`reset_peak_rss`."""
    return status_bytes("VmHWM")


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS; False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


@dataclass
class PeakDelta:
    """Filled in by :func:`measure_peak`: baseline RSS and the peak reached above it."""

    baseline_bytes: int = 0
    peak_bytes: int = 0
    reset_ok: bool = False

    @property
    def delta_bytes(self) -> int:
        return max(0, self.peak_bytes - self.baseline_bytes)


@contextlib.contextmanager
def measure_peak() -> Iterator[PeakDelta]:
    """Measure the peak RSS of the body over the RSS just before it.

    Without a working VmHWM reset the peak includes everything earlier in the process;
    ``reset_ok`` says which applies.
    """
    m = PeakDelta()
    m.reset_ok = reset_peak_rss()
    m.baseline_bytes = rss_bytes()
    try:
        yield m
    finally:
        m.peak_bytes = peak_rss_bytes()
