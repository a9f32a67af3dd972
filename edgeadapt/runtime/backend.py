"""Training backends: what the runner needs from an engine, and the ONNX Runtime training one.

The runner talks to :class:`TrainingBackend` only, so a second engine (portable step graphs
that stock ``onnxruntime`` runs as an ordinary session) can slot in without changing the bundle
format or the runner's public API. Backends speak in graph tensor names and numpy arrays.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol

import numpy as np

from ..bundle import Manifest
from .device import open_on_device
from .ort_import import pybind_state as C  # torch-free import of onnxruntime's pybind layer

__all__ = ["TrainingBackend", "OrtTrainingBackend"]



class TrainingBackend(Protocol):
    """One training session over one bundle's graphs and parameters."""

    device: str

    def train_step(self, x: np.ndarray, y: np.ndarray | None) -> tuple[float, np.ndarray]:
        """Forward + backward on one batch: (loss, model output); gradients are kept for
        :meth:`apply_update`."""

    def apply_update(self, lr: float) -> None:
        """Apply the optimizer to the kept gradients with learning rate ``lr``, then clear them."""

    def discard_gradients(self) -> None:
        """Drop the kept gradients without updating."""

    def forward(self, x: np.ndarray, y: np.ndarray | None) -> tuple[float, np.ndarray]:
        """Eval-mode forward: (loss, model output)."""

    def get_tensor(self, name: str) -> np.ndarray:
        """Current value of a graph initializer (parameter) as a numpy copy."""

    def get_gradient(self, name: str) -> np.ndarray:
        """The kept gradient of a trainable graph initializer, as a numpy copy."""

    def save_checkpoint(self, path: Path) -> None:
        """Write parameters and optimizer state to ``path``."""

    def export_inference(self, path: Path, output_names: list[str]) -> None:
        """Write a plain ONNX inference model with the current parameters."""


class OrtTrainingBackend:
    """The ONNX Runtime training API (``onnxruntime-training`` 1.19), driven through its pybind layer.

    The Python wrapper ``onnxruntime.training.api`` imports torch; the pybind classes it wraps do
    not, so the runner uses those directly and stays torch-free.
    """

    def __init__(self, bundle_dir: Path, manifest: Manifest, device: str = "auto", threads: int | None = None,
                 checkpoint_path: Path | None = None):
        files = manifest.files
        self._state = C.load_checkpoint(os.fspath(checkpoint_path or bundle_dir / files["checkpoint"]))
        self._options = C.SessionOptions()
        # Chosen at export by checking a training step against torch (see export.selfcheck).
        self._options.enable_mem_pattern = bool(manifest.session["enable_mem_pattern"])
        if threads:
            self._options.intra_op_num_threads = int(threads)
        self._has_labels = manifest.label is not None
        train_path, eval_path = bundle_dir / files["training_model"], bundle_dir / files["eval_model"]
        optim_path = bundle_dir / files["optimizer_model"]

        def create(kind: str):
            dev_type = C.OrtDevice.cuda() if kind == "cuda" else C.OrtDevice.cpu()
            ort_device = C.OrtDevice(dev_type, C.OrtDevice.default_memory(), 0)
            module = C.Module(os.fspath(train_path), self._state, os.fspath(eval_path), ort_device, self._options)
            optimizer = C.Optimizer(os.fspath(optim_path), self._state, ort_device, self._options)
            return module, optimizer

        (self._module, self._optimizer), self.device = open_on_device(device, create)
        self._output_index = self._module.output_names(False).index(manifest.output.name)
        if self._module.output_names(True).index(manifest.output.name) != self._output_index:
            raise RuntimeError("internal: training and eval graphs order their outputs differently")

    def _inputs(self, x: np.ndarray, y: np.ndarray | None) -> list[np.ndarray]:
        return [x, y] if self._has_labels else [x]

    def train_step(self, x: np.ndarray, y: np.ndarray | None) -> tuple[float, np.ndarray]:
        fetches = C.OrtValueVector()
        self._module.train_step(self._inputs(x, y), fetches)
        return float(fetches[0].numpy()), fetches[self._output_index].numpy()

    def apply_update(self, lr: float) -> None:
        self._optimizer.set_learning_rate(float(lr))
        self._optimizer.optimizer_step()
        self._module.lazy_reset_grad()

    def discard_gradients(self) -> None:
        self._module.lazy_reset_grad()

    def forward(self, x: np.ndarray, y: np.ndarray | None) -> tuple[float, np.ndarray]:
        fetches = C.OrtValueVector()
        self._module.eval_step(self._inputs(x, y), fetches)
        return float(fetches[0].numpy()), fetches[self._output_index].numpy()

    def get_tensor(self, name: str) -> np.ndarray:
        return np.array(self._state.get_parameter(name).data.numpy(), copy=True)

    def get_gradient(self, name: str) -> np.ndarray:
        return np.array(self._state.get_parameter(name).grad.numpy(), copy=True)

    def save_checkpoint(self, path: Path) -> None:
        C.save_checkpoint(self._state, os.fspath(path), True)

    def export_inference(self, path: Path, output_names: list[str]) -> None:
        self._module.export_model_for_inferencing(os.fspath(path), output_names)
