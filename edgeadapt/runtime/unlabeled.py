"""Safe label-free adaptation: robust methods, resets on collapse and a safety gate, offline or online.

:class:`UnlabeledAdapter` adapts a :class:`~edgeadapt.runtime.Runner` to unlabeled windows in
three stages, each optional (:class:`UnlabeledSettings`):

1. **Source-anchored normalisation statistics** (Schneider et al. 2020): every BatchNorm's
   running mean and variance become ``(1 - w) * source + w * target``. The target statistics
   come from the backend's forward-only statistics pass (the one ``bn-stats`` runs),
   accumulated over batches as per-channel sums (fixed size, however many windows arrive).
   Needs ``batchnorm="batch"``. The weight ``w`` (``stats_weighting``):

   * ``"shrinkage"`` (default), one ``w`` per BatchNorm, set by the evidence: the target
     statistics are an estimate whose sampling noise is measured from how much they vary
     between small groups of windows (a cluster estimate, so windows of one activity or one
     stretch of time count as one piece of evidence). The source statistics are the prior, and
     the empirical-Bayes (positive-part James-Stein) weight is
     ``w = max(0, 1 - noise / discrepancy)`` over the layer's channels, where the discrepancy
     is the squared distance of target from source (means in source standard deviations, plus
     log-variances) and the noise its expected value were there no shift. A subject far from
     the source gets ``w`` near 1 (``bn-stats``), one within the noise keeps the source's; more
     windows lower the noise and raise ``w``.
   * ``"count"``: ``w = n / (n + stats_prior_windows)`` for ``n`` target windows seen, whatever
     the shift.
2. **Entropy minimisation on reliable windows with an anchor** (EATA-like): optimizer steps of
   the bundle's entropy loss on the windows whose normalised prediction entropy is below
   ``entropy_threshold`` only; after each step every trained tensor is pulled back toward its
   source value by ``anchor`` (a distance penalty applied as a proximal step), and the running
   statistics the training graph moved are restored. Needs a bundle with the ``entropy`` loss.
3. **Prototype head adjustment** (backprop-free, T3A-like): class means of the head's input
   features over confident windows (pseudo-labelled, entropy below ``prototype_threshold``)
   make a nearest-mean linear classifier ``k * (mu_c . f - |mu_c|^2 / 2) + offset``; the head
   becomes ``(1 - prototype_mix) * source head + prototype_mix * that`` for the classes with a
   prototype, ``k`` matching the two heads' weight norms, ``offset`` the one that makes the
   nearest-mean logits of the prototypes' own windows average the source head's (so that when
   the windows show only some classes, those gain no prior over the others). Per-class feature
   sums are kept, not features.

After every stage the adapter checks for **collapse** on the windows it just saw (one class for
nearly everything, entropy falling to zero) and **resets** that stage to the state before it.
Finally the **safety gate** (:mod:`.safety_gate`) compares the adapted and the source model on
held-back windows and keeps the adaptation or returns to the source model;
:class:`UnlabeledResult` reports the decision and its evidence. An offline call cross-fits the
gate (``cross_fit``): each fold of ``gate_fraction`` of the windows is held back in turn while the
others are adapted on, so the gate's evidence covers every window (four times as many as one
held-back share) and the adaptation kept is made from every window; a stream holds back its
first windows.

Memory is bounded: the adapter holds a copy of the tensors it may change (the source values),
the per-channel and per-class sums, and at most ``gate_windows`` held-back windows; it runs
inference and statistics passes of at most ``INFERENCE_BATCH_WINDOWS`` / ``STATS_BATCH_WINDOWS``
windows (the statistics passes interleave a batch's windows, so each spans all of it) and builds
the gate's views one pass at a time; a stream of any length adds nothing (``Runner.adapt_stream``).
Under a bundle's memory budget the passes are the largest whose predicted peak fits
(:func:`edgeadapt.sched.predict_label_free`), or the call is refused before any work
(``BudgetExceeded``).
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field, fields, replace

import numpy as np

from .arrays import Rows
from .features import suffix_inputs
from .head_features import HeadFeatures, LinearHead
from .peaks import AdaptPeaks
from .safety_gate import (GateDecision, GateSettings, collapsed, decide, evidence, normalized_entropy,
                          pool_evidence, softmax, view_logits)
from .stats_shrinkage import GroupedStatistics, shrinkage_weight

__all__ = ["UnlabeledSettings", "UnlabeledResult", "UnlabeledAdapter", "held_back_windows", "adapt_unlabeled",
           "adapt_stream"]

log = logging.getLogger(__name__)

_STATS_SUFFIXES = ("running_mean", "running_var")
# Windows per forward-only statistics pass (bounds its activations: a pass holds every layer's
# activations of its windows; batches of a stream are smaller), and per inference pass (logits,
# head features, the gate's views). The passes interleave the batch's windows, so each one
# normalises its deeper layers with statistics of all the batch's activities.
STATS_BATCH_WINDOWS = 16
INFERENCE_BATCH_WINDOWS = 256
# "shrinkage": windows per group whose statistics measure the sampling noise (each batch of a
# stream is cut into groups of at most this many), and the fewest groups the noise needs;
# with fewer the source statistics stay.
STATS_GROUP_WINDOWS = 4
MIN_STATS_GROUPS = 3
STATS_WEIGHTINGS = ("shrinkage", "count")
# Reset messages kept for the result (the count covers all of them): a stream stays bounded.
MAX_RESETS_KEPT = 16
# Numpy temporaries per input byte while the gate's augmented views of a pass are built (float64
# noise, product and shifted copy, the float32 view, the standard deviation's temporaries): about
# 7 live, measured 11.6 over the process with the allocator's fragmentation (8 x 256 windows,
# passes of 4, edgeadapt.measure); 16 bounds it.
VIEW_BYTES_PER_INPUT_BYTE = 16
# float64 arrays of a BatchNorm's channel count held per layer: pooled sums, the groups' cluster
# sums and the measured momentum.
STATS_SUM_ARRAYS = 12
# float32 head weights' worth of bytes the prototype stage holds: its per-class feature sums and
# the source and mixed heads, all float64 (2 each).
HEAD_COPIES = 6


def _window_bytes(manifest) -> int:
    """Bytes of one input window (a dimension the bundle leaves open counts as 1)."""
    spec = manifest.input
    return math.prod(d or 1 for d in spec.shape[1:]) * np.dtype(spec.dtype).itemsize


def _var_name(mean_name: str) -> str:
    """The ``running_var`` beside a ``running_mean``."""
    return mean_name[:-len("running_mean")] + "running_var"


@dataclass(frozen=True)
class UnlabeledSettings:
    """Settings of label-free adaptation. The defaults are the recommended ``label-free`` method's,
    chosen on source subjects only (``edgeadapt/harness/label_free_settings.py``; README).

    Attributes:
        stats_prior_windows: ``inf``: the source statistics stay (stage 1 off); otherwise, with
            ``stats_weighting="count"``, ``N0`` of the weight ``w = n / (n + N0)`` (0: the
            target's replace them, ``bn-stats``).
        stats_weighting: ``"shrinkage"`` (``w`` per BatchNorm from the evidence: the shift
            against the sampling noise) or ``"count"`` (``w`` from the window count); see the
            module docstring.
        entropy_steps: optimizer steps of stage 2 per :meth:`UnlabeledAdapter.update` (0: off).
        lr: learning rate of those steps.
        entropy_threshold: windows with normalised entropy below this train (reliable ones).
        anchor: fraction of the distance to the source values removed after each step (0..1).
        batch_size: windows per entropy step.
        prototype_mix: weight of the prototype classifier in the head (0: stage 3 off).
        prototype_threshold: windows with normalised entropy below this make prototypes.
        min_prototype_windows: a class needs this many confident windows to get a prototype.
        gate: ``False``: keep whatever the stages produced (no held-back windows, no gate).
        gate_fraction: share of an offline call's windows held back for the gate at a time.
        gate_windows: at most this many held-back windows at a time (the first ones of a stream).
        cross_fit: an offline call's gate sees every window: the windows are cut into folds of
            ``gate_fraction`` (at most ``gate_windows``), each held back in turn while the
            others are adapted on, and the gate decides on the evidence of all the folds about
            the adaptation made from every window (``False``: one fold is held back and never
            adapted on). A stream holds back its first windows either way.
        gate_views: augmented views per held-back window.
        gate_settings: the gate's thresholds.
        seed: seeds the held-back choice, the entropy batches and the views.
    """

    stats_prior_windows: float = 64.0
    stats_weighting: str = "shrinkage"
    entropy_steps: int = 0
    lr: float = 1e-3
    entropy_threshold: float = 0.4
    anchor: float = 0.1
    batch_size: int = 16
    prototype_mix: float = 0.3
    prototype_threshold: float = 0.3
    min_prototype_windows: int = 2
    gate: bool = True
    gate_fraction: float = 0.25
    gate_windows: int = 64
    gate_views: int = 2
    cross_fit: bool = True
    gate_settings: GateSettings = field(default_factory=GateSettings)
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.gate_settings, dict):
            object.__setattr__(self, "gate_settings", GateSettings(**self.gate_settings))
        if self.stats_weighting not in STATS_WEIGHTINGS:
            raise ValueError(f"stats_weighting must be one of {STATS_WEIGHTINGS}, got {self.stats_weighting!r}")
        if not (self.stats_prior_windows >= 0):
            raise ValueError("stats_prior_windows must be >= 0 (inf: keep the source's), "
                             f"got {self.stats_prior_windows}")
        for name in ("entropy_steps", "batch_size", "min_prototype_windows", "gate_windows", "gate_views"):
            value = getattr(self, name)
            low = 0 if name == "entropy_steps" else 1
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr must be a finite number > 0, got {self.lr}")
        for name in ("entropy_threshold", "anchor", "prototype_mix", "prototype_threshold"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)!r}")
        if not isinstance(self.cross_fit, bool):
            raise ValueError(f"cross_fit must be a bool, got {self.cross_fit!r}")
        if not 0 < self.gate_fraction < 1:
            raise ValueError(f"gate_fraction must be in (0, 1), got {self.gate_fraction!r}")

    @classmethod
    def from_dict(cls, values: dict) -> UnlabeledSettings:
        """Settings from a JSON object (unknown keys refused, naming the known ones)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown label-free settings {unknown}; known: {sorted(known)}")
        return cls(**values)

    def to_dict(self) -> dict:
        """A JSON-serialisable copy (``inf`` as the string ``"inf"`` is not needed: JSON floats)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["gate_settings"] = {f.name: getattr(self.gate_settings, f.name) for f in fields(GateSettings)}
        return out


@dataclass(frozen=True)
class UnlabeledResult:
    """What label-free adaptation did and why the result is the model the runner now holds.

    Attributes:
        kept: ``True``: the runner holds the adapted model; ``False``: the source model (the gate
            refused the adaptation, or nothing was adapted).
        gate: the gate's decision and evidence, ``None`` without a gate.
        stages: the stages applied and kept (``stats``, ``entropy``, ``prototypes``).
        skipped: stages that could not run on this bundle, with the reason.
        resets: the last resets (at most ``MAX_RESETS_KEPT``): the stage (or ``gate``, in a
            stream) and what was seen; n_resets: how many there were in all.
        n_adapt_windows: windows adapted on; n_gate_windows: windows the gate's evidence covers
            (held back for it; cross-fitted, every window once, in folds); cross_fitted: whether
            the gate's evidence came from the folds of a cross-fitted call.
        stats_weight: the final target weight ``w`` of the statistics, averaged over the
            BatchNorm layers (0 when not applied); stats_layer_weights: each layer's ``w``.
        steps: entropy optimizer steps taken; updates: batches seen.
        settings: the settings used (JSON form).
        time_s: wall time; call_peak_bytes / call_peak_anon_bytes: the call's memory over the
            state before it (see :class:`~edgeadapt.runtime.AdaptResult`); ``None`` where not
            measured (a stream measured by its caller).
    """

    kept: bool
    gate: GateDecision | None
    stages: tuple[str, ...]
    skipped: tuple[str, ...]
    resets: tuple[str, ...]
    n_resets: int
    n_adapt_windows: int
    n_gate_windows: int
    stats_weight: float
    steps: int
    updates: int
    settings: dict
    time_s: float
    call_peak_bytes: int | None = None
    call_peak_anon_bytes: int | None = None
    stats_layer_weights: dict[str, float] = field(default_factory=dict)
    cross_fitted: bool = False


class _EvalFeatures:
    """Features before the head and logits from the runner's own eval session: the bundle's eval
    graph returns them (manifest ``head``), so no session is built."""

    def __init__(self, runner):
        self.head = LinearHead.from_dict(runner.manifest.head)
        self._runner = runner

    def run(self, X: np.ndarray, batch_windows: int = INFERENCE_BATCH_WINDOWS) -> tuple[np.ndarray, np.ndarray]:
        """``(features, logits)`` of the windows ``X`` under the backend's current values."""
        r = self._runner
        feats, logits = [], []
        for start in range(0, len(X), batch_windows):
            x = X[start:start + batch_windows]
            f, out = r._backend.forward_features(suffix_inputs(r._prefix, x, batch_windows), r._dummy_labels(len(x)))
            feats.append(f)
            logits.append(out)
        return np.concatenate(feats), np.concatenate(logits)


def _features_source(runner, names: list[str], backend):
    """The bundle's eval graph when it returns the head's input, else a session of its own."""
    if runner.manifest.head is not None:
        return _EvalFeatures(runner)
    return HeadFeatures(runner.export_inference, names, backend.get_tensor)


class UnlabeledAdapter:
    """Label-free adaptation of one runner, fed batch by batch (see module docstring).

    Use :meth:`hold_back` for the gate's windows (a stream's first ``gate_windows`` windows go
    there by themselves), :meth:`update` with each batch, then :meth:`finish`.
    """

    def __init__(self, runner, settings: UnlabeledSettings | None = None, gate_rows: int | None = None):
        """``gate_rows``: windows that will be held back for the gate (default and at most
        ``settings.gate_windows``).

        Raises:
            BudgetExceeded: the bundle has a memory budget and not even passes of one window
                (statistics passes of ``STATS_GROUP_WINDOWS``) fit it; nothing was adapted.
        """
        self.runner = runner
        self.settings = settings or UnlabeledSettings()
        s = self.settings
        self._gate_rows = s.gate_windows if gate_rows is None else max(0, min(gate_rows, s.gate_windows))
        backend = runner._backend
        self._backend = backend
        names = backend.parameter_names()
        self._stats_names = [n for n in names if n.endswith(_STATS_SUFFIXES)]
        self._trained = backend.parameter_names(trainable_only=True)
        self._skipped: list[str] = []
        self._head: HeadFeatures | _EvalFeatures | None = None
        # windows per statistics pass and per inference pass
        self._stats_windows, self._pass_windows = STATS_BATCH_WINDOWS, INFERENCE_BATCH_WINDOWS
        try:
            self._head = _features_source(runner, names, backend)
        except ValueError as e:  # no linear head: the gate and the collapse checks use the logits alone
            if s.prototype_mix > 0:
                self._skipped.append(f"prototypes: {e}")
        head = [] if self._head is None else [n for n in (self._head.head.weight, self._head.head.bias) if n]
        self._source = {n: backend.get_tensor(n) for n in dict.fromkeys(self._stats_names + self._trained + head)}
        self._stats_on = math.isfinite(s.stats_prior_windows) and bool(self._stats_names)
        if math.isfinite(s.stats_prior_windows) and not runner.manifest.batch_statistics:
            self._skipped.append("stats: the bundle normalises with frozen statistics (export with batchnorm='batch')")
            self._stats_on = False
        elif math.isfinite(s.stats_prior_windows) and not self._stats_names:
            self._skipped.append("stats: the model has no BatchNorm running statistics to re-estimate")
        self._entropy_on = s.entropy_steps > 0 and bool(self._trained)
        if s.entropy_steps > 0 and runner.manifest.loss != "entropy":
            self._skipped.append("entropy: the bundle's loss is not 'entropy' (export with loss='entropy')")
            self._entropy_on = False
        self._entropy_batch = s.batch_size
        self._plan_passes()
        self._rng = np.random.default_rng(s.seed)
        self._momentum: dict[str, np.ndarray] | None = None
        self._reset_sums()
        # held-back windows and the source model's evidence on them
        self._gate_X: np.ndarray | None = None
        self._gate_fill = 0
        self._collecting = True
        self._gate_source = None
        self._resets: deque[str] = deque(maxlen=MAX_RESETS_KEPT)
        self._n_resets = 0
        self._steps = self._updates = self._n_adapt = 0
        self._start = time.perf_counter()

    def _held_bytes(self) -> int:
        """What the adapter holds for the whole call: source copies, sums, the gate's windows."""
        window = _window_bytes(self.runner.manifest)
        held = sum(v.nbytes for v in self._source.values()) + self._gate_rows * window
        held += sum(STATS_SUM_ARRAYS * 2 * self._source[n].nbytes for n in self._stats_names
                    if n.endswith("running_mean"))
        if self._head is not None:  # per-class feature sums and the head's float64 copies while mixing
            held += HEAD_COPIES * self._source[self._head.head.weight].nbytes
        held += np.dtype(np.int64).itemsize * int(self.runner.manifest.output.shape[-1])  # per-class counts
        return held

    def _plan_passes(self) -> None:
        """Windows per pass (and per entropy step) within the bundle's memory budget, if any."""
        self.predicted = None  # the predicted peak (sched.Peak) under the bundle's budget
        if not self._adapts():
            return
        passes = self.runner._call_plan.label_free_passes(
            held_bytes=self._held_bytes(), max_pass_windows=INFERENCE_BATCH_WINDOWS,
            max_stats_windows=STATS_BATCH_WINDOWS if self._stats_on else None,
            min_stats_windows=STATS_GROUP_WINDOWS if self.settings.stats_weighting == "shrinkage" else 1,
            view_bytes_per_window=self._view_bytes_per_window(), entropy_steps=self._entropy_on)
        self._pass_windows, self.predicted = passes.pass_windows, passes.predicted
        self._stats_windows = passes.stats_windows or STATS_BATCH_WINDOWS
        self._entropy_batch = min(self.settings.batch_size, passes.entropy_step_windows or self.settings.batch_size)

    def _view_bytes_per_window(self) -> int:
        return VIEW_BYTES_PER_INPUT_BYTE * _window_bytes(self.runner.manifest)

    def predicted_peak(self, n_windows: int | None = None):
        """The call's predicted peak (``sched.Peak``): under a budget, that of the passes fitted
        to it; without one, from the bundle's plan and graph with its engine's constants, for
        passes of the default size or, given the call's ``n_windows``, no larger than the windows
        it adapts on or holds back (``None`` when the bundle carries no plan, or no stage runs).
        Imports the planner: for reports (``edgeadapt plan --unlabeled``), never during a call."""
        if self.predicted is not None or not self._adapts():
            return self.predicted
        passes, stats = self._pass_windows, self._stats_windows if self._stats_on else None
        if n_windows is not None:
            gate = self._gate_rows if self.settings.gate else 0
            # a cross-fitted call ends adapting on every window (holding none back)
            adapted = n_windows if self.settings.gate and self.settings.cross_fit else n_windows - gate
            passes = max(1, min(passes, max(adapted, gate)))
            stats = None if stats is None else max(1, min(stats, adapted))
        return self.runner._call_plan.predict_label_free(
            held_bytes=self._held_bytes(), pass_windows=passes, stats_windows=stats,
            view_bytes_per_window=self._view_bytes_per_window(), entropy_steps=self._entropy_on)

    def _prototypes_on(self) -> bool:
        return self._head is not None and self.settings.prototype_mix > 0

    def _adapts(self) -> bool:
        """Whether any stage is on (otherwise the call holds nothing back and runs no pass)."""
        return self._stats_on or self._entropy_on or self._prototypes_on()

    def plan(self, n_windows: int | None = None) -> dict:
        """How the call is carried out under the bundle's budget (JSON-able): the stages that
        will run and those skipped, windows per inference / statistics pass and per entropy step,
        what the adapter holds, and the predicted peak (:meth:`predicted_peak` for a call of
        ``n_windows``)."""
        return {"stages": [name for name, on in (("stats", self._stats_on), ("entropy", self._entropy_on),
                                                 ("prototypes", self._prototypes_on())) if on],
                "skipped": list(self._skipped), "gate_windows": self._gate_rows if self.settings.gate else 0,
                "cross_fit": self.settings.gate and self.settings.cross_fit,
                "pass_windows": self._pass_windows, "stats_windows": self._stats_windows if self._stats_on else None,
                "entropy_step_windows": self._entropy_batch if self._entropy_on else None,
                "held_bytes": self._held_bytes(),
                "predicted": None if (peak := self.predicted_peak(n_windows)) is None else peak.to_dict(),
                "budget_bytes": self.runner._call_plan.budget_bytes}

    # ---- accumulators -------------------------------------------------------------------
    def _reset_sums(self) -> None:
        """Per-channel statistic sums and per-class prototype sums: fixed size."""
        self._stats_n = 0
        self._stats_sum = {n: np.zeros_like(self._source[n], dtype=np.float64) for n in self._stats_names
                           if n.endswith("running_mean")}
        self._stats_sq = {n: np.zeros_like(v) for n, v in self._stats_sum.items()}
        self._stats_groups = {n: GroupedStatistics(v.shape) for n, v in self._stats_sum.items()}
        self._proto_sum: np.ndarray | None = None
        self._proto_n: np.ndarray | None = None
        self._entropy_applied = 0
        self._class_counts: np.ndarray | None = None  # the summed windows, per class predicted before their update

    def _restore(self, names) -> None:
        for n in names:
            self._backend.set_tensor(n, self._source[n])

    def _take(self, names) -> dict[str, np.ndarray]:
        return {n: self._backend.get_tensor(n) for n in names}

    def _put(self, values: dict[str, np.ndarray]) -> None:
        for n, v in values.items():
            self._backend.set_tensor(n, v)

    def _logits(self, X: np.ndarray | Rows) -> np.ndarray:
        """Logits of the windows ``X``, one inference pass (``_pass_windows``) at a time."""
        parts = []
        for start in range(0, len(X), self._pass_windows):
            x = X[start:start + self._pass_windows]
            parts.append(self._head.run(x, self._pass_windows)[1] if self._head is not None
                         else self.runner.predict(x, batch_size=self._pass_windows))
        return np.concatenate(parts)

    # ---- the gate's windows -------------------------------------------------------------
    def hold_back(self, X: np.ndarray | Rows, last: bool = False) -> np.ndarray | Rows:
        """Keep windows of ``X`` for the gate (until ``gate_windows`` are kept); returns the rest.

        ``X`` may be a :class:`Rows` view: the kept windows are then copied once, straight into
        the gate's buffer.

        Held-back windows are never adapted on; the source model's evidence on them is taken
        when they arrive, so hold windows back before the first :meth:`update` that adapts.
        ``last``: no further windows are held back (else :meth:`update` keeps filling the
        gate's windows from its batches until there are ``gate_windows``).
        """
        s = self.settings
        if not self._collecting or not s.gate or self._gate_fill >= self._gate_rows or not self._adapts():
            return X
        self._collecting = not last
        if self._updates:
            raise RuntimeError("hold windows back before the first update: the source model is needed for them")
        take = min(len(X), self._gate_rows - self._gate_fill)
        if self._gate_X is None:
            self._gate_X = np.empty((self._gate_rows, *X.shape[1:]), dtype=np.float32)
        self._gate_X[self._gate_fill:self._gate_fill + take] = X[:take]
        self._gate_fill += take
        self._gate_source = self._evidence()
        return Rows(X.data, X.rows[take:]) if isinstance(X, Rows) else X[take:]

    def _evidence(self):
        X = self._gate_X[:self._gate_fill]
        views = view_logits(X, self.settings.seed, self.settings.gate_views, self._logits, self._pass_windows)
        return evidence(self._logits(X), views)

    # ---- stages -------------------------------------------------------------------------
    def _batch_statistics(self, X: np.ndarray) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Per BatchNorm (by its ``running_mean`` name): the batch's per-channel mean and variance.

        The backend's statistics pass returns ``m * previous + (1 - m) * batch`` for each
        running statistic (``m`` the BatchNorm momentum); run from zeros it returns
        ``(1 - m) * batch``, and ``m`` itself is measured once from a second run from ones.
        """
        kept = self._take(self._stats_names)
        x = suffix_inputs(self.runner._prefix, X, len(X))

        def run_from(value: float) -> dict[str, np.ndarray]:
            self._put({n: np.full_like(kept[n], value) for n in self._stats_names})
            _, applied = self._backend.update_statistics(x, None)
            if not applied:
                raise FloatingPointError("the target windows give non-finite BatchNorm statistics; check the data")
            return self._take(self._stats_names)

        zero = run_from(0.0)
        if self._momentum is None:
            one = run_from(1.0)
            self._momentum = {n: (one[n] - zero[n]).astype(np.float64) for n in self._stats_names}
        self._put(kept)
        return {n: (zero[n] / (1.0 - self._momentum[n]), zero[_var_name(n)] / (1.0 - self._momentum[_var_name(n)]))
                for n in self._stats_sum}

    def _target_statistics(self, X: np.ndarray) -> None:
        """Add the windows' per-channel statistics to the sums: pooled over interleaved passes of
        at most ``STATS_BATCH_WINDOWS`` windows, and (``"shrinkage"``) per group of at most
        ``STATS_GROUP_WINDOWS`` consecutive windows for the sampling noise."""
        # Pass j takes windows j, j + k, j + 2k, ... of the k passes: every pass spans the whole
        # batch (all its activities), so the pass statistics that normalise its deeper layers
        # are those of the batch, however small the passes the budget allows.
        n_passes = -(-len(X) // self._stats_windows)
        for j in range(n_passes):
            part = X[np.arange(j, len(X), n_passes)]
            for n, (mean, var) in self._batch_statistics(part).items():
                self._stats_sum[n] += len(part) * mean
                self._stats_sq[n] += len(part) * (var + mean * mean)
            self._stats_n += len(part)
        # The groups get passes of their own: their deeper layers see activations normalised by
        # the group's statistics, so they measure the spread, not the pooled values.
        if self.settings.stats_weighting == "shrinkage":
            for start in range(0, len(X), STATS_GROUP_WINDOWS):
                part = X[start:start + STATS_GROUP_WINDOWS]
                for n, (mean, var) in self._batch_statistics(part).items():
                    self._stats_groups[n].add(mean, var, len(part))

    def _pooled(self, n: str) -> tuple[np.ndarray, np.ndarray]:
        """The target's per-channel mean and variance over every window seen."""
        mean = self._stats_sum[n] / self._stats_n
        return mean, np.maximum(self._stats_sq[n] / self._stats_n - mean * mean, 0.0)

    def layer_weights(self) -> dict[str, float]:
        """Each BatchNorm's target weight ``w`` (keyed by its ``running_mean`` name) for the
        windows accumulated so far; empty when stage 1 is off or has seen nothing."""
        if not self._stats_on or not self._stats_n:
            return {}
        s = self.settings
        if s.stats_weighting == "count":
            return dict.fromkeys(self._stats_sum, self._stats_n / (self._stats_n + s.stats_prior_windows))
        return {n: shrinkage_weight(self._source[n], self._source[_var_name(n)], *self._pooled(n),
                                    self._stats_groups[n], MIN_STATS_GROUPS) for n in self._stats_sum}

    @property
    def stats_weight(self) -> float:
        """The target weight ``w`` averaged over the BatchNorm layers (0 when stage 1 is off)."""
        weights = self.layer_weights()
        return float(np.mean(list(weights.values()))) if weights else 0.0

    def _apply_statistics(self) -> None:
        for n, w in self.layer_weights().items():
            mean, var = self._pooled(n)
            v = _var_name(n)
            self._backend.set_tensor(n, ((1 - w) * self._source[n] + w * mean).astype(np.float32))
            self._backend.set_tensor(v, ((1 - w) * self._source[v] + w * var).astype(np.float32))

    def _entropy_steps(self, X: np.ndarray) -> None:
        s = self.settings
        stats = self._take(self._stats_names)
        for _ in range(s.entropy_steps):
            ent = normalized_entropy(softmax(self._logits(X)))
            reliable = np.flatnonzero(ent < s.entropy_threshold)
            if len(reliable) < 2:
                break
            batch = self._rng.permutation(reliable)[:self._entropy_batch]
            self.runner.train_step(X[batch], None, lr=s.lr)
            self._put(stats)  # the training graph moves the running statistics: stage 1 owns them
            if s.anchor > 0:
                for n in self._trained:
                    v = self._backend.get_tensor(n)
                    self._backend.set_tensor(n, v - s.anchor * (v - self._source[n]))
            self._steps += 1
            self._entropy_applied += 1

    def _prototypes(self, X: np.ndarray) -> None:
        s = self.settings
        head = self._head.head
        for start in range(0, len(X), self._pass_windows):  # one pass's features at a time
            feats, logits = self._head.run(X[start:start + self._pass_windows], self._pass_windows)
            probs = softmax(logits)
            classes = probs.argmax(axis=1)
            confident = normalized_entropy(probs) < s.prototype_threshold
            n_classes = probs.shape[1]
            if self._proto_sum is None:
                self._proto_sum = np.zeros((n_classes, feats.shape[1]))
                self._proto_n = np.zeros(n_classes, dtype=np.int64)
            np.add.at(self._proto_sum, classes[confident], feats[confident])
            self._proto_n += np.bincount(classes[confident], minlength=n_classes)
        W = self._source[head.weight].astype(np.float64)
        W = W if head.transposed else W.T  # (classes, features)
        b = (self._source[head.bias].astype(np.float64) if head.bias else np.zeros(n_classes))
        have = self._proto_n >= s.min_prototype_windows
        if not have.any():
            return
        n = self._proto_n[have].astype(np.float64)
        mu = self._proto_sum[have] / n[:, None]
        k = np.linalg.norm(W[have]) / max(np.linalg.norm(mu), 1e-12)
        half_sq = k * 0.5 * (mu * mu).sum(axis=1)
        # The nearest-mean logits are defined up to a common offset. Where some classes have no
        # prototype (the windows showed only some activities: label shift) that offset weighs the
        # mixed classes against the source head's: fixed so that over the windows that made the
        # prototypes the nearest-mean logit of each one's class averages the source head's logit
        # (mu_c . sum_c f = n_c |mu_c|^2), a class seen here gains no prior over one not seen.
        source_mean = ((W[have] * self._proto_sum[have]).sum() + n @ b[have]) / n.sum()
        offset = source_mean - (n @ half_sq) / n.sum()
        W_new, b_new = W.copy(), b.copy()
        W_new[have] = (1 - s.prototype_mix) * W[have] + s.prototype_mix * k * mu
        b_new[have] = (1 - s.prototype_mix) * b[have] + s.prototype_mix * (offset - half_sq)
        self._backend.set_tensor(head.weight, (W_new if head.transposed else W_new.T).astype(np.float32))
        if head.bias:
            self._backend.set_tensor(head.bias, b_new.astype(np.float32))

    def _check_collapse(self, stage: str, X: np.ndarray, before: dict[str, np.ndarray],
                        reference) -> bool:
        """Reset ``stage`` (restore ``before``) when the model collapsed on ``X``; True if reset."""
        now = evidence(self._logits(X), [])
        why = collapsed(now, reference, self.settings.gate_settings)
        if why is None:
            return False
        self._put(before)
        self._resets.append(f"{stage} (update {self._updates + 1}): {why}")
        self._n_resets += 1
        log.warning("label-free %s reset: %s", stage, why)
        return True

    # ---- public -------------------------------------------------------------------------
    def update(self, X: np.ndarray, rows: np.ndarray | None = None) -> None:
        """Adapt on one batch of unlabeled windows (validated as :meth:`Runner.predict` does).

        While the gate still wants windows (a stream's beginning), they are held back first.
        ``rows``: adapt on these windows of ``X`` only, in this order (none held back), gathered
        one pass at a time rather than copied.
        """
        from .validate import check_inputs

        X = check_inputs(self.runner.manifest, X)
        X = self.hold_back(X) if rows is None else Rows(X, rows)
        if not len(X):
            return
        if not self._adapts():  # every stage skipped or reset: nothing to run
            self._n_adapt += len(X)
            self._updates += 1
            return
        logits = self._logits(X)
        reference = evidence(logits, [])
        # which classes the summed windows show (the gate's label-shift check)
        counts = np.bincount(logits.argmax(axis=1), minlength=logits.shape[1])
        self._class_counts = counts if self._class_counts is None else self._class_counts + counts
        if self._stats_on:
            before = self._take(self._stats_names)
            self._target_statistics(X)
            self._apply_statistics()
            if self._check_collapse("stats", X, before, reference):
                self._stats_on = False
        if self._entropy_on:
            before = self._take(self._trained)
            self._entropy_steps(X)
            if self._check_collapse("entropy", X, before, reference):
                self._entropy_on = False
        if self._prototypes_on():
            head = [n for n in (self._head.head.weight, self._head.head.bias) if n]
            before = self._take(head)
            self._prototypes(X)
            if self._check_collapse("prototypes", X, before, reference):
                self._proto_sum = self._proto_n = None
        self._n_adapt += len(X)
        self._updates += 1

    def stages(self) -> tuple[str, ...]:
        """The stages that are on (not skipped, not reset)."""
        return tuple(name for name, on in (("stats", self._stats_on and self._stats_n > 0),
                                           ("entropy", self._entropy_on and self._entropy_applied > 0),
                                           ("prototypes", self._proto_n is not None
                                            and bool((self._proto_n >= self.settings.min_prototype_windows).any())))
                     if on)

    def gate(self) -> GateDecision | None:
        """The gate's decision on the current adaptation (``None`` without held-back windows)."""
        if self._gate_source is None or not self._gate_fill:
            return None
        return decide(self._gate_source, self._evidence(), self.settings.gate_settings, self._class_counts)

    def check_gate(self) -> bool:
        """Ask the gate now; when it refuses, reset to the source model (recorded). True if kept.

        When its only objection is that the windows so far show nearly one class (a stream's
        first bout of one activity), the runner holds the source model but the sums are kept: the
        next batches may show the other activities, and the adaptation is then made from all the
        windows seen (statistics and prototypes are functions of the sums)."""
        decision = self.gate()
        if decision is None or decision.kept or not self.stages():
            return True
        if decision.only_label_shift:
            self._restore(self._source)
            return False
        self._resets.append(f"gate (update {self._updates}): " + "; ".join(decision.reasons))
        self._n_resets += 1
        self.reset()
        return False

    def reset(self) -> None:
        """Return to the source model and clear every accumulated sum."""
        self._restore(self._source)
        self._reset_sums()

    def finish(self, decision: GateDecision | None = None) -> UnlabeledResult:
        """Apply the gate (returning to the source model if it refuses) and report.

        ``decision``: the gate's decision made on evidence gathered elsewhere (the folds of a
        cross-fitted call); default: asked now on this adapter's held-back windows."""
        external = decision is not None
        decision = decision if external else self.gate()
        stages = self.stages()
        kept = bool(stages) and (decision is None or decision.kept)
        layer_weights = self.layer_weights() if kept and "stats" in stages else {}
        weight = float(np.mean(list(layer_weights.values()))) if layer_weights else 0.0
        if not kept:
            self.reset()
            self.runner._clean_checkpoint = None
        elif stages:
            self.runner._clean_checkpoint = None
        if decision is not None:
            log.info("label-free gate: %s%s", "kept" if decision.kept else "returned to the source model",
                     "" if decision.kept else " (" + "; ".join(decision.reasons) + ")")
        return UnlabeledResult(kept, decision, stages if kept else (), tuple(self._skipped), tuple(self._resets),
                               self._n_resets,
                               self._n_adapt, decision.n_windows if external else self._gate_fill, weight,
                               self._steps, self._updates,
                               self.settings.to_dict(), time.perf_counter() - self._start,
                               stats_layer_weights=layer_weights)


def _with_peaks(result: UnlabeledResult, peaks: AdaptPeaks) -> UnlabeledResult:
    measured = peaks.result()
    return UnlabeledResult(**{**vars(result), "call_peak_bytes": measured.call_peak_bytes,
                              "call_peak_anon_bytes": measured.call_peak_anon_bytes})


def held_back_windows(settings: UnlabeledSettings, n_windows: int) -> int:
    """Windows an offline call of ``n_windows`` holds back for the gate: ``gate_fraction`` of
    them, at most ``gate_windows``, at least one."""
    return min(settings.gate_windows, max(1, int(round(settings.gate_fraction * n_windows))))


def adapt_unlabeled(runner, X: np.ndarray, settings: UnlabeledSettings | None = None) -> UnlabeledResult:
    """Adapt ``runner`` on the unlabeled windows ``X`` in one pass; see :class:`UnlabeledAdapter`.

    A seeded ``gate_fraction`` of ``X`` (at most ``gate_windows``, at least one window) is held
    back for the gate; the rest is adapted on as one batch, in the order given. Give the windows
    in the order they were recorded: with ``stats_weighting="shrinkage"`` neighbouring windows
    form the groups whose spread measures the statistics' noise, so that a stretch of one
    activity counts as one piece of evidence (shuffled windows look independent, the noise
    looks smaller and the statistics move further than the evidence supports).
    """
    from .validate import check_inputs

    settings = settings or UnlabeledSettings()
    X = check_inputs(runner.manifest, X)
    if len(X) < 2:
        raise ValueError(f"label-free adaptation needs at least 2 windows, got {len(X)}")
    n_gate = held_back_windows(settings, len(X))
    with AdaptPeaks() as peaks:
        if settings.gate and settings.cross_fit:
            return _with_peaks(_cross_fitted(runner, X, settings, n_gate), peaks)
        adapter = UnlabeledAdapter(runner, settings, gate_rows=n_gate if settings.gate else 0)
        order = np.random.default_rng(settings.seed).permutation(len(X))
        if settings.gate:
            adapter.hold_back(Rows(X, order[:n_gate]), last=True)
            adapter.update(X, rows=np.sort(order[n_gate:]))  # the caller's order: groups of neighbours
        else:
            adapter.update(X)
        result = adapter.finish()
    return _with_peaks(result, peaks)


def _cross_fitted(runner, X: np.ndarray, settings: UnlabeledSettings, n_gate: int) -> UnlabeledResult:
    """The offline call with a cross-fitted gate (``UnlabeledSettings.cross_fit``): the seeded
    permutation of the windows is cut into folds of ``n_gate``; for each, an adapter holds it back
    and adapts on the others (in the caller's order), its evidence on the fold is kept and the
    runner returns to the source model. Then one adapter adapts on every window and the gate
    decides on the evidence of all the folds (and on the classes of every window adapted on).
    One adapter is alive at a time, so the call holds what one fold's holds."""
    order = np.random.default_rng(settings.seed).permutation(len(X))
    source, adapted = [], []
    for start in range(0, len(X), n_gate):
        held = order[start:start + n_gate]
        adapter = UnlabeledAdapter(runner, settings, gate_rows=len(held))
        adapter.hold_back(Rows(X, held), last=True)
        adapter.update(X, rows=np.sort(np.concatenate([order[:start], order[start + n_gate:]])))
        decision = adapter.gate()
        adapter.reset()
        del adapter  # its source copies and held-back windows go before the next one's are taken
        if decision is None:  # no stage runs: nothing to gate
            break
        source.append(decision.source)
        adapted.append(decision.adapted)
    final = UnlabeledAdapter(runner, settings, gate_rows=0)
    final.update(X)
    decision = None
    if source:
        decision = decide(pool_evidence(source), pool_evidence(adapted), settings.gate_settings, final._class_counts)
    return replace(final.finish(decision), cross_fitted=decision is not None)


def adapt_stream(runner, batches: Iterable[np.ndarray], settings: UnlabeledSettings | None = None) -> UnlabeledResult:
    """Adapt ``runner`` on a stream of unlabeled batches, one :meth:`UnlabeledAdapter.update` each.

    The stream's first ``gate_windows`` windows are held back for the gate; nothing else is
    kept from a batch once it is processed, so memory does not grow with the stream. The gate
    is asked after every batch that adapted: when it refuses, the runner returns to the source
    model and the sums start again (recorded in ``resets``), so the model held between batches
    is one the gate accepted; when it refuses only because the windows so far show nearly one
    class, the runner holds the source model and keeps the sums (the stream's next bouts may
    show the other activities).
    """
    with AdaptPeaks() as peaks:
        adapter = UnlabeledAdapter(runner, settings)
        for batch in batches:
            adapter.update(batch)
            adapter.check_gate()
        result = adapter.finish()
    return _with_peaks(result, peaks)
