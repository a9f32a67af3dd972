"""The measured memory of one :meth:`Runner.adapt` call: per optimizer step and for the whole call.

Baseline: the process just before the call, i.e. the loaded runner (parameters, the eval
session, whatever earlier calls left) - the training session opened inside the call is measured.
Each figure is given twice (docs: "Measuring"):

* total: VmHWM over the baseline VmRSS. VmHWM is reset (``/proc/self/clear_refs``) at the call's
  start and before every step; before each reset the high-water mark so far is folded into the
  call's, so the call figure still covers everything;
* anonymous only: the sampled high-water mark of RssAnon (a thread reads it every
  ``ANON_INTERVAL_S`` and at every step's start and end) over the baseline RssAnon. Spikes
  shorter than the interval can be missed: a lower bound.

All probes come from :mod:`edgeadapt.memory`. Where ``/proc`` is missing (not Linux) every figure is
``None``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass

from .. import memory

__all__ = ["ANON_INTERVAL_S", "MeasuredPeaks", "AdaptPeaks"]

log = logging.getLogger(__name__)

ANON_INTERVAL_S = 0.001


@dataclass(frozen=True)
class MeasuredPeaks:
    """Peaks over the baseline, bytes (``None``: not measurable here)."""

    step_peak_bytes: int | None = None
    step_peak_anon_bytes: int | None = None
    call_peak_bytes: int | None = None
    call_peak_anon_bytes: int | None = None


class AdaptPeaks:
    """Context manager measuring a call; :meth:`step` wraps each optimizer step inside it."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self._on = False
        self._base_total = self._base_anon = 0
        self._call_total = self._call_anon = 0
        self._step_total = self._step_anon = 0
        self._sampler: memory.AnonPeakSampler | None = None

    def __enter__(self) -> AdaptPeaks:
        if not self.enabled:
            return self
        try:
            base = memory.status_fields("VmRSS", "RssAnon")
            sampler = memory.AnonPeakSampler(ANON_INTERVAL_S)
            sampler.__enter__()
        except (OSError, KeyError) as e:
            log.debug("memory not measured: %s", e)
            return self
        self._on = memory.reset_peak_rss()
        if not self._on:
            sampler.__exit__(None, None, None)
            return self
        self._sampler = sampler
        self._base_total, self._base_anon = base["VmRSS"], base["RssAnon"]
        return self

    def _fold(self) -> None:
        self._call_total = max(self._call_total, memory.peak_rss_bytes())
        self._call_anon = max(self._call_anon, self._sampler.peak_bytes)

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """The body is one step: its peaks are taken apart and folded into the call's."""
        if not self._on:
            yield
            return
        s = self._sampler
        self._fold()
        memory.reset_peak_rss()
        s.peak_bytes = 0
        s.sample()
        try:
            yield
        finally:
            s.sample()
            self._step_total = max(self._step_total, memory.peak_rss_bytes())
            self._step_anon = max(self._step_anon, s.peak_bytes)
            # the call's peak covers every step's by definition; folding the step's own readings
            # keeps that true when the kernel's per-CPU RSS counters read a page apart
            self._call_total = max(self._call_total, self._step_total)
            self._call_anon = max(self._call_anon, self._step_anon)

    def __exit__(self, *exc) -> None:
        if self._on:
            self._sampler.__exit__(None, None, None)
            self._fold()

    def result(self) -> MeasuredPeaks:
        if not self._on:
            return MeasuredPeaks()
        steps = self._step_total > 0
        return MeasuredPeaks(
            step_peak_bytes=max(0, self._step_total - self._base_total) if steps else None,
            step_peak_anon_bytes=max(0, self._step_anon - self._base_anon) if steps else None,
            call_peak_bytes=max(0, self._call_total - self._base_total),
            call_peak_anon_bytes=max(0, self._call_anon - self._base_anon),
        )
