"""The frozen prefix of a bundle: run once per ``adapt`` call, its output cached as features.

A bundle whose plan cuts the model (``plan.cut >= 0`` with ``cache_features``) carries
``prefix_model.onnx``: a plain inference model ``input`` -> ``features`` holding every layer up to
the cut. Its training and eval models take ``features`` as their input. The runner therefore

* computes every window's features once per :meth:`Runner.adapt` call, in micro-batches, into
  one preallocated array (the *feature cache*, ``n_windows`` x the cut tensor), and trains the
  suffix on it: the prefix's activations are never alive during a training step;
* chains prefix -> suffix in :meth:`Runner.predict` / :meth:`Runner.evaluate`.

The prefix runs in an ONNX Runtime *inference* session of a model without training ops, so it
holds no gradient or optimizer buffers. Its memory arena and memory pattern are off: the
transient buffers of a micro-batch go back to the allocator instead of staying reserved by
the session while the suffix trains. Its graph gets ONNX Runtime's extended optimisations but not
the layout ones, which would re-lay 2-D convolutions out in padded SIMD blocks the memory plan
does not count.

Torch-free (numpy + onnxruntime; merging the two halves for :func:`merge_inference` uses the
``onnx`` package that onnxruntime-training installs).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from ..bundle import Manifest
from .arrays import native_contiguous
from .ort_import import import_onnxruntime

__all__ = ["PrefixModel", "open_prefix", "suffix_inputs", "merge_inference", "FEATURES_NAME"]

log = logging.getLogger(__name__)

FEATURES_NAME = "features"


def _batches(n: int, size: int) -> Iterator[slice]:
    for start in range(0, n, size):
        yield slice(start, min(n, start + size))


class PrefixModel:
    """An inference session over a bundle's ``prefix_model.onnx`` (``input`` -> ``features``).

    Args:
        path: the prefix model file.
        device: ``cpu`` or ``cuda`` (the CUDA provider is tried first, the CPU one is the fallback).
        threads: intra-op threads; ``None`` lets ONNX Runtime decide.
    """

    def __init__(self, path: str | os.PathLike, *, device: str = "cpu", threads: int | None = None):
        ort = import_onnxruntime()
        options = ort.SessionOptions()
        options.enable_cpu_mem_arena = False
        options.enable_mem_pattern = False
        # extended optimisations, without the layout ones: those lay 2-D convolutions out in
        # SIMD-blocked channels (NCHWc), padding few channels and keeping reordered copies the graph
        # IR does not count (a 6-channel Conv2d net's feature pass held 2.9x as much); 1-D
        # convolutions are unaffected
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
        if threads:
            options.intra_op_num_threads = int(threads)
        providers = ["CUDAExecutionProvider", "CPUExecutionProvider"] if device == "cuda" else ["CPUExecutionProvider"]
        self.path = Path(path)
        self._initializers: dict[str, np.ndarray] | None = None
        self._session = ort.InferenceSession(os.fspath(path), options, providers=providers)
        inputs, outputs = self._session.get_inputs(), self._session.get_outputs()
        if len(inputs) != 1 or [o.name for o in outputs] != [FEATURES_NAME]:
            raise ValueError(f"{path} is not a prefix model: it must map one input to one output named "
                             f"{FEATURES_NAME!r}; re-export the bundle")
        self.input_name = inputs[0].name
        self.features_shape = tuple(d if isinstance(d, int) else None for d in outputs[0].shape)

    @property
    def features_bytes_per_window(self) -> int | None:
        """Bytes of one window's features (float32), or ``None`` when a non-batch axis is symbolic."""
        rest = self.features_shape[1:]
        if any(d is None for d in rest):
            return None
        return 4 * int(np.prod(rest, dtype=np.int64))

    def initializers(self) -> dict[str, np.ndarray]:
        """The prefix's frozen tensors by graph name (read from the model file on first use)."""
        if self._initializers is None:
            import onnx
            from onnx import numpy_helper

            model = onnx.load(os.fspath(self.path))
            self._initializers = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
        return self._initializers

    def features(self, X: np.ndarray, micro_batch_windows: int = 32) -> np.ndarray:
        """The prefix's output for every window of ``X``, computed ``micro_batch_windows`` at a time.

        The result is one float32 array (the feature cache), filled in place micro-batch by
        micro-batch, so at most one micro-batch of prefix activations is alive at a time.
        """
        if micro_batch_windows < 1:
            raise ValueError(f"micro_batch_windows must be >= 1, got {micro_batch_windows}")
        out: np.ndarray | None = None
        for s in _batches(len(X), int(micro_batch_windows)):
            part = native_contiguous(X[s])  # held until the run returns
            (f,) = self._session.run([FEATURES_NAME], {self.input_name: part})
            if out is None:
                out = np.empty((len(X), *f.shape[1:]), dtype=f.dtype)
            out[s] = f
        if out is None:
            raise ValueError("X is empty; pass at least one window")
        return out


def open_prefix(bundle_dir: str | os.PathLike, manifest: Manifest, *, device: str = "cpu",
                threads: int | None = None) -> PrefixModel | None:
    """The bundle's :class:`PrefixModel`, or ``None`` for a bundle without a prefix model."""
    name = manifest.files.get("prefix_model")
    if name is None:
        return None
    prefix = PrefixModel(Path(bundle_dir) / name, device=device, threads=threads)
    log.debug("opened prefix model %s (features %s)", name, prefix.features_shape)
    return prefix


def suffix_inputs(prefix: PrefixModel | None, X: np.ndarray, micro_batch_windows: int = 32) -> np.ndarray:
    """What the bundle's training / eval graphs take for the windows ``X``: ``X`` itself without
    a prefix model, else the prefix's features of ``X``."""
    return X if prefix is None else prefix.features(X, micro_batch_windows)


def merge_inference(prefix_path: str | os.PathLike, suffix_path: str | os.PathLike,
                    out_path: str | os.PathLike) -> None:
    """Write one plain inference model (``input`` -> output) from the prefix model and an
    inference model of the suffix (``features`` -> output), e.g. the adapted one that
    ``export_model_for_inferencing`` wrote.

    Raises:
        ImportError: the ``onnx`` package is missing (onnxruntime-training installs it).
    """
    try:
        import onnx
        from onnx import compose
    except ImportError as e:  # pragma: no cover - onnxruntime-training depends on onnx
        raise ImportError("merging the prefix and the adapted model needs the onnx package: pip install onnx") from e
    prefix, suffix = onnx.load(os.fspath(prefix_path)), onnx.load(os.fspath(suffix_path))
    opsets = [{o.domain: o.version for o in m.opset_import}.get("", 1) for m in (prefix, suffix)]
    if opsets[0] != opsets[1]:  # e.g. a portable suffix (opset 18) behind a prefix exported at 17
        from onnx import version_converter

        if opsets[0] < opsets[1]:
            prefix = version_converter.convert_version(prefix, opsets[1])
        else:
            suffix = version_converter.convert_version(suffix, opsets[0])
    if prefix.ir_version != suffix.ir_version:
        prefix.ir_version = suffix.ir_version = min(prefix.ir_version, suffix.ir_version)
    merged = compose.merge_models(prefix, suffix, io_map=[(FEATURES_NAME, FEATURES_NAME)])
    onnx.checker.check_model(merged)
    onnx.save(merged, os.fspath(out_path))
