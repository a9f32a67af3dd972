"""Training backends: what the runner needs from an engine, and the ONNX Runtime training one.

The runner talks to :class:`TrainingBackend` only, so a second engine (portable step graphs
that stock ``onnxruntime`` runs as an ordinary session) can slot in without changing the bundle
format or the runner's public API. Backends speak in graph tensor names and numpy arrays.

A backend opens in two stages. Loading reads the parameters and opens an *inference* session on
the eval graph (predict/evaluate, and the device choice). The *training* session (training
graph, gradient buffers, optimizer and its state) opens on the first training step, so that a
memory figure taken over the loaded runner covers it (docs: "Measuring").
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Protocol

import numpy as np

from ..bundle import BundleError, Manifest
from .arrays import native_contiguous
from .device import open_on_device
from .head_features import HEAD_FEATURES_OUTPUT
from .ort_import import pybind_state as C  # torch-free import of onnxruntime's pybind layer

__all__ = ["TrainingBackend", "OrtTrainingBackend"]

log = logging.getLogger(__name__)


class TrainingBackend(Protocol):
    """One training session over one bundle's graphs and parameters."""

    device: str

    @property
    def training_open(self) -> bool:
        """Whether the training session (gradients, optimizer state) is open."""

    def open_training(self) -> None:
        """Open the training session now (the first :meth:`train_step` does it otherwise)."""

    def train_step(self, x: np.ndarray, y: np.ndarray | None) -> tuple[float, np.ndarray]:
        """Forward + backward on one batch: (loss, model output). Gradients are *added* to the
        kept ones until :meth:`apply_update` or :meth:`discard_gradients` (accumulation)."""

    def scale_gradients(self, factor: float) -> None:
        """Multiply the kept gradients by ``factor`` in place."""

    def apply_update(self, lr: float) -> None:
        """Apply the optimizer to the kept gradients with learning rate ``lr``, then clear them."""

    def discard_gradients(self) -> None:
        """Drop the kept gradients without updating."""

    def forward(self, x: np.ndarray, y: np.ndarray | None) -> tuple[float, np.ndarray]:
        """Eval-mode forward: (loss, model output)."""

    def forward_features(self, x: np.ndarray, y: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """Eval-mode forward: (the linear head's input, model output), from the eval graph's
        :data:`~.head_features.HEAD_FEATURES_OUTPUT` (bundles whose manifest has a ``head``)."""

    def update_statistics(self, x: np.ndarray, y: np.ndarray | None) -> tuple[float, bool]:
        """Forward-only pass in batch-statistics mode updating BatchNorm running statistics.

        Returns the loss (NaN when the loss needs labels and ``y`` is ``None``) and whether the
        statistics were finite and applied (non-finite ones are not written)."""

    def parameter_names(self, trainable_only: bool = False) -> list[str]:
        """Graph names of the parameters (initializers) in the checkpoint."""

    def get_tensor(self, name: str) -> np.ndarray:
        """Current value of a graph initializer (parameter) as a numpy copy."""

    def set_tensor(self, name: str, value: np.ndarray) -> None:
        """Overwrite a graph initializer's value in place (same shape and dtype)."""

    def get_gradient(self, name: str) -> np.ndarray:
        """The kept gradient of a trainable graph initializer, as a numpy copy."""

    def save_checkpoint(self, path: Path) -> None:
        """Write parameters and optimizer state to ``path``."""

    def export_inference(self, path: Path, output_names: list[str]) -> None:
        """Write a plain ONNX inference model with the current parameters."""

    def close(self) -> None:
        """Release the sessions (the object is unusable afterwards)."""


def _providers(kind: str) -> list[str]:
    return ["CUDAExecutionProvider", "CPUExecutionProvider"] if kind == "cuda" else ["CPUExecutionProvider"]


class OrtTrainingBackend:
    """The ONNX Runtime training API (``onnxruntime-training`` 1.19), driven through its pybind layer.

    The Python wrapper ``onnxruntime.training.api`` imports torch; the pybind classes it wraps do
    not, so the runner uses those directly and stays torch-free.

    Sessions: an inference session over ``eval_model.onnx`` opens at construction (on the chosen
    device) and serves :meth:`forward`, fed with the checkpoint's parameter buffers themselves
    (no copies). The training ``Module`` (built *without* an eval graph, which the inference
    session already covers) and the ``Optimizer`` open lazily in :meth:`open_training`.
    ``session_config`` entries of the manifest's ``session`` (e.g. ``disable_cse``) apply to
    both sessions.
    """

    def __init__(self, bundle_dir: Path, manifest: Manifest, device: str = "auto", threads: int | None = None,
                 checkpoint_path: Path | None = None):
        files = manifest.files
        self._state = C.load_checkpoint(os.fspath(checkpoint_path or bundle_dir / files["checkpoint"]))
        self._options = session_options(manifest.session, threads)
        self._has_labels = manifest.label is not None
        self._output_name = manifest.output.name
        self._train_path = bundle_dir / files["training_model"]
        self._eval_path = bundle_dir / files["eval_model"]
        self._optim_path = bundle_dir / files["optimizer_model"]
        self._module = self._optimizer = None
        self._stats = None  # (with_loss, StatisticsModel, session), built on first use
        self._eval, self.device = open_on_device(device, self._open_eval)
        self._eval_inputs = [i.name for i in self._eval.inputs_meta]
        self._eval_outputs = [o.name for o in self._eval.outputs_meta]
        if self._output_name not in self._eval_outputs:
            raise RuntimeError(f"internal: the eval graph has no output {self._output_name!r}")
        self._param_inputs = [n for n in self._eval_inputs if self._state.has_parameter(n)]
        self._data_inputs = [n for n in self._eval_inputs if n not in set(self._param_inputs)]

    # ---- sessions ---------------------------------------------------------------------
    def _ort_device(self, kind: str):
        return C.OrtDevice(C.OrtDevice.cuda() if kind == "cuda" else C.OrtDevice.cpu(),
                           C.OrtDevice.default_memory(), 0)

    def _open_eval(self, kind: str):
        if kind == "cuda" and "CUDAExecutionProvider" not in C.get_available_providers():
            raise RuntimeError("this ONNX Runtime build has no CUDA execution provider")
        session = C.InferenceSession(self._options, os.fspath(self._eval_path), True, False)
        providers = _providers(kind)
        session.initialize_session(providers, [{} for _ in providers], set())
        if session.get_providers()[0] != providers[0]:
            raise RuntimeError(f"{providers[0]} could not be initialised")
        return session

    @property
    def training_open(self) -> bool:
        return self._module is not None

    def open_training(self) -> None:
        if self._module is not None:
            return
        ort_device = self._ort_device(self.device)
        try:
            module = C.Module(os.fspath(self._train_path), self._state, None, ort_device, self._options)
            self._optimizer = C.Optimizer(os.fspath(self._optim_path), self._state, ort_device, self._options)
        except Exception as e:  # ORT's pybind types, or a bare RuntimeError from its C++ side
            if not (type(e).__module__.startswith("onnxruntime") or type(e) is RuntimeError):
                raise
            reason = (str(e).strip().splitlines() or [type(e).__name__])[-1][-300:]
            raise BundleError(f"{self._train_path} (with {self._optim_path.name}): ONNX Runtime could not build the "
                              f"training session ({reason}); "
                              "the bundle is damaged - re-export it or restore a copy") from None
        self._module = module
        outputs = module.output_names(True)
        self._train_output_index = outputs.index(self._output_name)
        log.debug("opened the training session on %s", self.device)

    def close(self) -> None:
        self._module = self._optimizer = self._eval = self._stats = None
        self._state = None

    # ---- steps --------------------------------------------------------------------------
    def _inputs(self, x: np.ndarray, y: np.ndarray | None) -> list[np.ndarray]:
        """The data inputs as ONNX Runtime reads them (see :mod:`.arrays`); the caller holds the
        returned list until the run that reads them has returned."""
        return [native_contiguous(a) for a in ([x, y] if self._has_labels and y is not None else [x])]

    def train_step(self, x: np.ndarray, y: np.ndarray | None) -> tuple[float, np.ndarray]:
        self.open_training()
        fetches = C.OrtValueVector()
        inputs = self._inputs(x, y)
        self._module.train_step(inputs, fetches)
        return float(fetches[0].numpy()), fetches[self._train_output_index].numpy()

    def scale_gradients(self, factor: float) -> None:
        if factor == 1.0:
            return
        for name in self.parameter_names(trainable_only=True):
            grad = self._state.get_parameter(name).grad
            grad.update_inplace(np.ascontiguousarray(grad.numpy() * np.float32(factor)))

    def apply_update(self, lr: float) -> None:
        self._optimizer.set_learning_rate(float(lr))
        self._optimizer.optimizer_step()
        self._module.lazy_reset_grad()

    def discard_gradients(self) -> None:
        if self._module is not None:
            self._module.lazy_reset_grad()

    def _run_eval(self, feeds: dict[str, np.ndarray], outputs: list[str]) -> list[np.ndarray]:
        """Run the eval graph; ``feeds`` must be native and C-contiguous and outlive the call
        (the OrtValues made from them point into their buffers)."""
        cpu = self._ort_device("cpu")
        values = {n: self._state.get_parameter(n).data for n in self._param_inputs}
        values.update({n: C.OrtValue.ortvalue_from_numpy(v, cpu) for n, v in feeds.items()})
        return [v.numpy() for v in self._eval.run_with_ort_values(values, outputs, C.RunOptions())]

    def forward(self, x: np.ndarray, y: np.ndarray | None) -> tuple[float, np.ndarray]:
        feeds = dict(zip(self._data_inputs, self._inputs(x, y)))  # held until the run returns
        loss, out = self._run_eval(feeds, [self._eval_outputs[0], self._output_name])
        return float(loss), out

    def forward_features(self, x: np.ndarray, y: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        feeds = dict(zip(self._data_inputs, self._inputs(x, y)))  # held until the run returns
        features, out = self._run_eval(feeds, [HEAD_FEATURES_OUTPUT, self._output_name])
        return features, out

    def update_statistics(self, x: np.ndarray, y: np.ndarray | None) -> tuple[float, bool]:
        with_loss = y is not None or not self._has_labels
        if self._stats is None or self._stats[0] != with_loss:
            from .bn_stats import statistics_model

            label = self._data_inputs[1] if self._has_labels else None
            model = statistics_model(self._train_path, label_name=label, with_loss=with_loss)
            session = None
            if model.model_bytes:
                session = C.InferenceSession(self._options, model.model_bytes, False, False)
                providers = _providers(self.device)
                session.initialize_session(providers, [{} for _ in providers], set())
            self._stats = (with_loss, model, session)
        _, model, session = self._stats
        if session is None:
            return float("nan"), True
        names = [i.name for i in session.inputs_meta]
        cpu = self._ort_device("cpu")
        feeds = {n: self._state.get_parameter(n).data for n in names if self._state.has_parameter(n)}
        data = self._inputs(x, y)  # held until the run returns: the OrtValues point into these buffers
        for n, v in zip(self._data_inputs, data):
            if n in names:
                feeds[n] = C.OrtValue.ortvalue_from_numpy(v, cpu)
        outputs = ([model.loss_output] if model.loss_output else []) + [o for o, _ in model.updates]
        values = list(session.run_with_ort_values(feeds, outputs, C.RunOptions()))
        loss = float(values[0].numpy()) if model.loss_output else float("nan")
        stats = values[1:] if model.loss_output else values
        if not all(np.isfinite(v.numpy()).all() for v in stats):
            return loss, False  # not applied: the caller reports the non-finite batch
        for (_, param), v in zip(model.updates, stats):
            self._state.get_parameter(param).data.update_inplace(v.numpy())
        return loss, True

    # ---- parameters ---------------------------------------------------------------------
    def parameter_names(self, trainable_only: bool = False) -> list[str]:
        names = list(self._state.parameter_names())
        return [n for n in names if self._state.get_parameter(n).requires_grad] if trainable_only else names

    def get_tensor(self, name: str) -> np.ndarray:
        return np.array(self._state.get_parameter(name).data.numpy(), copy=True)

    def set_tensor(self, name: str, value: np.ndarray) -> None:
        data = self._state.get_parameter(name).data
        value = np.ascontiguousarray(value, dtype=data.numpy().dtype)
        if tuple(value.shape) != tuple(data.shape()):
            raise ValueError(f"{name}: shape {list(value.shape)} does not match {list(data.shape())}")
        data.update_inplace(value)

    def get_gradient(self, name: str) -> np.ndarray:
        return np.array(self._state.get_parameter(name).grad.numpy(), copy=True)

    def save_checkpoint(self, path: Path) -> None:
        try:
            C.save_checkpoint(self._state, os.fspath(path), True)
        except Exception as e:  # ONNX Runtime's pybind types, or a RuntimeError naming its C++ source
            if not (type(e).__module__.startswith("onnxruntime") or isinstance(e, (RuntimeError, OSError))):
                raise
            reason = (str(e).strip().splitlines() or [type(e).__name__])[-1][:200]
            raise OSError(f"could not write a checkpoint in {Path(path).parent} ({reason}); the "
                          "disk may be full - free space and save again (the bundle keeps its previous checkpoint)"
                          ) from None

    def export_inference(self, path: Path, output_names: list[str]) -> None:
        from .inference_export import export_eval_graph

        export_eval_graph(self._eval_path, {n: self.get_tensor(n) for n in self._param_inputs}, output_names, path)


def session_options(session: dict, threads: int | None = None):
    """ONNX Runtime session options from a manifest's ``session`` settings.

    ``enable_mem_pattern`` (chosen at export by checking a training step against torch, see
    ``export.selfcheck``) and, when ``disable_cse`` is true (a training graph with recomputed
    segments, see ``export.recompute``), common subexpression elimination turned off so that
    the duplicated forward nodes are not merged back into the originals.
    """
    options = C.SessionOptions()
    options.enable_mem_pattern = bool(session.get("enable_mem_pattern", True))
    if session.get("disable_cse"):
        options.add_session_config_entry("optimization.disable_specified_optimizers",
                                         "CommonSubexpressionElimination")
    if threads:
        options.intra_op_num_threads = int(threads)
    return options
