"""The portable backend: a bundle's step graphs (standard ONNX ops) on plain ``onnxruntime`` sessions.

Stock onnxruntime has wheels where onnxruntime-training has none (Linux aarch64, Python 3.13), so
a bundle exported with portable graphs trains there. Nothing from ``onnxruntime.training`` is
imported: every graph is an ordinary inference session, and this module holds every tensor the
training step keeps itself, as numpy arrays:

* parameters (trained, frozen, running statistics) under their ONNX initializer names, the names
  the manifest's ``ParameterEntry.onnx_names`` use;
* optimizer state (AdamW ``exp_avg``/``exp_avg_sq`` per trained tensor) and the step count, from
  which the bias corrections are computed on the host in float64 (in float32 inside a graph they
  drift ~1e-3 from ``torch.optim.AdamW`` in ten steps);
* one gradient accumulator per trained tensor.

Graphs are fed through IO binding with ``OrtValue`` views of those arrays (no copies), and their
outputs are bound to preallocated arrays. A graph never reads and writes one buffer in the same
run: updated parameters, optimizer state and running statistics are written into a second
buffer of each tensor, which then becomes the current one (ping-pong). Every ``OrtValue`` is made
by ``onnxruntime.OrtValue.ortvalue_from_numpy``, which keeps a reference to its array, and every
``OrtValue`` bound for a run is held in a local list until that run has returned.

Each graph's inputs and outputs are known by *role* (``param:<name>``, ``data``, ``labels``,
``weights``, ``loss``, ``output``, ``grad:<name>``, ``stat:<name>``, ``exp_avg:<name>``, ...): the
manifest's ``portable.graphs`` lists them in graph order; generated graph names are never relied on.

Sessions open as the ONNX Runtime training backend's do: the eval graph at load (on the chosen
device), the training and optimizer graphs (and the gradient accumulators) on the first step,
the BatchNorm statistics graph on first use.
"""

from __future__ import annotations

import logging
import math
import os
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from ..atomic import atomic_path
from ..bundle import PORTABLE_GRAPH_ROLES, PORTABLE_STATS_ROLE, BundleError
from .arrays import native_contiguous
from .device import open_on_device
from .head_features import HEAD_FEATURES_ROLE
from .ort_import import import_onnxruntime

__all__ = ["PortableBackend", "STATE_ROLE", "check_opset_supported", "read_state",
           "MIN_ONNXRUNTIME_FOR_OPSET"]

log = logging.getLogger(__name__)

TRAIN, EVAL, STATS, OPTIMIZER = "portable_train", "portable_eval", PORTABLE_STATS_ROLE, "portable_optimizer"
#: The manifest file role of the portable state (parameters, optimizer state, step; ``.npz``).
STATE_ROLE = "portable_state"
#: The oldest onnxruntime release that implements each ONNX opset (onnxruntime's version table).
MIN_ONNXRUNTIME_FOR_OPSET = {17: (1, 13), 18: (1, 14), 19: (1, 15), 20: (1, 17), 21: (1, 18), 22: (1, 20)}
_STATE_KINDS = ("exp_avg", "exp_avg_sq")
_STEP_KEY = "step"
# Roles fed with host-computed optimizer scalars.
_ADAMW_SCALARS = ("decay", "step_size", "bias_correction2_sqrt")


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for p in version.split("+")[0].split(".")[:3]:
        digits = "".join(c for c in p if c.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def check_opset_supported(opset: int, installed: str) -> None:
    """Raise :class:`BundleError` (one line naming the version needed) when the onnxruntime
    release ``installed`` is too old to run graphs of ONNX ``opset``."""
    need = MIN_ONNXRUNTIME_FOR_OPSET.get(int(opset))
    newest = max(MIN_ONNXRUNTIME_FOR_OPSET)
    if need is None and opset < min(MIN_ONNXRUNTIME_FOR_OPSET):
        return
    if need is None:  # newer than this table: ask for at least the newest release it knows
        need = MIN_ONNXRUNTIME_FOR_OPSET[newest]
    if _version_tuple(installed) < need:
        want = ".".join(map(str, need))
        raise BundleError(f"this bundle's portable graphs use ONNX opset {opset}, which needs onnxruntime >= {want}; "
                          f"onnxruntime {installed} is installed: pip install -U \"onnxruntime>={want}\"")


def read_state(path: Path, limit_bytes: int | None = None) -> dict[str, np.ndarray]:
    """The arrays of a portable state file (``.npz``, no pickle), sizes checked before reading.

    Raises:
        BundleError: not a readable ``.npz``, larger than ``limit_bytes`` unpacked, or holding
            an object array.
    """
    try:
        with zipfile.ZipFile(path) as z:
            unpacked = sum(i.file_size for i in z.infolist())
        if limit_bytes is not None and unpacked > limit_bytes:
            raise BundleError(f"{path}: unpacks to {unpacked} bytes, more than this model's state needs "
                              f"({limit_bytes}); not read")
        with np.load(path, allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    except BundleError:
        raise
    except Exception as e:  # zipfile/numpy raise BadZipFile, ValueError (pickles), OSError, EOFError, ...
        raise BundleError(f"{path}: not a readable portable state (.npz without pickles): "
                          f"{type(e).__name__}: {str(e)[:200]}") from None


class _Graph:
    """One portable graph: its session and its inputs/outputs by role."""

    def __init__(self, session, role: str, spec: Mapping[str, Sequence[Sequence[str]]]):
        self.session, self.role = session, role
        self.inputs = [(str(r), str(n)) for r, n in spec["inputs"]]
        self.outputs = [(str(r), str(n)) for r, n in spec["outputs"]]
        got_in = [i.name for i in session.get_inputs()]
        got_out = [o.name for o in session.get_outputs()]
        if got_in != [n for _, n in self.inputs] or got_out != [n for _, n in self.outputs]:
            raise BundleError(f"{role}: the graph's inputs/outputs {got_in[:4]}.../{got_out[:4]}... are not the ones "
                              "the manifest's portable.graphs lists; the bundle was edited - re-export it")
        self.input_roles = [r for r, _ in self.inputs]
        self.output_roles = [r for r, _ in self.outputs]

    def run(self, ort, feeds: Mapping[str, object], outputs: Mapping[str, object]) -> None:
        """Run with the ``OrtValue``\\ s ``feeds`` (by role) bound as inputs and ``outputs`` (by
        role; preallocated ``OrtValue``\\ s) as outputs. The caller holds both mappings (and so
        every array behind them) until this returns."""
        binding = self.session.io_binding()
        for role, name in self.inputs:
            binding.bind_ortvalue_input(name, feeds[role])
        for role, name in self.outputs:
            if role in outputs:
                binding.bind_ortvalue_output(name, outputs[role])
            else:
                binding.bind_output(name, "cpu")
        self.session.run_with_iobinding(binding)
        binding.clear_binding_inputs()
        binding.clear_binding_outputs()


class _Tensor:
    """A tensor the backend holds: its current buffer and, for tensors a graph updates, a second
    buffer that updated values are written to before the two swap. Each buffer carries its
    ``OrtValue`` view, made once."""

    def __init__(self, ort, value: np.ndarray, updated: bool):
        self._ort = ort
        self.value = native_contiguous(value).copy() if not value.flags.writeable else native_contiguous(value)
        self.ort_value = ort.OrtValue.ortvalue_from_numpy(self.value)
        self.spare = self.spare_ort = None
        if updated:
            self.spare = np.empty_like(self.value)
            self.spare_ort = ort.OrtValue.ortvalue_from_numpy(self.spare)

    def swap(self) -> None:
        """The spare buffer (just written) becomes the current one."""
        self.value, self.spare = self.spare, self.value
        self.ort_value, self.spare_ort = self.spare_ort, self.ort_value


def _roles(graph: _Graph, kind: str, outputs: bool = False) -> list[str]:
    """Tensor names of ``graph``'s roles ``kind:<name>``, in graph order."""
    prefix = kind + ":"
    return [r[len(prefix):] for r in (graph.output_roles if outputs else graph.input_roles) if r.startswith(prefix)]


class PortableBackend:
    """:class:`~edgeadapt.runtime.backend.TrainingBackend` on a bundle's portable step graphs.

    Args:
        bundle_dir: the bundle.
        manifest: its manifest (``portable`` and the ``portable_*`` files).
        device: ``auto``, ``cuda`` or ``cpu`` (see :func:`~edgeadapt.runtime.device.open_on_device`).
            On CUDA the tensors stay in host memory and ONNX Runtime copies them per run.
        threads: intra-op threads; ``None`` lets ONNX Runtime decide.
        checkpoint_path: a portable state file to start from instead of the bundle's own.

    Raises:
        BundleError: the state file is unreadable or disagrees with the graphs, a graph's
            inputs or outputs are not the manifest's, or onnxruntime is too old for the opset.
    """

    def __init__(self, bundle_dir: Path, manifest, device: str = "auto", threads: int | None = None,
                 checkpoint_path: Path | None = None):
        self._ort = ort = import_onnxruntime()
        portable = manifest.portable
        check_opset_supported(int(portable["opset"]), ort.__version__)
        self._specs = portable["graphs"]
        self._paths = {role: Path(bundle_dir) / manifest.files[role] for role in PORTABLE_GRAPH_ROLES
                       if role in manifest.files}
        self._threads = threads
        # Weight prepacking copies every constant matrix operand (frozen weights; trained ones are
        # graph inputs, never prepacked) into a packed buffer per node reading it, which no cost
        # model term counts: an unrolled recurrent step graph (a GRU over 32 steps, 9.7k nodes)
        # held 40 MiB of them, 2.8 MiB without, for a 1.1k-parameter model. It speeds frozen
        # matrix products up (a transformer with its last layers frozen: ~1.5x per step), so it
        # stays on unless the bundle carries a memory budget.
        self._prepack = (manifest.plan or {}).get("budget_bytes") is None
        opt = manifest.optimizer
        self._adamw = opt["name"] == "adamw"
        self._betas = tuple(float(b) for b in opt.get("betas", (0.9, 0.999)))
        self._weight_decay = float(opt.get("weight_decay", 0.0))
        self._output_shape = tuple(manifest.output.shape)
        self._data_name = "features" if manifest.has_prefix else manifest.input.name
        state_path = Path(checkpoint_path) if checkpoint_path is not None else self._state_path(bundle_dir, manifest)
        self._eval, self.device = open_on_device(device, lambda kind: self._open(EVAL, kind))
        self._has_labels = "labels" in self._eval.input_roles
        self._n_features = _features_width(self._eval)
        self._load_state(state_path, read_state(state_path))
        self._train = self._optimizer = None
        self._stats: _Graph | None = None
        self._grads: dict[str, np.ndarray] = {}
        self._grad_values: dict[str, object] = {}
        self._grads_empty = True  # the accumulators hold nothing: the next train step writes into them
        self._scratch: dict[str, np.ndarray] = {}  # per-run gradients when accumulating (made on first need)

    @staticmethod
    def _state_path(bundle_dir: Path, manifest) -> Path:
        return Path(bundle_dir) / manifest.files[STATE_ROLE]

    # ---- sessions ---------------------------------------------------------------------
    def _session_options(self):
        options = self._ort.SessionOptions()
        # Measured with edgeadapt.measure (benchmarks/portable_vs_torch.py, cnn at 32 x 8 x 256,
        # 1 thread, onnxruntime 1.19.2): the CPU arena on lowers the whole adapt call's anonymous
        # peak (last layer 1.8 MiB vs 3.6 MiB without it, full 13.2 vs 14.4 MiB) at the same step
        # time; the memory pattern adds ~7 MiB (its one block per run) and stays off. The graph
        # optimization level (ALL, EXTENDED, BASIC, none) changed neither figure.
        options.enable_cpu_mem_arena = True
        options.enable_mem_pattern = False
        if not self._prepack:
            options.add_session_config_entry("session.disable_prepacking", "1")
        if self._threads:
            options.intra_op_num_threads = int(self._threads)
        return options

    def _open(self, role: str, kind: str) -> _Graph:
        providers = ["CUDAExecutionProvider", "CPUExecutionProvider"] if kind == "cuda" else ["CPUExecutionProvider"]
        if kind == "cuda" and "CUDAExecutionProvider" not in self._ort.get_available_providers():
            raise RuntimeError("this ONNX Runtime build has no CUDA execution provider")
        session = self._ort.InferenceSession(os.fspath(self._paths[role]), self._session_options(), providers=providers)
        if session.get_providers()[0] != providers[0]:
            raise RuntimeError(f"{providers[0]} could not be initialised")
        return _Graph(session, role, self._specs[role])

    def _open_graph(self, role: str) -> _Graph:
        if role not in self._paths:
            raise BundleError(f"the bundle has no {role} graph (its manifest lists none)")
        try:
            return self._open(role, self.device)
        except BundleError:
            raise
        except Exception as e:  # ORT's pybind types, or a bare RuntimeError from its C++ side
            if not (type(e).__module__.startswith("onnxruntime") or type(e) is RuntimeError):
                raise
            reason = (str(e).strip().splitlines() or [type(e).__name__])[-1][-300:]
            raise BundleError(f"{self._paths[role]}: ONNX Runtime could not open it ({reason}); the bundle is "
                              "damaged - re-export it or restore a copy") from None

    def _load_state(self, path: Path, state: dict[str, np.ndarray]) -> None:
        """Check ``state`` against the eval graph's parameter inputs and the train graph's role
        map, and hold it."""
        train_spec = self._specs[TRAIN]
        params = [r.split(":", 1)[1] for r, _ in train_spec["inputs"] if r.startswith("param:")]
        trained = [r.split(":", 1)[1] for r, _ in train_spec["outputs"] if r.startswith("grad:")]
        stats = [r.split(":", 1)[1] for r, _ in train_spec["outputs"] if r.startswith("stat:")]
        missing = [n for n in params if n not in state]
        if missing:
            raise BundleError(f"{path}: holds no tensor {missing[0]!r} that the portable graphs need; "
                              "the state is damaged")
        eval_meta = {i.name: i for i in self._eval.session.get_inputs()}
        eval_names = dict((r, n) for r, n in self._eval.inputs)
        for n in params:
            v = state[n]
            meta = eval_meta.get(eval_names.get("param:" + n))
            if v.dtype.kind not in "fi" or v.dtype.hasobject:
                raise BundleError(f"{path}: tensor {n!r} has dtype {v.dtype}; the state is damaged")
            if meta is not None and [d if isinstance(d, int) else None for d in meta.shape] != list(v.shape):
                raise BundleError(f"{path}: tensor {n!r} has shape {list(v.shape)}, the eval graph takes {meta.shape}; "
                                  "the state does not belong to these graphs")
        mutable = set(trained) | set(stats)
        self._tensors = {n: _Tensor(self._ort, state[n], n in mutable) for n in params}
        self._param_names = params
        self._trained_names = trained
        self._opt_state: dict[str, dict[str, _Tensor]] = {}
        if self._adamw:
            for kind in _STATE_KINDS:
                self._opt_state[kind] = {}
                for n in trained:
                    v = state.get(f"{kind}/{n}")
                    if v is None:
                        v = np.zeros_like(self._tensors[n].value)
                    elif v.shape != self._tensors[n].value.shape or v.dtype != self._tensors[n].value.dtype:
                        raise BundleError(f"{path}: {kind}/{n} has {v.dtype} {list(v.shape)}, the parameter "
                                          f"{self._tensors[n].value.dtype} {list(self._tensors[n].value.shape)}")
                    self._opt_state[kind][n] = _Tensor(self._ort, v, True)
        step = state.get(_STEP_KEY, np.int64(0))
        if step.shape != () or step.dtype.kind not in "iu" or int(step) < 0:
            raise BundleError(f"{path}: 'step' must be a non-negative integer scalar, "
                              f"got {step.dtype} {list(step.shape)}")
        self._opt_step = int(step)

    @property
    def training_open(self) -> bool:
        return self._train is not None

    def open_training(self) -> None:
        if self._train is not None:
            return
        train = self._open_graph(TRAIN)
        self._optimizer = self._open_graph(OPTIMIZER)
        self._grads = {n: np.zeros_like(self._tensors[n].value) for n in self._trained_names}
        self._grad_values = {n: self._ort.OrtValue.ortvalue_from_numpy(g) for n, g in self._grads.items()}
        self._grads_empty = True
        self._train = train
        log.debug("opened the portable training graphs on %s", self.device)

    def close(self) -> None:
        self._train = self._optimizer = self._eval = self._stats = None
        self._grad_values, self._grads, self._scratch = {}, {}, {}
        self._tensors, self._opt_state = {}, {}

    # ---- steps --------------------------------------------------------------------------
    def _data_feeds(self, graph: _Graph, x: np.ndarray, y: np.ndarray | None) -> dict[str, object]:
        """``data`` (and ``labels``) as ``OrtValue`` views of native C-contiguous arrays (copies
        only where ``x``/``y`` are not so); each ``OrtValue`` holds its array."""
        ov = self._ort.OrtValue.ortvalue_from_numpy
        feeds = {"data": ov(native_contiguous(x))}
        if "labels" in graph.input_roles:
            if y is None:
                raise ValueError("this bundle's loss needs labels")
            feeds["labels"] = ov(native_contiguous(y))
        return feeds

    def _param_feeds(self, graph: _Graph) -> dict[str, object]:
        return {r: self._tensors[r[6:]].ort_value for r in graph.input_roles if r.startswith("param:")}

    def _output_buffer(self, n: int) -> np.ndarray | None:
        shape = (n, *self._output_shape[1:])
        return None if any(d is None for d in shape) else np.empty(shape, dtype=np.float32)

    def _run_forward(self, graph: _Graph, x: np.ndarray, y: np.ndarray | None, extra: dict[str, object],
                     fetch: dict[str, object]) -> tuple[float, np.ndarray | None]:
        """Run a forward graph (train, eval, stats); returns the loss and the model output."""
        ov = self._ort.OrtValue.ortvalue_from_numpy
        feeds = {**self._param_feeds(graph), **self._data_feeds(graph, x, y), **extra}
        loss = np.zeros((), dtype=np.float32)
        out = self._output_buffer(len(x)) if "output" in graph.output_roles else None
        outputs = dict(fetch)
        if "loss" in graph.output_roles:
            outputs["loss"] = ov(loss)
        if out is not None:
            outputs["output"] = ov(out)
        graph.run(self._ort, feeds, outputs)  # feeds and outputs (and their arrays) held until here
        return (float(loss) if "loss" in graph.output_roles else math.nan), out

    def train_step(self, x: np.ndarray, y: np.ndarray | None) -> tuple[float, np.ndarray]:
        self.open_training()
        n = len(x)
        ov = self._ort.OrtValue.ortvalue_from_numpy
        weights = np.full((n,), 1.0 / n, dtype=np.float32)
        if self._grads_empty:  # the first micro-batch after an update writes the accumulators directly
            grads, grad_values = self._grads, self._grad_values
        else:
            if not self._scratch:
                self._scratch = {k: np.empty_like(g) for k, g in self._grads.items()}
            grads = self._scratch
            grad_values = {k: ov(g) for k, g in grads.items()}
        stats = _roles(self._train, "stat", outputs=True)
        fetch = {f"grad:{k}": v for k, v in grad_values.items()}
        fetch.update({f"stat:{k}": self._tensors[k].spare_ort for k in stats})
        loss, out = self._run_forward(self._train, x, y, {"weights": ov(weights)}, fetch)
        if grads is not self._grads:
            for k, g in grads.items():
                np.add(self._grads[k], g, out=self._grads[k])
        self._grads_empty = False
        if math.isfinite(loss):  # running statistics move with the step (not with a refused one)
            for k in stats:
                self._tensors[k].swap()
        return loss, out

    def scale_gradients(self, factor: float) -> None:
        if factor == 1.0:
            return
        f = np.float32(factor)
        for g in self._grads.values():
            np.multiply(g, f, out=g)

    def _optimizer_scalars(self, lr: float) -> dict[str, np.ndarray]:
        """The update's scalars for step ``t = self._opt_step + 1``, in float64 on the host."""
        if not self._adamw:
            return {"lr": np.array(lr, dtype=np.float32)}
        t = self._opt_step + 1
        beta1, beta2 = self._betas
        values = {"decay": 1.0 - lr * self._weight_decay, "step_size": lr / (1.0 - beta1 ** t),
                  "bias_correction2_sqrt": math.sqrt(1.0 - beta2 ** t)}
        with np.errstate(over="ignore"):  # a huge lr gives inf here: the step's loss then stops adapt
            return {k: np.array(v, dtype=np.float32) for k, v in values.items()}

    def apply_update(self, lr: float) -> None:
        self.open_training()
        ov = self._ort.OrtValue.ortvalue_from_numpy
        scalars = self._optimizer_scalars(float(lr))  # held until the run returns
        feeds: dict[str, object] = {k: ov(v) for k, v in scalars.items()}
        outputs: dict[str, object] = {}
        for n in _roles(self._optimizer, "param"):
            feeds[f"param:{n}"] = self._tensors[n].ort_value
            feeds[f"grad:{n}"] = self._grad_values[n]
            outputs[f"param:{n}"] = self._tensors[n].spare_ort
            for kind, held in self._opt_state.items():
                feeds[f"{kind}:{n}"] = held[n].ort_value
                outputs[f"{kind}:{n}"] = held[n].spare_ort
        self._optimizer.run(self._ort, feeds, outputs)
        for n in _roles(self._optimizer, "param"):
            self._tensors[n].swap()
            for held in self._opt_state.values():
                held[n].swap()
        self._opt_step += 1
        self.discard_gradients()

    def discard_gradients(self) -> None:
        for g in self._grads.values():
            g.fill(0)
        self._grads_empty = True

    def forward(self, x: np.ndarray, y: np.ndarray | None) -> tuple[float, np.ndarray]:
        if y is None and self._has_labels:
            y = self._zero_labels(len(x))
        return self._run_forward(self._eval, x, y, {}, {})

    def forward_features(self, x: np.ndarray, y: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        if HEAD_FEATURES_ROLE not in self._eval.output_roles:
            raise BundleError("the bundle's eval graph returns no head features; re-export the bundle")
        if y is None and self._has_labels:
            y = self._zero_labels(len(x))
        features = np.empty((len(x), self._n_features), dtype=np.float32)
        fetch = {HEAD_FEATURES_ROLE: self._ort.OrtValue.ortvalue_from_numpy(features)}
        _, out = self._run_forward(self._eval, x, y, {}, fetch)  # fetch (and features) held until it returns
        return features, out

    def _zero_labels(self, n: int) -> np.ndarray:
        meta = {i.name: i for i in self._eval.session.get_inputs()}[dict(self._eval.inputs)["labels"]]
        dtype = np.int64 if "int64" in meta.type else np.float32
        return np.zeros((n, *[d if isinstance(d, int) else 1 for d in meta.shape[1:]]), dtype=dtype)

    def update_statistics(self, x: np.ndarray, y: np.ndarray | None) -> tuple[float, bool]:
        if STATS not in self._paths:
            return math.nan, True  # frozen statistics: nothing to update
        if self._stats is None:
            self._stats = self._open_graph(STATS)
        graph = self._stats
        stats = _roles(graph, "stat", outputs=True)
        with_loss = y is not None or not self._has_labels
        if y is None and "labels" in graph.input_roles:
            y = self._zero_labels(len(x))
        fetch = {f"stat:{k}": self._tensors[k].spare_ort for k in stats}
        loss, _ = self._run_forward(graph, x, y, {}, fetch)
        if not all(np.isfinite(self._tensors[k].spare).all() for k in stats):
            return (loss if with_loss else math.nan), False  # not applied
        for k in stats:
            self._tensors[k].swap()
        return (loss if with_loss else math.nan), True

    # ---- parameters ---------------------------------------------------------------------
    def parameter_names(self, trainable_only: bool = False) -> list[str]:
        return list(self._trained_names if trainable_only else self._param_names)

    def get_tensor(self, name: str) -> np.ndarray:
        return self._tensors[name].value.copy()

    def set_tensor(self, name: str, value: np.ndarray) -> None:
        held = self._tensors[name].value
        value = np.asarray(value, dtype=held.dtype)
        if value.shape != held.shape:
            raise ValueError(f"{name}: shape {list(value.shape)} does not match {list(held.shape)}")
        np.copyto(held, value)

    def get_gradient(self, name: str) -> np.ndarray:
        if name not in self._trained_names:
            raise KeyError(f"{name} is not a trained tensor")
        if not self._grads:
            return np.zeros_like(self._tensors[name].value)
        return self._grads[name].copy()

    def state_arrays(self) -> dict[str, np.ndarray]:
        """Everything :meth:`save_checkpoint` writes, by its key in the state file (views, not copies)."""
        arrays = {n: self._tensors[n].value for n in self._param_names}
        for kind, held in self._opt_state.items():
            arrays.update({f"{kind}/{n}": t.value for n, t in held.items()})
        arrays[_STEP_KEY] = np.array(self._opt_step, dtype=np.int64)
        return arrays

    def save_checkpoint(self, path: Path) -> None:
        """Write ``portable_state`` (``.npz``, no pickle) to ``path`` atomically.

        Raises:
            ValueError: a parameter or optimizer state holds NaN or inf (nothing is written).
        """
        arrays = self.state_arrays()
        for k, v in arrays.items():
            if v.dtype.kind == "f" and not np.isfinite(v).all():
                raise ValueError(f"{k} holds NaN or infinite values; the state was not saved")
        with atomic_path(Path(path)) as tmp, open(tmp, "wb") as f:
            np.savez(f, **arrays)

    def export_inference(self, path: Path, output_names: list[str]) -> None:
        """Write the eval graph as a plain inference model: its ``data`` input renamed to the
        bundle's input (``features`` behind a prefix model), its ``output`` to ``output_names[0]``,
        the current parameters as initializers under their ONNX names (the names
        :meth:`parameter_names` gives, as in the onnxruntime-training backend's export), the loss
        and labels pruned away."""
        from .inference_export import export_eval_graph

        names = dict(self._eval.inputs)
        held = [n for n in self._param_names if "param:" + n in names]
        renames = {names["data"]: self._data_name, dict(self._eval.outputs)["output"]: output_names[0],
                   **{names["param:" + n]: n for n in held}}
        model = _renamed(self._paths[EVAL], renames)
        export_eval_graph(model, {n: self._tensors[n].value for n in held}, output_names, path)


def _features_width(graph: _Graph) -> int | None:
    """Features per window of the eval graph's ``head_features`` output (``None``: it has none)."""
    if HEAD_FEATURES_ROLE not in graph.output_roles:
        return None
    name = dict(graph.outputs)[HEAD_FEATURES_ROLE]
    shape = next(o.shape for o in graph.session.get_outputs() if o.name == name)
    if len(shape) != 2 or not isinstance(shape[1], int):
        raise BundleError(f"the eval graph's head features have shape {shape}, not (windows, features); "
                          "the bundle was edited - re-export it")
    return shape[1]


def _renamed(path: Path, renames: Mapping[str, str]):
    """The ONNX model at ``path`` with the tensors ``renames`` maps renamed everywhere."""
    import onnx

    model = onnx.load(os.fspath(path))
    g = model.graph
    taken = ({v.name for v in (*g.input, *g.output, *g.value_info)} | {t.name for t in g.initializer}
             | {o for n in g.node for o in n.output}) - set(renames)
    clash = [new for new in renames.values() if new in taken]
    if clash:
        raise ValueError(f"{path}: cannot name a tensor {clash[0]!r}, the graph already has one")
    for v in (*g.input, *g.output, *g.value_info):
        v.name = renames.get(v.name, v.name)
    for node in g.node:
        node.input[:] = [renames.get(i, i) for i in node.input]
        node.output[:] = [renames.get(o, o) for o in node.output]
    return model
