"""Process memory figures from ``/proc/self/status`` (Linux), as docs/design.md's "Measuring" asks.

Peak figures are given twice:

- *total*: VmHWM (the resident high-water mark, file-backed pages included). Writing ``5`` to
  ``/proc/self/clear_refs`` resets VmHWM to the current RSS, so a peak *delta* over a baseline
  state (model loaded, no step run) can be taken inside one fresh process.
- *anonymous*: the high-water mark of RssAnon (heap, arenas, stacks: what the computation
  allocates), which the kernel does not keep, so :class:`AnonPeakSampler` samples it from a
  thread (about every millisecond). Library code paged in on first use is file-backed: it counts
  in the total but not here.

The measuring protocol that uses these probes is :mod:`edgeadapt.measure` (docs/design.md,
"Measuring"): where a figure is the bound, it calls :func:`trim_heap` just before the baseline,
so heap freed earlier in the process (loading) is returned to the OS and cannot be reused
silently by the measured span. The runner never trims.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import os
import sys
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["status_bytes", "status_fields", "rss_bytes", "anon_rss_bytes", "peak_rss_bytes", "reset_peak_rss",
           "PeakDelta", "measure_peak", "AnonPeakSampler", "AnonHighWater", "trim_heap", "libc_function"]

_STATUS = "/proc/self/status"


def status_bytes(field: str) -> int:
    """A ``kB`` field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``...) in bytes."""
    with open(_STATUS) as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(f"{field} not found in {_STATUS}")


def status_fields(*fields: str) -> dict[str, int]:
    """Several ``kB`` fields of ``/proc/self/status`` in bytes, from one read.

    Raises:
        KeyError: a field is not in the file (e.g. ``RssAnon`` before Linux 4.5).
    """
    with open(_STATUS) as f:
        text = f.read()
    out = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        if name in fields:
            out[name] = int(rest.split()[0]) * 1024
    missing = set(fields) - set(out)
    if missing:
        raise KeyError(f"{sorted(missing)} not found in {_STATUS}")
    return out


def anon_rss_bytes() -> int:
    """Resident anonymous memory (RssAnon): what the process allocated, without code or file pages."""
    return status_bytes("RssAnon")


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


@functools.cache
def libc_function(name: str, argtypes: tuple, restype):
    """``name`` from the C library the interpreter runs on, with its signature set; ``None``
    where that library has no such function (not glibc: musl, macOS, Windows)."""
    try:
        fn = getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError, TypeError):
        return None
    fn.argtypes, fn.restype = argtypes, restype
    return fn


def trim_heap() -> bool:
    """Return freed heap memory to the OS: ``gc.collect()``, then glibc's ``malloc_trim(0)``.

    The measuring protocol's step before a baseline (module docstring): without it, a measured
    span can reuse pages that earlier work freed but the allocator kept, and its peak depends on
    the process's heap history (measured: opening an ONNX Runtime training session costs
    ~250 KiB anonymous in a fresh process, ~20 KiB after a warm-up prediction over a large model).
    Not for library code: it only moves memory around for a real device.

    Returns:
        True when ``malloc_trim`` ran; False where it is unavailable (not glibc), then only the
        garbage collection ran.
    """
    gc.collect()
    fn = libc_function("malloc_trim", (ctypes.c_size_t,), ctypes.c_int)
    if fn is None:
        return False
    fn(0)
    return True


class AnonHighWater:
    """The high-water mark of RssAnon read where the caller asks (:meth:`sample`), over a baseline.

    No thread: each :meth:`sample` is one read of ``/proc/self/status`` (~10 us), so a library
    can sample at its own boundaries (the streaming trainer: every block's fetch and release).
    A peak between two samples that is freed back to the OS before the next one is missed: the
    figure is a lower bound of the true peak. Where ``/proc/self/status`` cannot be read (not
    Linux) :attr:`available` is False and nothing is sampled.
    """

    def __init__(self):
        self.baseline_bytes = 0
        self.peak_bytes = 0
        self.samples = 0
        self._fd = -1
        self._closer: weakref.finalize | None = None

    @property
    def available(self) -> bool:
        """Whether RssAnon can be read (the status file is open)."""
        return self._fd >= 0

    def open(self) -> bool:
        """Open the status file and take RssAnon now as the baseline; False where it cannot be read."""
        self.close()
        try:
            self._fd = os.open(_STATUS, os.O_RDONLY)
            self._closer = weakref.finalize(self, os.close, self._fd)  # closed with the object at the latest
            self.peak_bytes = self.samples = 0
            self.baseline_bytes = self.sample()
        except (OSError, ValueError):
            self.close()
            return False
        return True

    def _read(self) -> int:
        text = os.pread(self._fd, 8192, 0).decode()
        i = text.index("RssAnon:")
        return int(text[i + 8:text.index("kB", i)]) * 1024

    def sample(self) -> int:
        """Read RssAnon now, fold it into the peak and return it (0 when not :attr:`available`)."""
        if self._fd < 0:
            return 0
        value = self._read()
        self.samples += 1
        if value > self.peak_bytes:
            self.peak_bytes = value
        return value

    def close(self) -> None:
        """Close the status file (the figures stay; :meth:`sample` reads nothing more)."""
        if self._closer is not None:
            self._closer()
        self._closer, self._fd = None, -1

    @property
    def delta_bytes(self) -> int:
        """Peak RssAnon over the baseline."""
        return max(0, self.peak_bytes - self.baseline_bytes)


class AnonPeakSampler(AnonHighWater):
    """Tracks the high-water mark of RssAnon by reading it from a daemon thread.

    Use as a context manager; ``peak_bytes`` is the largest RssAnon seen (at entry, every
    ``interval_s`` while the body runs, and at exit). A peak shorter than the interval can be
    missed, so the figure is a lower bound; ``samples`` says how many reads it rests on. The
    thread needs the GIL for each read: native code that releases it (ONNX Runtime runs, torch
    ops) is sampled while it runs; while sampling, the interpreter's switch interval is lowered
    to ``interval_s`` so pure-Python stretches do not starve the thread.
    """

    def __init__(self, interval_s: float = 0.001):
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        super().__init__()
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._switch_s = 0.0

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def __enter__(self) -> AnonPeakSampler:
        if not self.open():
            raise OSError(f"cannot read RssAnon from {_STATUS} (Linux 4.5 or later has it)")
        self._switch_s = sys.getswitchinterval()
        sys.setswitchinterval(min(self._switch_s, self.interval_s))
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="anon-peak-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        sys.setswitchinterval(self._switch_s)
        self.sample()
        self.close()


@dataclass
class PeakDelta:
    """Filled in by :func:`measure_peak`: baseline RSS and the peak reached above it.

    ``baseline_bytes``/``peak_bytes`` are total resident memory (VmRSS at entry, VmHWM at
    exit); ``anon_baseline_bytes``/``anon_peak_bytes`` the sampled RssAnon figures (0 when
    sampling was not asked for).
    """

    baseline_bytes: int = 0
    peak_bytes: int = 0
    reset_ok: bool = False
    anon_baseline_bytes: int = 0
    anon_peak_bytes: int = 0
    anon_samples: int = 0

    @property
    def delta_bytes(self) -> int:
        """Total: VmHWM over VmRSS at entry."""
        return max(0, self.peak_bytes - self.baseline_bytes)

    @property
    def anon_delta_bytes(self) -> int:
        """Anonymous only: sampled peak RssAnon over RssAnon at entry."""
        return max(0, self.anon_peak_bytes - self.anon_baseline_bytes)


@contextlib.contextmanager
def measure_peak(anon_interval_s: float | None = None) -> Iterator[PeakDelta]:
    """Measure the peak RSS of the body over the RSS just before it.

    Without a working VmHWM reset the peak includes everything earlier in the process;
    ``reset_ok`` says which applies.

    Args:
        anon_interval_s: also sample RssAnon at this interval (an :class:`AnonPeakSampler`) and
            fill in the anonymous-only figures; ``None`` skips it.
    """
    m = PeakDelta()
    m.reset_ok = reset_peak_rss()
    m.baseline_bytes = rss_bytes()
    sampler = AnonPeakSampler(anon_interval_s) if anon_interval_s else contextlib.nullcontext()
    try:
        with sampler:
            yield m
    finally:
        m.peak_bytes = peak_rss_bytes()
        if anon_interval_s:
            m.anon_baseline_bytes, m.anon_peak_bytes = sampler.baseline_bytes, sampler.peak_bytes
            m.anon_samples = sampler.samples
