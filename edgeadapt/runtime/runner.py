"""``Runner``: load a bundle, adapt it on new data, evaluate, predict, save, resume, export.

Torch-free: numpy + onnxruntime only. A typical session::

    runner = Runner.load("bundle/", device="auto")
    runner.adapt(X_new, y_new, epochs=5, batch_size=32)
    runner.evaluate(X_eval, y_eval)
    runner.save("adapted/")             # a bundle again: resume with Runner.load("adapted/")
    runner.export_inference("model.onnx")
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import secrets
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
# numpy >= 2 imports numpy.random on first use (~1.2 MiB anonymous): importing it here makes that
# part of loading the runner, not of the first adapt call's budget
from numpy.random import default_rng

from ..atomic import atomic_path, staged_directory
from ..bundle import BundleError, Manifest, bundle_lock, read_manifest, sha256_file, sweep_orphans, write_manifest
from .backend import OrtTrainingBackend, TrainingBackend
from .bars import AdaptBar
from .call_plan import CallPlan
from .engines import STATE_ROLES, choose_backend, dropped_roles, kept_roles
from .portable import PortableBackend
from ..interrupt import StopAtStepBoundary
from .errors import (AdaptInterrupted, DeviceUnavailableError, NonFiniteLossError, NonFiniteStateError,
                     NonFiniteUpdateError)
from .finite import SQUARE_SAFE_LIMIT, first_out_of_range
from .peaks import AdaptPeaks
from .rollback import EpochValues
from .features import PrefixModel, merge_inference, open_prefix, suffix_inputs
from ..onnx_guard import MAX_ABS_VALUE, check_bundle_models, check_checkpoint_values
from .validate import check_class_ids, check_inputs, check_int, check_labels, check_learning_rate
from .arrays import Rows
from .unlabeled import adapt_stream, adapt_unlabeled

__all__ = ["Runner", "AdaptResult", "EvalResult", "SCHEDULES"]

log = logging.getLogger(__name__)


class _NoBar(contextlib.nullcontext):
    """Stands in for a disabled progress bar (a disabled tqdm still builds tqdm's lock)."""

    def __enter__(self) -> _NoBar:
        return self

    def update(self, n: int = 1) -> None:
        pass

    def set_postfix(self, **kwargs) -> None:
        pass


def _progress_bar(progress: bool, **kwargs):
    """A tqdm bar when ``progress``, else a no-op stand-in that allocates nothing."""
    return AdaptBar(leave=False, **kwargs) if progress else _NoBar()

SCHEDULES = ("constant", "cosine")


def _check_counts(epochs: object, batch_size: object, seed: object) -> tuple[int, int, int]:
    """``epochs`` and ``batch_size`` as positive ints and ``seed`` as an int >= 0 (what
    :func:`numpy.random.default_rng` takes); :class:`InputError` naming the first that is not."""
    return check_int(epochs, "epochs"), check_int(batch_size, "batch_size"), check_int(seed, "seed", minimum=0)


@dataclass(frozen=True)
class AdaptResult:
    """What one :meth:`Runner.adapt` call did, and the memory it took.

    Memory figures are measured in the calling process (``None`` where ``/proc`` is missing or
    no step ran), in bytes above the baseline: the process just before the call, i.e. the
    loaded runner (parameters, the eval session, and whatever earlier calls left open).

    Attributes:
        step_peak_bytes: the largest resident high-water mark (VmHWM) reached during any single
            optimizer step (all its micro-batches' forward/backward and the update), over the
            baseline; it includes what the call holds at that time (the training session opened
            by the first step, cached features, the rollback copy).
        step_peak_anon_bytes: the same for anonymous memory only (sampled RssAnon: heap,
            arenas; no file-backed library code), a lower bound (sampled every millisecond
            and at each step's start and end).
        call_peak_bytes: total resident memory: VmHWM of the whole call over the baseline (feature
            computation, the training session, every step, rollback copies, a replay when one
            ran), *including* file-backed pages such as library code paged in on first use,
            which the OS can drop and re-read; not what a memory budget bounds.
        call_peak_anon_bytes: anonymous memory only (sampled RssAnon: heap, arenas, stacks):
            what the call allocated, the figure a bundle's memory budget bounds.
    """

    epochs: int
    steps: int
    epoch_losses: tuple[float, ...]
    time_s: float
    step_peak_bytes: int | None = None
    step_peak_anon_bytes: int | None = None
    call_peak_bytes: int | None = None
    call_peak_anon_bytes: int | None = None


@dataclass(frozen=True)
class EvalResult:
    """Mean loss over the data and, for classification bundles, accuracy."""

    loss: float
    accuracy: float | None
    n_windows: int


def _check_creatable(out: Path) -> None:
    """Refuse a new directory ``out`` that :meth:`Runner.save` could not make: the nearest of its
    folders that exists (the missing ones are made, and the bundle is staged beside ``out``) is
    not a directory, or not writable."""
    ancestor = out.parent
    while not os.path.lexists(ancestor) and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise NotADirectoryError(f"cannot create {out}: {ancestor} exists and is not a directory; "
                                 "choose an output directory elsewhere")
    _check_writable(ancestor, out)


def _check_writable(directory: Path, out: Path) -> None:
    """Refuse to save ``out`` when this process cannot write in ``directory``."""
    if not os.access(directory, os.W_OK | os.X_OK):
        raise PermissionError(f"cannot write {out}: {directory} is not writable by this user (or read-only); "
                              "choose an output directory you can write to")


class Runner:
    """On-device adaptation of one bundle. Create it with :meth:`Runner.load`."""

    # The bundle's frozen prefix (``prefix_model``), run as inference in front of the training
    # graphs; ``None`` when they take the model input directly. Set by :meth:`load`.
    _prefix: PrefixModel | None = None

    def __init__(self, bundle_dir: Path, manifest: Manifest,
                 open_backend: Callable[[Path | None], TrainingBackend], backend: str = "ort-training"):
        """Prefer :meth:`load`. ``open_backend(checkpoint_path)`` opens a session (of the engine
        ``backend``, see :mod:`.engines`) on the
        bundle's graphs with the given checkpoint (``None``: the bundle's own)."""
        self.bundle_dir = Path(bundle_dir)
        self.manifest = manifest
        self._open_backend = open_backend
        self.backend = backend
        self._state_role = STATE_ROLES[backend]
        self._backend = open_backend(None)
        self._call_plan = CallPlan(manifest, backend)  # adapt calls held to the plan's budget (sched loaded now)
        # A checkpoint file equal to the current state (rollback replays from it); None once changed.
        self._clean_checkpoint: Path | None = self.bundle_dir / manifest.files[self._state_role]
        self.step = int(manifest.state.get("step", 0))
        self.epoch = int(manifest.state.get("epoch", 0))

    @classmethod
    def load(cls, bundle_dir: str | os.PathLike, *, device: str = "auto", threads: int | None = None,
             backend: str = "auto") -> Runner:
        """Verify a bundle's manifest and checksums, then open a training session on ``device``.

        Args:
            bundle_dir: an exported or adapted bundle directory.
            device: ``auto`` (CUDA if it works, else CPU with a warning), ``cuda`` or ``cpu``.
            threads: intra-op threads; ``None`` (or 0) lets ONNX Runtime decide.
            backend: ``auto`` (the portable graphs when the bundle holds them, else the
                onnxruntime-training ones), ``portable`` or ``ort-training`` (see :mod:`.engines`).

        Raises:
            BundleError: not a bundle, malformed manifest, missing, oversized or damaged file,
                checksum mismatch, a path outside the bundle, models that disagree with the
                manifest or use ops the exporter never writes (see ``docs/bundle-trust.md``).
            DeviceUnavailableError: ``device="cuda"`` and CUDA cannot run the session.
            BackendUnavailableError: the bundle's training engine is not installed (names the extra).
            InputError: ``threads`` is not None or an int >= 0.
        """
        if threads is not None:
            threads = check_int(threads, "threads", minimum=0)
        bundle_dir = Path(bundle_dir)
        if not bundle_dir.is_dir():
            raise BundleError(f"{bundle_dir} is not an edgeadapt bundle: no such directory")
        chosen: list[str] = []

        def open_backend(checkpoint: Path | None) -> TrainingBackend:
            # Re-opening (rollback) reuses the device picked the first time: no second fallback warning.
            engine = PortableBackend if name == "portable" else OrtTrainingBackend
            opened = engine(bundle_dir, manifest, device=chosen[0] if chosen else device,
                            threads=threads, checkpoint_path=checkpoint)
            chosen[:] = [opened.device]
            return opened

        # Shared lock: a concurrent in-place save cannot remove the checkpoint being read.
        with bundle_lock(bundle_dir, exclusive=False):
            manifest = read_manifest(bundle_dir, verify=True)
            name = choose_backend(manifest, backend, str(bundle_dir))
            parameter_names = check_bundle_models(bundle_dir, manifest, backend=name)
            try:
                runner = cls(bundle_dir, manifest, open_backend, name)
                runner._prefix = open_prefix(bundle_dir, manifest, device="cuda" if device == "cuda" else "cpu",
                                             threads=threads)
            except Exception as e:
                # ORT raises its pybind types, or a bare RuntimeError naming its own C++ source.
                if isinstance(e, DeviceUnavailableError) or not (
                        type(e).__module__.startswith("onnxruntime") or type(e) is RuntimeError):
                    raise
                reason = (str(e).strip().splitlines() or [type(e).__name__])[-1][:300]
                opened = ", ".join(manifest.files[r] for r in sorted(kept_roles(manifest, name)) if r != "masks")
                raise BundleError(
                    f"{bundle_dir}: ONNX Runtime could not open {opened} ({reason}); the bundle is damaged - "
                    "re-export it or restore a copy"
                ) from None
            check_checkpoint_values(runner._backend.get_tensor, parameter_names, manifest, bundle_dir,
                                    state_role=runner._state_role)
        log.info("loaded %s on %s: %d trainable elements", bundle_dir, runner.device, manifest.trainable_numel)
        return runner

    @property
    def device(self) -> str:
        """The device the session runs on (``cuda`` or ``cpu``)."""
        return self._backend.device

    @property
    def learning_rate(self) -> float:
        """The learning rate exported with the bundle (the default for :meth:`adapt`)."""
        return float(self.manifest.optimizer["lr"])

    # ---- training -------------------------------------------------------------------
    def train_step(self, x: np.ndarray, y: np.ndarray | None = None, lr: float | None = None,
                   micro_batch: int | None = None) -> float:
        """One optimizer step on a batch; returns the batch's mean loss before the update.

        With ``micro_batch`` smaller than the batch, the forward/backward runs over slices of at
        most that many windows and their gradients are accumulated (each slice weighted by its
        share of the batch, so the step equals one over the whole batch, see
        :meth:`adapt`) before the one update.

        Raises:
            NonFiniteLossError: the loss is NaN/inf; the update is not applied.
            NonFiniteUpdateError: a gradient too large for the optimizer state (not applied), or
                the update made a trained value non-finite or larger than loading accepts
                (applied: the runner is then unusable, :meth:`save` refuses it).
            ValueError: ``micro_batch`` < the batch on a batch-statistics BatchNorm bundle.
        """
        step_lr = check_learning_rate(self.learning_rate if lr is None else lr)
        micro = self._micro_batch(micro_batch, len(x))
        # x is model input; with a prefix model the training graph takes the prefix's features.
        return self._step(suffix_inputs(self._prefix, x, micro), y, step_lr, micro)

    def _micro_batch(self, micro_batch: int | None, batch_size: int) -> int:
        """Windows per forward/backward: ``micro_batch``, else the plan's, else the batch."""
        if micro_batch is None:
            micro_batch = (self.manifest.plan or {}).get("micro_batch_windows")
            if micro_batch is None or self.manifest.batch_statistics:
                return batch_size
        micro_batch = check_int(micro_batch, "micro_batch")
        if micro_batch < batch_size and self.manifest.batch_statistics:
            raise ValueError(
                f"micro_batch={micro_batch} is smaller than the batch ({batch_size} windows), but this bundle "
                "normalises with batch statistics (manifest batchnorm='batch'): every micro-batch would be "
                "normalised with its own statistics, so the step would differ from one over the batch. "
                "Use micro_batch=None (or >= batch_size), or export with batchnorm='frozen'")
        return min(micro_batch, batch_size)

    def _step(self, x: np.ndarray | Rows, y: np.ndarray | Rows | None, lr: float, micro: int) -> float:
        """One optimizer step over ``x`` in slices of ``micro`` windows (gradient accumulation).

        The loss is a mean over the windows a ``train_step`` sees, and ONNX Runtime adds each
        call's gradients into the kept ones. For the whole batch of ``n`` windows the gradient is
        the sum over slices of ``(b_i / n) * g_i`` (``g_i`` the mean-loss gradient of slice ``i``
        of ``b_i`` windows). The kept buffer holds that sum divided by the current slice's weight
        ``w_i = b_i / n``: before a slice whose weight differs from the previous one it is rescaled
        by ``w_prev / w_i``, and after the last slice by ``w_last``. Equal slices therefore cost
        one rescale per step, and one slice (no micro-batching) none: then the step is exactly
        the plain one.

        The update is checked on both sides (bounds in :mod:`.finite`): the gradients before it
        (one too large for the optimizer state: the update is not applied) and the values
        training changes after it.
        """
        n = len(x)
        loss_sum, prev_w = 0.0, None
        for start in range(0, n, micro):
            part = slice(start, min(n, start + micro))
            size = part.stop - part.start
            w = size / n
            if prev_w is not None and w != prev_w:
                self._backend.scale_gradients(prev_w / w)
            loss, _ = self._backend.train_step(x[part], None if y is None else y[part])
            if not math.isfinite(loss):
                self._backend.discard_gradients()
                raise NonFiniteLossError(self.step, loss)
            loss_sum += loss * size
            prev_w = w
        self._backend.scale_gradients(prev_w)
        loss = loss_sum / n
        trained = self._backend.parameter_names(trainable_only=True)
        if bad := first_out_of_range(self._backend.get_gradient, trained, SQUARE_SAFE_LIMIT):
            self._backend.discard_gradients()
            raise NonFiniteUpdateError(self.step, loss, f"the gradient of {bad[0]} reached {bad[1]:.3g} (the "
                                       f"optimizer state overflows above {SQUARE_SAFE_LIMIT:.3g})", applied=False)
        self._backend.apply_update(lr)
        self._clean_checkpoint = None
        if bad := first_out_of_range(self._backend.get_tensor, self._mutable_tensors(), MAX_ABS_VALUE):
            raise NonFiniteUpdateError(self.step, loss, f"{bad[0]} reached {bad[1]:.3g} (loading accepts at most "
                                       f"{MAX_ABS_VALUE:g})", applied=True)
        self.step += 1
        return loss

    def adapt(
        self, X: np.ndarray, y: np.ndarray | None = None, *, epochs: int = 1, batch_size: int = 32,
        lr: float | None = None, schedule: str = "constant", shuffle: bool = True, seed: int = 0,
        progress: bool = True, micro_batch: int | None = None,
    ) -> AdaptResult:
        """Adapt on ``X`` (and ``y`` unless the loss is label-free) for ``epochs`` passes.

        Data are validated against the manifest before the first step. The training session
        (gradient buffers, optimizer state) opens inside the first call, so the call's measured
        memory covers it.

        A non-finite loss, or a non-finite update (:class:`NonFiniteUpdateError`, see
        :meth:`train_step`), stops with :class:`NonFiniteLossError` after rolling parameters *and*
        optimizer state back to the start of the failing epoch. No checkpoint is written per
        epoch: the runner keeps a copy of the values that training changes (the trained tensors
        and, with batch-statistics BatchNorm, the running statistics), and on failure re-opens
        the checkpoint the call started from (the bundle's own file when the runner is unchanged
        since :meth:`load` or :meth:`save`; otherwise one written at the call's start) and
        replays this call's completed epochs, which are deterministic. The replayed values are
        checked bit for bit against the kept copy (on a mismatch they are restored from the copy
        and a warning says the optimizer state may differ slightly).

        Ctrl-C (in the main thread) stops at the next step boundary: the runner is brought back
        to the end of the last completed epoch as above, and :class:`AdaptInterrupted` (a
        ``KeyboardInterrupt``) is raised; a second Ctrl-C interrupts at once.

        ``lr=0`` runs :meth:`update_bn_statistics` instead (no backward, no optimizer).

        A bundle exported with a memory budget holds every call to it: more windows or a larger
        micro-batch than its plan covers are planned again within the budget before the first
        step, or refused then with the numbers (``edgeadapt.sched.BudgetExceeded``; see
        :mod:`.call_plan`).

        Args:
            X: float32 windows, shape as exported (batch axis first).
            y: labels as the bundle's loss needs them, or ``None`` for a label-free loss.
            epochs: passes over the data.
            batch_size: windows per optimizer step; the last batch may be smaller.
            lr: peak learning rate; default: the one exported with the bundle.
            schedule: ``constant`` or ``cosine`` decay to zero over this call's steps.
            shuffle: reshuffle each epoch (seeded by ``seed`` and the epoch index).
            progress: show a progress bar.
            micro_batch: windows per forward/backward inside a step (gradients accumulate over a
                step's micro-batches; the update is the whole batch's); default: the manifest
                plan's ``micro_batch_windows`` when present, else the whole batch. Refused below
                the batch size for a batch-statistics BatchNorm bundle.

        Returns:
            What the call did, with its measured memory (see :class:`AdaptResult`).

        Raises:
            InputError: bad data, or ``epochs``, ``batch_size``, ``micro_batch`` not a positive int
                or ``seed`` not an int >= 0 (a bool or a float is neither), before any work.
        """
        epochs, batch_size, seed = _check_counts(epochs, batch_size, seed)
        if lr is not None and not isinstance(lr, bool) and isinstance(lr, (int, float)) and lr == 0:
            return self.update_bn_statistics(X, y, epochs=epochs, batch_size=batch_size, shuffle=shuffle,
                                             seed=seed, progress=progress)
        X = check_inputs(self.manifest, X)
        y = check_labels(self.manifest, y, X.shape[0])
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
        peak_lr = check_learning_rate(self.learning_rate if lr is None else lr)
        micro = self._micro_batch(micro_batch, min(batch_size, X.shape[0]))
        # more windows or a larger micro-batch than planned: planned again within the budget, or refused now
        micro = self._call_plan.micro_batch(X.shape[0], min(batch_size, X.shape[0]), micro, micro_batch is not None,
                                            self.manifest.batch_statistics)
        n = X.shape[0]
        per_epoch = math.ceil(n / batch_size)
        total = per_epoch * epochs

        def batches(epoch: int) -> list[np.ndarray]:
            order = default_rng(seed + epoch).permutation(n) if shuffle else np.arange(n)
            return [order[b * batch_size:(b + 1) * batch_size] for b in range(per_epoch)]

        def step_lr(done: int) -> float:
            return peak_lr if schedule == "constant" else 0.5 * peak_lr * (1 + math.cos(math.pi * done / total))

        losses = []
        start = time.perf_counter()
        done = 0
        # The bar opens before the measured span: tqdm's first bar in a process builds its
        # (multiprocessing) write lock, ~220 KiB of one-time imports that are no part of a call.
        with (_progress_bar(progress, total=total, desc="adapt", unit="step") as bar,
              AdaptPeaks() as peaks,
              tempfile.TemporaryDirectory(prefix="edgeadapt-rollback-") as scratch,
              StopAtStepBoundary() as stop):
            # With a prefix model: every window's features once per call, then the suffix trains on them.
            X = suffix_inputs(self._prefix, X, micro)
            call_start = (self.step, self.epoch)
            source = self._rollback_source(Path(scratch))
            self._backend.open_training()
            for e in range(epochs):
                kept = EpochValues.take(self._backend, self._mutable_tensors())
                start_step = self.step
                epoch_loss = 0.0
                for idx in batches(self.epoch):
                    if stop.requested:
                        if self.step != start_step:
                            self._roll_back(source, call_start, e, batches, step_lr, X, y, micro, kept)
                        raise AdaptInterrupted(self.step, self.epoch, e)
                    try:
                        with peaks.step():
                            loss = self._step(Rows(X, idx), Rows.of(y, idx), step_lr(done), micro)
                    except NonFiniteLossError as err:
                        self._roll_back(source, call_start, e, batches, step_lr, X, y, micro, kept)
                        raise err.rolled_back(start_step) from None
                    epoch_loss += loss * len(idx)
                    done += 1
                    bar.update(1)
                    bar.set_postfix(epoch=e + 1, loss=f"{loss:.4f}")
                self.epoch += 1
                losses.append(epoch_loss / n)
                log.info("epoch %d: mean loss %.4f", self.epoch, losses[-1])
                del kept
        return AdaptResult(epochs, done, tuple(losses), time.perf_counter() - start, **vars(peaks.result()))

    # ---- rollback -------------------------------------------------------------------
    def _mutable_tensors(self) -> list[str]:
        """Graph tensors a training step can change: the trained ones and, with batch-statistics
        BatchNorm, the running statistics (the only frozen tensors a step writes)."""
        names = self._backend.parameter_names(trainable_only=True)
        if self.manifest.batch_statistics:
            names += [n for n in self._backend.parameter_names() if n.endswith(("running_mean", "running_var"))]
        return names

    def _rollback_source(self, scratch: Path) -> Path:
        """A checkpoint file holding the state at the call's start, written only when none exists."""
        if self._clean_checkpoint is not None and self._clean_checkpoint.is_file():
            return self._clean_checkpoint
        path = scratch / "call_start.ckpt"
        self._backend.save_checkpoint(path)
        return path

    def _roll_back(self, source: Path, call_start: tuple[int, int], failed_epoch: int, batches, step_lr,
                   X: np.ndarray, y: np.ndarray | None, micro: int, kept: EpochValues) -> None:
        """Restore the state at the start of this call's epoch ``failed_epoch`` (see :meth:`adapt`)."""
        self._backend.close()
        self._backend = self._open_backend(source)
        self._backend.open_training()
        self.step, self.epoch = call_start
        done = 0
        for _ in range(failed_epoch):
            for idx in batches(self.epoch):
                self._step(Rows(X, idx), Rows.of(y, idx), step_lr(done), micro)
                done += 1
            self.epoch += 1
        if self._clean_checkpoint is None and failed_epoch == 0 and source.name != "call_start.ckpt":
            self._clean_checkpoint = source
        differ = kept.differing(self._backend)
        if differ:
            log.warning("rollback: replaying this call's epochs did not reproduce %s bit for bit; their values "
                        "are restored from the kept copy, the optimizer state may differ slightly", differ)
            kept.restore(self._backend)

    # ---- safe label-free adaptation (edgeadapt.runtime.unlabeled) ----------------------
    def adapt_unlabeled(self, X: np.ndarray, settings=None):
        """Adapt on unlabeled windows ``X`` with the recommended safe label-free method
        (source-anchored statistics, prototype head, resets on collapse, a safety gate that
        returns to the source model); ``settings``: an :class:`~.unlabeled.UnlabeledSettings`.
        Returns an :class:`~.unlabeled.UnlabeledResult` with the gate's decision and evidence."""
        return adapt_unlabeled(self, X, settings)

    def adapt_stream(self, batches, settings=None):
        """:meth:`adapt_unlabeled` on a stream of unlabeled batches as they arrive, memory bounded
        (see :func:`~.unlabeled.adapt_stream`)."""
        return adapt_stream(self, batches, settings)

    # ---- label-free BatchNorm statistics ----------------------------------------------
    def update_bn_statistics(self, X: np.ndarray, y: np.ndarray | None = None, *, epochs: int = 1,
                             batch_size: int = 32, shuffle: bool = True, seed: int = 0,
                             progress: bool = True) -> AdaptResult:
        """Re-estimate BatchNorm running statistics on ``X``, forward only (label-free "bn-stats").

        Runs the training graph's forward in batch-statistics mode over the same batches
        :meth:`adapt` would (same shuffling), updating the running mean and variance after each
        batch exactly as a training step does, with no backward pass, no gradient buffers and no
        optimizer (parameters and optimizer state are untouched; the training session is not
        opened). Needs a bundle exported with ``batchnorm="batch"``; on a frozen-statistics
        bundle nothing changes. ``step`` counts the batches, as :meth:`adapt` does.

        Args:
            X: float32 windows.
            y: labels, only to report the loss of a labelled bundle (``None``: losses are NaN).
            epochs, batch_size, shuffle, seed, progress: as for :meth:`adapt`.

        Raises:
            NonFiniteLossError: a batch gave non-finite statistics; the statistics are rolled
                back to the start of the epoch.
            AdaptInterrupted: Ctrl-C, as for :meth:`adapt`.
            InputError: bad data or counts, as for :meth:`adapt`.
        """
        epochs, batch_size, seed = _check_counts(epochs, batch_size, seed)
        X = check_inputs(self.manifest, X)
        if y is not None or self.manifest.label is None:
            y = check_labels(self.manifest, y, X.shape[0])
        if not self.manifest.batch_statistics:
            log.info("the bundle normalises with frozen statistics; update_bn_statistics changes nothing")
        n = X.shape[0]
        per_epoch = math.ceil(n / batch_size)
        losses, start = [], time.perf_counter()
        with (_progress_bar(progress, total=per_epoch * epochs, desc="bn-stats", unit="batch") as bar,
              AdaptPeaks() as peaks, StopAtStepBoundary() as stop):
            X = suffix_inputs(self._prefix, X, batch_size)
            for e in range(epochs):
                stats = [n for n in self._backend.parameter_names() if n.endswith(("running_mean", "running_var"))]
                kept = EpochValues.take(self._backend, stats)
                start_step = self.step
                order = default_rng(seed + self.epoch).permutation(n) if shuffle else np.arange(n)
                total = 0.0
                for b in range(per_epoch):
                    if stop.requested:  # Ctrl-C: back to the end of the last completed epoch
                        kept.restore(self._backend)
                        self.step = start_step
                        raise AdaptInterrupted(self.step, self.epoch, e)
                    idx = order[b * batch_size:(b + 1) * batch_size]
                    with peaks.step():
                        loss, applied = self._backend.update_statistics(X[idx], None if y is None else y[idx])
                    # a loss is checked where statistics move and labels give one (a frozen-statistics
                    # bundle changes nothing, and the portable engine computes no loss for it)
                    loss_checked = self.manifest.batch_statistics and (y is not None or self.manifest.label is None)
                    if not applied or (loss_checked and not math.isfinite(loss)):
                        kept.restore(self._backend)
                        failed, self.step = self.step, start_step
                        raise NonFiniteLossError(failed, loss if not math.isfinite(loss) else float("nan"),
                                                 restored_step=start_step)
                    self._clean_checkpoint = None
                    self.step += 1
                    total += loss * len(idx)
                    bar.update(1)
                self.epoch += 1
                losses.append(total / n)
        return AdaptResult(epochs, per_epoch * epochs, tuple(losses), time.perf_counter() - start,
                           **vars(peaks.result()))

    # ---- inference ------------------------------------------------------------------
    def _dummy_labels(self, n: int) -> np.ndarray | None:
        spec = self.manifest.label
        if spec is None:
            return None
        shape = [n, *spec["shape"][1:]]
        return np.zeros(shape, dtype=np.dtype(spec["dtype"]))

    def predict(self, X: np.ndarray, batch_size: int = 256) -> np.ndarray:
        """Model outputs (logits) for ``X`` with the current parameters, eval mode, ``batch_size``
        windows per forward (:class:`InputError` unless a positive int)."""
        batch_size = check_int(batch_size, "batch_size")
        X = check_inputs(self.manifest, X)
        outs = [self._backend.forward(suffix_inputs(self._prefix, X[i:i + batch_size], batch_size),
                                      self._dummy_labels(len(X[i:i + batch_size])))[1]
                for i in range(0, len(X), batch_size)]
        return np.concatenate(outs, axis=0)

    def evaluate(self, X: np.ndarray, y: np.ndarray | None = None, batch_size: int = 256) -> EvalResult:
        """Mean loss and accuracy on ``X``/``y``: cross-entropy bundles need ``y``; a label-free
        (entropy) bundle's loss needs none, and class ids ``y`` given to it give the accuracy;
        ``batch_size`` windows per forward (:class:`InputError` unless a positive int)."""
        batch_size = check_int(batch_size, "batch_size")
        X = check_inputs(self.manifest, X)
        classes = None
        if self.manifest.label is None and y is not None:  # a label-free loss: labels for the accuracy only
            classes = check_class_ids(y, X.shape[0], self.manifest.output.shape[-1])
            y = None
        y = check_labels(self.manifest, y, X.shape[0])
        total_loss, outputs = 0.0, []
        for i in range(0, len(X), batch_size):
            xb = X[i:i + batch_size]
            yb = y[i:i + batch_size] if y is not None else None
            loss, out = self._backend.forward(suffix_inputs(self._prefix, xb, batch_size), yb)
            total_loss += loss * len(xb)
            outputs.append(out)
        logits = np.concatenate(outputs, axis=0)
        if classes is None and self.manifest.loss == "cross_entropy":
            classes = y
        acc = float((logits.argmax(axis=1) == classes).mean()) if classes is not None else None
        return EvalResult(total_loss / len(X), acc, len(X))

    def parameters(self, trainable_only: bool = False) -> dict[str, np.ndarray]:
        """Current values under the source model's parameter names, full shapes reassembled."""
        out = {}
        for e in self.manifest.parameters:
            if (trainable_only and not e.trainable_numel) or not e.onnx_names:
                continue  # not trained, or not in the graph at all (unused by the forward)
            frozen_in_prefix = {} if self._prefix is None or e.trainable_numel else self._prefix.initializers()
            if e.onnx_names.get("value") in frozen_in_prefix:
                out[e.name] = frozen_in_prefix[e.onnx_names["value"]].copy()
            elif e.is_split:
                names = e.onnx_names
                both = np.concatenate([self._backend.get_tensor(names["trained"]),
                                       self._backend.get_tensor(names["frozen"])])
                out[e.name] = both[self._backend.get_tensor(names["index"])]
            else:
                out[e.name] = self._backend.get_tensor(e.onnx_names["value"])
        return out

    # ---- persistence ----------------------------------------------------------------
    def _kept_members(self) -> set[str]:
        """Checksummed members a save keeps: all but the state file and the files of the
        backends this runner does not run (their state would be stale)."""
        dropped = {self.manifest.files[r] for r in dropped_roles(self.backend) | {self._state_role}
                   if r in self.manifest.files}
        return set(self.manifest.sha256) - dropped

    def _state_manifest(self, checkpoint_name: str, checkpoint_sha: str) -> Manifest:
        sha = {k: v for k, v in self.manifest.sha256.items() if k in self._kept_members()}
        sha[checkpoint_name] = checkpoint_sha
        files = {r: n for r, n in self.manifest.files.items() if r in kept_roles(self.manifest, self.backend)}
        return replace(self.manifest, files={**files, self._state_role: checkpoint_name}, sha256=sha,
                       state={"epoch": self.epoch, "step": self.step}, backends=(self.backend,),
                       portable=self.manifest.portable if self.backend == "portable" else None)

    def _write_checkpoint(self, directory: Path) -> tuple[str, str]:
        name = f"{self._state_role}-{self.step:06d}-{secrets.token_hex(3)}"
        name += Path(self.manifest.files[self._state_role]).suffix
        with atomic_path(directory / name) as tmp:
            self._backend.save_checkpoint(tmp)
        return name, sha256_file(directory / name)

    def _same_graphs(self, other: Path) -> bool:
        try:
            theirs = read_manifest(other, verify=False)
        except BundleError:
            return False
        mine = self.manifest
        roles = kept_roles(mine, self.backend) - {self._state_role}
        return all(r in theirs.files and r in mine.files
                   and theirs.sha256.get(theirs.files[r]) == mine.sha256.get(mine.files[r]) for r in roles)

    def check_save_target(self, out_dir: str | os.PathLike | None = None) -> Path:
        """The directory :meth:`save` would write (``out_dir``, default: the runner's bundle), checked
        now so that a caller can refuse it before any work.

        Raises:
            FileExistsError: ``out_dir`` exists and is not a bundle of the same graphs.
            NotADirectoryError: ``out_dir`` is new and a folder it would be made in is a file.
            PermissionError: the folder :meth:`save` would write in is not writable.
        """
        out = Path(out_dir) if out_dir is not None else self.bundle_dir
        if out.exists():
            if not out.is_dir():
                raise FileExistsError(f"{out} exists and is not a directory; choose a new directory")
            if not self._same_graphs(out):
                raise FileExistsError(
                    f"{out} exists and is not a bundle of the same model; choose a new directory or remove it"
                )
            _check_writable(out, out)  # updated in place
        else:
            _check_creatable(out)
        return out

    def save(self, out_dir: str | os.PathLike | None = None) -> Path:
        """Save parameters, optimizer state and progress as a bundle; resume with :meth:`load`.

        ``out_dir`` defaults to the bundle the runner was loaded from. A new directory is built
        aside and renamed into place. An existing bundle of the same graphs is updated in place:
        a new checkpoint file is written, then the manifest is switched to it atomically, then
        the old checkpoint is removed, so a crash leaves the previous checkpoint loadable.

        Saves into one bundle are serialised by a lock on its directory (concurrent savers take
        turns, each leaving a consistent bundle); two saves creating the same new directory race
        for the final rename: one wins, the other raises :class:`FileExistsError`. Whatever an
        interrupted save left behind is removed by the next save of the same target (loading
        never writes: it works on read-only bundles and never removes anything).

        Raises:
            FileExistsError: ``out_dir`` exists and is not a bundle of the same graphs.
            NonFiniteStateError: a trained value is non-finite or larger than loading accepts
                (left by a failed :meth:`train_step`); nothing is written.
        """
        if bad := first_out_of_range(self._backend.get_tensor, self._mutable_tensors(), MAX_ABS_VALUE):
            raise NonFiniteStateError(f"{bad[0]} holds {bad[1]:.3g} (loading accepts finite values up to "
                                      f"{MAX_ABS_VALUE:g}); refusing to save this state - load the bundle again")
        out = self.check_save_target(out_dir)
        if out.exists():
            with bundle_lock(out, exclusive=True):
                self.check_save_target(out)  # again under the lock: the target may have changed meanwhile
                name, sha = self._write_checkpoint(out)
                state = self._state_manifest(name, sha)
                write_manifest(out, state)
                # Only now is the old checkpoint unreferenced; also sweep orphans of interrupted saves.
                sweep_orphans(out, state)
        else:
            with staged_directory(out) as stage:
                # Every kept member (names were checked when the manifest was built).
                for member in self._kept_members():
                    shutil.copyfile(self.bundle_dir / member, stage / member)
                name, sha = self._write_checkpoint(stage)
                write_manifest(stage, self._state_manifest(name, sha))
        self.manifest = read_manifest(out, verify=False)
        self._clean_checkpoint = out / self.manifest.files[self._state_role]
        self.bundle_dir = out
        log.info("saved step %d to %s", self.step, out)
        return out

    def export_inference(self, path: str | os.PathLike) -> Path:
        """Write a plain ONNX model (input -> output) with the current parameters, atomically."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(path) as tmp:
            if self._prefix is None:
                self._backend.export_inference(tmp, [self.manifest.output.name])
            else:  # the adapted suffix behind the frozen prefix, as one model
                with tempfile.TemporaryDirectory(prefix="edgeadapt-export-") as scratch:
                    suffix = Path(scratch) / "suffix.onnx"
                    self._backend.export_inference(suffix, [self.manifest.output.name])
                    merge_inference(self._prefix.path, suffix, tmp)
        return path
