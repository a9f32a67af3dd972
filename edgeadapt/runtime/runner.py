"""``Runner``: load a bundle, adapt it on new data, evaluate, predict, save, resume, export.

Torch-free: numpy + onnxruntime only. A typical session::

    runner = Runner.load("bundle/", device="auto")
    runner.adapt(X_new, y_new, epochs=5, batch_size=32)
    runner.evaluate(X_eval, y_eval)
    runner.save("adapted/")             # a bundle again: resume with Runner.load("adapted/")
    runner.export_inference("model.onnx")
"""

from __future__ import annotations

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
from tqdm.auto import tqdm

from ..atomic import atomic_path, staged_directory, sweep_stale_stages
from ..bundle import BundleError, Manifest, bundle_lock, read_manifest, sha256_file, sweep_orphans, write_manifest
from ..onnx_guard import check_bundle_models
from .backend import OrtTrainingBackend, TrainingBackend
from .errors import NonFiniteLossError
from .validate import check_inputs, check_labels, check_learning_rate

__all__ = ["Runner", "AdaptResult", "EvalResult", "SCHEDULES"]

log = logging.getLogger(__name__)

SCHEDULES = ("constant", "cosine")


@dataclass(frozen=True)
class AdaptResult:
    """What one :meth:`Runner.adapt` call did."""

    epochs: int
    steps: int
    epoch_losses: tuple[float, ...]
    time_s: float


@dataclass(frozen=True)
class EvalResult:
    """Mean loss over the data and, for classification bundles, accuracy."""

    loss: float
    accuracy: float | None
    n_windows: int


class Runner:
    """On-device adaptation of one bundle. Create it with :meth:`Runner.load`."""

    def __init__(self, bundle_dir: Path, manifest: Manifest,
                 open_backend: Callable[[Path | None], TrainingBackend]):
        """Prefer :meth:`load`. ``open_backend(checkpoint_path)`` opens a session on the
        bundle's graphs with the given checkpoint (``None``: the bundle's own)."""
        self.bundle_dir = Path(bundle_dir)
        self.manifest = manifest
        self._open_backend = open_backend
        self._backend = open_backend(None)
        self.step = int(manifest.state.get("step", 0))
        self.epoch = int(manifest.state.get("epoch", 0))

    @classmethod
    def load(cls, bundle_dir: str | os.PathLike, *, device: str = "auto", threads: int | None = None) -> Runner:
        """Verify a bundle's manifest and checksums, then open a training session on ``device``.

        Args:
            bundle_dir: an exported or adapted bundle directory.
            device: ``auto`` (CUDA if it works, else CPU with a warning), ``cuda`` or ``cpu``.
            threads: intra-op threads; ``None`` lets ONNX Runtime decide.

        Raises:
            BundleError: not a bundle, malformed manifest, missing, oversized or damaged file,
                checksum mismatch, a path outside the bundle, models that disagree with the
                manifest or use ops the exporter never writes (see ``docs/bundle-trust.md``).
            DeviceUnavailableError: ``device="cuda"`` and CUDA cannot run the session.
        """
        bundle_dir = Path(bundle_dir)
        if not bundle_dir.is_dir():
            sweep_stale_stages(bundle_dir)  # an interrupted save into a new folder leaves only these
            raise BundleError(f"{bundle_dir} is not an edgeadapt bundle: no such directory")
        chosen: list[str] = []

        def open_backend(checkpoint: Path | None) -> TrainingBackend:
            # Re-opening (rollback) reuses the device picked the first time: no second fallback warning.
            backend = OrtTrainingBackend(bundle_dir, manifest, device=chosen[0] if chosen else device,
                                         threads=threads, checkpoint_path=checkpoint)
            chosen[:] = [backend.device]
            return backend

        # Shared lock: a concurrent in-place save cannot remove the checkpoint being read.
        with bundle_lock(bundle_dir, exclusive=False):
            manifest = read_manifest(bundle_dir, verify=True)
            check_bundle_models(bundle_dir, manifest)
            try:
                runner = cls(bundle_dir, manifest, open_backend)
            except Exception as e:
                if not type(e).__module__.startswith("onnxruntime"):
                    raise
                reason = (str(e).strip().splitlines() or [type(e).__name__])[-1][:300]
                raise BundleError(
                    f"{bundle_dir}: ONNX Runtime could not open the models and checkpoint "
                    f"{manifest.files['checkpoint']} ({reason}); the bundle is damaged - re-export it or restore a copy"
                ) from None
        with bundle_lock(bundle_dir, exclusive=True, blocking=False) as free:
            if free and (removed := sweep_orphans(bundle_dir, manifest)):
                log.info("%s: removed %s left by an interrupted save", bundle_dir, removed)
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
    def train_step(self, x: np.ndarray, y: np.ndarray | None = None, lr: float | None = None) -> float:
        """One forward/backward/update on a batch; returns the loss before the update.

        Raises:
            NonFiniteLossError: the loss is NaN/inf; the update is not applied.
        """
        step_lr = check_learning_rate(self.learning_rate if lr is None else lr)
        loss, _ = self._backend.train_step(x, y)
        if not math.isfinite(loss):
            self._backend.discard_gradients()
            raise NonFiniteLossError(self.step, loss)
        self._backend.apply_update(step_lr)
        self.step += 1
        return loss

    def adapt(
        self, X: np.ndarray, y: np.ndarray | None = None, *, epochs: int = 1, batch_size: int = 32,
        lr: float | None = None, schedule: str = "constant", shuffle: bool = True, seed: int = 0,
        progress: bool = True,
    ) -> AdaptResult:
        """Adapt on ``X`` (and ``y`` unless the loss is label-free) for ``epochs`` passes.

        Data are validated against the manifest before the first step. A non-finite loss stops
        with :class:`NonFiniteLossError` after rolling parameters and optimizer state back to the
        start of the failing epoch (a checkpoint kept in a temporary file for that purpose).

        Args:
            X: float32 windows, shape as exported (batch axis first).
            y: labels as the bundle's loss needs them, or ``None`` for a label-free loss.
            epochs: passes over the data.
            batch_size: windows per step; the last batch may be smaller.
            lr: peak learning rate; default: the one exported with the bundle.
            schedule: ``constant`` or ``cosine`` decay to zero over this call's steps.
            shuffle: reshuffle each epoch (seeded by ``seed`` and the epoch index).
            progress: show a progress bar.
        """
        check_inputs(self.manifest, X)
        check_labels(self.manifest, y, X.shape[0])
        if epochs < 1 or batch_size < 1:
            raise ValueError(f"epochs and batch_size must be >= 1, got {epochs} and {batch_size}")
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
        peak_lr = check_learning_rate(self.learning_rate if lr is None else lr)
        n = X.shape[0]
        per_epoch = math.ceil(n / batch_size)
        total = per_epoch * epochs
        losses = []
        start = time.perf_counter()
        done = 0
        with (tqdm(total=total, desc="adapt", unit="step", disable=not progress, leave=False) as bar,
              tempfile.TemporaryDirectory(prefix="edgeadapt-rollback-") as scratch):
            snapshot = Path(scratch) / "epoch_start.ckpt"
            for e in range(epochs):
                self._backend.save_checkpoint(snapshot)
                start_step, start_epoch = self.step, self.epoch
                order = np.random.default_rng(seed + self.epoch).permutation(n) if shuffle else np.arange(n)
                epoch_loss = 0.0
                for b in range(per_epoch):
                    idx = order[b * batch_size:(b + 1) * batch_size]
                    step_lr = peak_lr if schedule == "constant" else 0.5 * peak_lr * (1 + math.cos(math.pi * done / total))
                    try:
                        loss = self.train_step(X[idx], None if y is None else y[idx], step_lr)
                    except NonFiniteLossError as err:
                        self._backend = self._open_backend(snapshot)
                        self.step, self.epoch = start_step, start_epoch
                        raise NonFiniteLossError(err.step, err.loss, restored_step=start_step) from None
                    epoch_loss += loss * len(idx)
                    done += 1
                    bar.update(1)
                    bar.set_postfix(epoch=e + 1, loss=f"{loss:.4f}")
                self.epoch += 1
                losses.append(epoch_loss / n)
                log.info("epoch %d: mean loss %.4f", self.epoch, losses[-1])
        return AdaptResult(epochs, done, tuple(losses), time.perf_counter() - start)

    # ---- inference ------------------------------------------------------------------
    def _dummy_labels(self, n: int) -> np.ndarray | None:
        spec = self.manifest.label
        if spec is None:
            return None
        shape = [n, *spec["shape"][1:]]
        return np.zeros(shape, dtype=np.dtype(spec["dtype"]))

    def predict(self, X: np.ndarray, batch_size: int = 256) -> np.ndarray:
        """Model outputs (logits) for ``X`` with the current parameters, eval mode."""
        check_inputs(self.manifest, X)
        outs = [self._backend.forward(X[i:i + batch_size], self._dummy_labels(len(X[i:i + batch_size])))[1]
                for i in range(0, len(X), batch_size)]
        return np.concatenate(outs, axis=0)

    def evaluate(self, X: np.ndarray, y: np.ndarray | None = None, batch_size: int = 256) -> EvalResult:
        """Mean loss and (for cross-entropy bundles) accuracy on ``X``/``y``."""
        check_inputs(self.manifest, X)
        check_labels(self.manifest, y, X.shape[0])
        total_loss, outputs = 0.0, []
        for i in range(0, len(X), batch_size):
            xb = X[i:i + batch_size]
            yb = y[i:i + batch_size] if y is not None else None
            loss, out = self._backend.forward(xb, yb)
            total_loss += loss * len(xb)
            outputs.append(out)
        logits = np.concatenate(outputs, axis=0)
        acc = float((logits.argmax(axis=1) == y).mean()) if self.manifest.loss == "cross_entropy" else None
        return EvalResult(total_loss / len(X), acc, len(X))

    def parameters(self, trainable_only: bool = False) -> dict[str, np.ndarray]:
        """Current values under the source model's parameter names, full shapes reassembled."""
        out = {}
        for e in self.manifest.parameters:
            if (trainable_only and not e.trainable_numel) or not e.onnx_names:
                continue  # not trained, or not in the graph at all (unused by the forward)
            if e.is_split:
                names = e.onnx_names
                both = np.concatenate([self._backend.get_tensor(names["trained"]), self._backend.get_tensor(names["frozen"])])
                out[e.name] = both[self._backend.get_tensor(names["index"])]
            else:
                out[e.name] = self._backend.get_tensor(e.onnx_names["value"])
        return out

    # ---- persistence ----------------------------------------------------------------
    def _state_manifest(self, checkpoint_name: str, checkpoint_sha: str) -> Manifest:
        sha = {k: v for k, v in self.manifest.sha256.items() if k != self.manifest.files["checkpoint"]}
        sha[checkpoint_name] = checkpoint_sha
        return replace(self.manifest, files={**self.manifest.files, "checkpoint": checkpoint_name},
                       sha256=sha, state={"epoch": self.epoch, "step": self.step})

    def _write_checkpoint(self, directory: Path) -> tuple[str, str]:
        name = f"checkpoint-{self.step:06d}-{secrets.token_hex(3)}"
        with atomic_path(directory / name) as tmp:
            self._backend.save_checkpoint(tmp)
        return name, sha256_file(directory / name)

    def _same_graphs(self, other: Path) -> bool:
        try:
            theirs = read_manifest(other, verify=False)
        except BundleError:
            return False
        mine = self.manifest
        roles = (set(mine.files) | set(theirs.files)) - {"checkpoint"}
        return all(r in theirs.files and r in mine.files
                   and theirs.sha256.get(theirs.files[r]) == mine.sha256.get(mine.files[r]) for r in roles)

    def save(self, out_dir: str | os.PathLike | None = None) -> Path:
        """Save parameters, optimizer state and progress as a bundle; resume with :meth:`load`.

        ``out_dir`` defaults to the bundle the runner was loaded from. A new directory is built
        aside and renamed into place. An existing bundle of the same graphs is updated in place:
        a new checkpoint file is written, then the manifest is switched to it atomically, then
        the old checkpoint is removed, so a crash leaves the previous checkpoint loadable.

        Saves into one bundle are serialised by a lock on its directory (concurrent savers take
        turns, each leaving a consistent bundle); two saves creating the same new directory race
        for the final rename: one wins, the other raises :class:`FileExistsError`. Whatever an
        interrupted save left behind is removed by the next save or load.

        Raises:
            FileExistsError: ``out_dir`` exists and is not a bundle of the same graphs.
        """
        out = Path(out_dir) if out_dir is not None else self.bundle_dir
        if out.exists():
            if not out.is_dir():
                raise FileExistsError(f"{out} exists and is not a directory; choose a new directory")
            with bundle_lock(out, exclusive=True):
                if not self._same_graphs(out):
                    raise FileExistsError(
                        f"{out} exists and is not a bundle of the same model; choose a new directory or remove it"
                    )
                name, sha = self._write_checkpoint(out)
                state = self._state_manifest(name, sha)
                write_manifest(out, state)
                # Only now is the old checkpoint unreferenced; also sweep orphans of interrupted saves.
                sweep_orphans(out, state)
        else:
            with staged_directory(out) as stage:
                # Every checksummed member but the checkpoint (names were checked when the manifest was built).
                for member in self.manifest.sha256:
                    if member != self.manifest.files["checkpoint"]:
                        shutil.copyfile(self.bundle_dir / member, stage / member)
                name, sha = self._write_checkpoint(stage)
                write_manifest(stage, self._state_manifest(name, sha))
        self.manifest = read_manifest(out, verify=False)
        self.bundle_dir = out
        log.info("saved step %d to %s", self.step, out)
        return out

    def export_inference(self, path: str | os.PathLike) -> Path:
        """Write a plain ONNX model (input -> output) with the current parameters, atomically."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(path) as tmp:
            self._backend.export_inference(tmp, [self.manifest.output.name])
        return path
