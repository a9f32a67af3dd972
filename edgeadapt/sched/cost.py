"""The cost model and :func:`predict`: the peak bytes of a whole device ``adapt`` call.

The model (docs/cost_model.md has the derivation and the calibration):

* **session** -- opening the training session: a fixed overhead, a fixed amount per op that
  needs a gradient and per op of the training graph, the whole-weight copies of channel-split
  parameters, and per trained byte its gradient buffer and optimizer state (AdamW: 2
  moments; SGD: none);
* **features** -- with ``cache_features``: the frozen prefix runs as inference over
  micro-batches while the cache of ``n_windows x`` (output bytes of the cut op) fills;
* **rollback** -- a copy of the trained values (and, if the executor keeps it, their optimizer
  state) taken at each epoch's start;
* **forward** / **backward** -- one micro-batch of the suffix: saved activations that are kept,
  recomputed segments when their backward runs, and the op's transient tensors;
* **optimizer** -- the update, with an optional workspace per trained byte.

Each phase's total includes everything still alive from the phases before it (session buffers,
feature cache, rollback copy). Activations are per window in the IR and scale with the
micro-batch; an op's saved tensors are counted from the first op that needs a gradient on.

Activation accounting, shared with :mod:`.remat` and re-derived by :mod:`.verify`:

* a *candidate* is an op that needs a gradient and saves bytes for its backward; candidate
  ``i`` owns the ops after the previous candidate up to ``i`` (its *chunk*); the ops after the
  last candidate are the *tail*;
* forward at op ``j``: kept saved bytes of the candidates before ``j``'s chunk, plus the op's
  live tensors (tensors produced and not yet consumed for the last time, its output and its
  workspace);
* backward at op ``j`` (needing a gradient): kept saved bytes of candidates before ``j``'s chunk,
  plus its own candidate's saved bytes (if kept) or the recomputed run of candidates from the
  run's start up to it, plus its output gradient, its inputs' gradients and its workspace.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields
from importlib import resources
from typing import Any

from .ir import Graph
from .plan import Peak, Plan
from .resolve import trained_bytes

__all__ = ["CostModel", "predict", "PHASES", "ENGINES", "CONSTANTS_FILES", "needs_grad", "live_bytes",
           "activation_arrays", "ActivationArrays", "clean_cut", "channel_weight_bytes", "batch_norm_ops",
           "param_copy_bytes"]

# The graph IR's op kind of a BatchNorm normalising with batch statistics.
BATCH_NORM_KIND = "BatchNormalization"
PHASES = ("session", "features", "rollback", "forward", "backward", "optimizer")
# The shipped constants file of each training engine (runtime.engines), in this package, written by
# benchmarks/calibrate_cost.py and benchmarks/calibrate_batch_statistics.py.
CONSTANTS_FILES = {"ort-training": "cost_model.json", "portable": "cost_model_portable.json"}
ENGINES = tuple(CONSTANTS_FILES)


@dataclass(frozen=True)
class CostModel:
    """Constants of the device cost model (bytes are ints; factors are per trained byte).

    Attributes:
        session_overhead_bytes: fixed cost of opening the training session.
        prefix_session_overhead_bytes: fixed cost of the prefix inference session (features phase).
        per_window_bytes: extra bytes per window of a micro-batch (input staging, loss buffers).
        grad_op_bytes: fixed bytes per op of the training graph that needs a gradient (the
            runtime's per-node backward buffers, e.g. a convolution's column buffer), held from
            the session's first backward on.
        graph_op_bytes: fixed bytes per op of the training graph (from its first op to the loss,
            whether or not it needs a gradient): the session's per-node state of a training
            graph over the whole model even when only its last ops train.
        channel_weight_factor: bytes per byte of the *whole* weight of each channel-split
            parameter (mode ``channels``): the training graph rebuilds the whole weight from
            its trained and frozen slices (``ConcatTraining`` -> ``Gather``) and its whole
            gradient (``ConvGrad`` -> ``GatherGrad`` -> ``SplitTraining``), copies the trained
            bytes do not count.
        activation_factor: measured / modelled activation bytes of the training graph
            (allocator rounding, copies).
        inference_activation_factor: the same for the prefix run as inference (features phase),
            whose session frees intermediate tensors more eagerly.
        gradient_factor: gradient bytes per trained byte alive at the step's peak (the kept
            buffer and the transient gradient the backward adds into it; fitted).
        adamw_state_factor: AdamW state bytes per trained byte (two moments).
        sgd_state_factor: SGD state bytes per trained byte.
        rollback_factor: copies of the trained values kept for rollback.
        rollback_state_factor: copies of the optimizer state kept for rollback.
        optimizer_workspace_factor: transient bytes per trained byte during the update.
        statistics_session_bytes: fixed cost of the forward-only statistics session a label-free
            adaptation opens on first use (:mod:`.label_free_cost`).
        statistics_op_bytes: that session's bytes per op of the training graph.
        statistics_activation_factor: measured / modelled activation bytes of a statistics pass
            (a forward with batch statistics: the per-channel moments' temporaries).
        batch_norm_op_bytes: training-session bytes per BatchNormalization op with batch
            statistics in the training graph (the engine's per-node state of its moments,
            normalisation and running-statistics updates).
        batch_norm_activation_factor: bytes per byte of the outputs over a micro-batch of those
            ops a gradient flows through (the normalised values and moments their backward keeps).
        recurrent_layer_bytes: fixed bytes per recurrent layer (``Op.recurrent_layers``) of the
            graph, held for the whole adapt call: what a GRU's or LSTM's kernels and their
            session build leave in the heap beyond the tensors counted, fitted on calibration
            recurrent nets (``benchmarks/calibrate_recurrent.py``).
        calibration: where the constants come from (date, versions, command); not compared.
    """

    session_overhead_bytes: int = 0
    prefix_session_overhead_bytes: int = 0
    per_window_bytes: int = 0
    grad_op_bytes: int = 0
    graph_op_bytes: int = 0
    channel_weight_factor: float = 0.0
    activation_factor: float = 1.0
    inference_activation_factor: float = 1.0
    gradient_factor: float = 1.0
    adamw_state_factor: float = 2.0
    sgd_state_factor: float = 0.0
    rollback_factor: float = 1.0
    rollback_state_factor: float = 0.0
    optimizer_workspace_factor: float = 0.0
    statistics_session_bytes: int = 0
    statistics_op_bytes: int = 0
    statistics_activation_factor: float = 1.0
    batch_norm_op_bytes: int = 0
    batch_norm_activation_factor: float = 0.0
    recurrent_layer_bytes: int = 0
    calibration: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name != "calibration" and (isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0):
                raise ValueError(f"cost model: {f.name} must be a number >= 0, got {v!r}")
        for f in ("session_overhead_bytes", "prefix_session_overhead_bytes", "per_window_bytes", "grad_op_bytes",
                  "graph_op_bytes", "statistics_session_bytes", "statistics_op_bytes", "batch_norm_op_bytes",
                  "recurrent_layer_bytes"):
            if not isinstance(getattr(self, f), int):
                raise ValueError(f"cost model: {f} must be an int")

    def state_factor(self, optimizer: str) -> float:
        """Optimizer-state bytes per trained byte."""
        if optimizer == "adamw":
            return self.adamw_state_factor
        if optimizer == "sgd":
            return self.sgd_state_factor
        raise ValueError(f"unknown optimizer {optimizer!r}; use 'adamw' or 'sgd'")

    def session_bytes(self, trained: int, optimizer: str) -> int:
        return self.session_overhead_bytes + math.ceil(trained * (self.gradient_factor + self.state_factor(optimizer)))

    def graph_bytes(self, n_grad_ops: int, n_graph_ops: int, channel_weight_bytes: int) -> int:
        """Fixed session bytes of the training graph: per op needing a gradient, per op of the graph,
        and the whole-weight copies of channel-split parameters (``channel_weight_bytes``: their
        whole weights' bytes)."""
        return (self.grad_op_bytes * n_grad_ops + self.graph_op_bytes * n_graph_ops
                + math.ceil(self.channel_weight_factor * channel_weight_bytes))

    def batch_norm_bytes(self, graph: Graph, start: int, micro_batch_windows: int, grad: Sequence[bool]) -> int:
        """Training-session bytes of the BatchNormalization ops with batch statistics from op
        ``start`` on (the graph IR keeps such ops as ``BatchNormalization``; frozen statistics
        are exported as an affine op): per op, and per byte of the outputs over a micro-batch of
        those a gradient flows through (``grad``, per op: the backward through batch statistics
        keeps the normalised values and the moments)."""
        n_ops, outputs = batch_norm_ops(graph, start, grad)
        return self.batch_norm_op_bytes * n_ops + math.ceil(self.batch_norm_activation_factor * micro_batch_windows
                                                            * outputs)

    def recurrent_bytes(self, graph: Graph) -> int:
        """Fixed bytes of the graph's recurrent layers (every one, wherever it runs: a frozen
        prefix's layers build their kernels in the feature session, and the heap keeps the mark)."""
        return self.recurrent_layer_bytes * sum(op.recurrent_layers for op in graph.ops)

    def rollback_bytes(self, trained: int, optimizer: str) -> int:
        return math.ceil(trained * (self.rollback_factor + self.rollback_state_factor * self.state_factor(optimizer)))

    def optimizer_bytes(self, trained: int) -> int:
        return math.ceil(trained * self.optimizer_workspace_factor)

    def activation_bytes(self, micro_batch_windows: int, per_window_bytes: int, inference: bool = False) -> int:
        """Bytes of ``per_window_bytes`` of activations over a micro-batch, with the overheads
        (``inference``: the prefix run as an inference model)."""
        factor = self.inference_activation_factor if inference else self.activation_factor
        return math.ceil(factor * micro_batch_windows * per_window_bytes) + micro_batch_windows * self.per_window_bytes

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CostModel:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"cost model: unknown constants {unknown}; known: {sorted(known)}")
        return cls(**d)

    @classmethod
    def default(cls, engine: str = "ort-training") -> CostModel:
        """The constants of training engine ``engine`` (one of :data:`ENGINES`) measured by
        ``benchmarks/calibrate_cost.py`` and shipped with the package, read once per process:
        every plan a process makes uses the same constants, even if the file is rewritten
        meanwhile (a calibration run)."""
        return cls.from_dict(_shipped_constants(engine)[0])

    @classmethod
    def expected(cls, engine: str = "ort-training") -> CostModel:
        """The point estimate of engine ``engine``'s constants (least squares of the relative
        error over the same calibration): what a plan is *expected* to take, reported beside
        the bound that :meth:`default` gives and plans are made with. Never plan with these:
        about half of the calibration plans measure more than their expected figure."""
        expected = _shipped_constants(engine)[1]
        if expected is None:
            raise ValueError(f"{CONSTANTS_FILES[engine]} has no 'expected' constants; re-run "
                             "benchmarks/calibrate_cost.py")
        return cls.from_dict(expected)

    @classmethod
    def bounding(cls, engines: Iterable[str]) -> CostModel:
        """Constants whose predictions bound those of every engine in ``engines``: each constant
        the largest of theirs. Every phase of :func:`predict` grows with every constant, so a
        plan within a budget under these fits it on each engine (a bundle holding several
        engines' graphs is planned with them: the device may run any of them)."""
        models = [cls.default(e) for e in dict.fromkeys(engines)]
        if not models:
            raise ValueError("no engine given")
        if len(models) == 1:
            return models[0]
        values = {f.name: max(getattr(m, f.name) for m in models) for f in fields(cls) if f.name != "calibration"}
        return cls(**values, calibration={"bound_of": list(dict.fromkeys(engines))})


def _shipped_constants(engine: str) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(bound, expected) constants of ``engine`` from its shipped file: the bound at the top
    level, the point estimate under ``"expected"`` (``None`` where the file has none)."""
    if engine not in CONSTANTS_FILES:
        raise ValueError(f"no cost constants for engine {engine!r}; known: {list(ENGINES)}")
    d = json.loads(_shipped_constants_text(CONSTANTS_FILES[engine]))
    expected = d.pop("expected", None)
    return d, expected


@functools.cache
def _shipped_constants_text(name: str) -> str:
    return resources.files(__package__).joinpath(name).read_text()


def channel_weight_bytes(graph: Graph, params) -> int:
    """Bytes of the whole weights of the parameters planned ``channels`` (channel-split)."""
    from .plan import Mode

    return sum(graph.param(pp.name).param_bytes for pp in params if pp.mode is Mode.CHANNELS)


def needs_grad(graph: Graph, trained_params: set[str], start: int = 0) -> list[bool]:
    """Per op: does a gradient flow through it (it owns a trained parameter or reads an op that does)."""
    out = [False] * len(graph.ops)
    for i, op in enumerate(graph.ops):
        if i < start:
            continue
        out[i] = any(p in trained_params for p in op.params) or any(out[graph.op_index(s)] for s in op.inputs)
    return out


def live_bytes(graph: Graph) -> list[int]:
    """Per op: forward bytes per window alive while it runs (live tensors, its output, workspace,
    its kernel's own buffers).

    A tensor lives from the op producing it to its last consumer; the model input from the start
    to its last reader; an output nobody reads lives to the end of the forward (the loss).
    """
    n = len(graph.ops)
    last = list(range(n))
    input_last = -1
    for i, op in enumerate(graph.ops):
        if not op.inputs:
            input_last = i
        for src in op.inputs:
            j = graph.op_index(src)
            last[j] = max(last[j], i)
    consumed = {graph.op_index(s) for op in graph.ops for s in op.inputs}
    for j in range(n):
        if j not in consumed:
            last[j] = n - 1
    diff = [0] * (n + 1)
    if input_last >= 0:
        diff[0] += graph.input_bytes
        diff[input_last + 1] -= graph.input_bytes
    for j, op in enumerate(graph.ops):
        diff[j] += op.output_bytes
        diff[last[j] + 1] -= op.output_bytes
    out, acc = [], 0
    for i, op in enumerate(graph.ops):
        acc += diff[i]
        out.append(acc + op.workspace_bytes + op.kernel_bytes)
    return out


def batch_norm_ops(graph: Graph, start: int, grad: Sequence[bool]) -> tuple[int, int]:
    """The BatchNormalization ops with batch statistics from op ``start`` on: how many, and the
    output bytes per window of those a gradient flows through (``grad``, per op)."""
    ops = [i for i in range(start, len(graph.ops)) if graph.ops[i].kind == BATCH_NORM_KIND]
    return len(ops), sum(graph.ops[i].output_bytes for i in ops if grad[i])


def clean_cut(graph: Graph, cut: int) -> bool:
    """True when nothing after op ``cut`` reads the model input or an op before ``cut``, no op
    before ``cut`` leaves an output nobody reads, and no op up to ``cut`` is a BatchNorm with
    batch statistics.

    Only at such a cut can the prefix run as a separate inference model whose one output
    (the features) feeds the rest: an inference model normalises with the running statistics,
    not the batch's.
    """
    if cut < 0:
        return True
    if any(op.kind == BATCH_NORM_KIND for op in graph.ops[:cut + 1]):
        return False
    for op in graph.ops[cut + 1:]:
        if not op.inputs or any(graph.op_index(s) < cut for s in op.inputs):
            return False
    # An unread output before the cut would stay alive past it (it lives to the loss).
    read = {s for op in graph.ops for s in op.inputs}
    return all(op.name in read or op.output_bytes == 0 for op in graph.ops[:cut])


@dataclass(frozen=True)
class ActivationArrays:
    """Per-op activation quantities of one plan's training graph (bytes per window).

    Attributes:
        start: first op of the training graph (``cut + 1`` with cached features, else 0).
        grad: per op, whether a gradient flows through it.
        saved: per op, saved bytes counted for its backward (0 unless it needs a gradient).
        live: per op, forward live bytes (:func:`live_bytes`).
        grad_transient: per op, backward transient bytes (output gradient, input gradients, workspace).
        candidates: ops that need a gradient and save bytes, in order.
    """

    start: int
    grad: tuple[bool, ...]
    saved: tuple[int, ...]
    live: tuple[int, ...]
    grad_transient: tuple[int, ...]
    candidates: tuple[int, ...]

    def chunk_of(self) -> list[int]:
        """Per op: position (in ``candidates``) of the candidate whose chunk holds it; len = tail."""
        out, k = [], 0
        for i in range(len(self.saved)):
            while k < len(self.candidates) and self.candidates[k] < i:
                k += 1
            out.append(k)
        return out


def activation_arrays(graph: Graph, trained_params: set[str], start: int = 0) -> ActivationArrays:
    """The activation quantities of a training graph that trains ``trained_params`` from op ``start``."""
    grad = needs_grad(graph, trained_params, start)
    saved = [op.saved_bytes if grad[i] else 0 for i, op in enumerate(graph.ops)]
    transient = []
    for i, op in enumerate(graph.ops):
        in_grads = sum(graph.ops[graph.op_index(s)].output_bytes for s in op.inputs if grad[graph.op_index(s)])
        transient.append(op.output_bytes + in_grads + op.workspace_bytes if grad[i] else 0)
    cands = tuple(i for i in range(len(saved)) if saved[i] > 0)
    return ActivationArrays(start, tuple(grad), tuple(saved), tuple(live_bytes(graph)), tuple(transient), cands)


def _activation_peaks(graph: Graph, arr: ActivationArrays, recompute: set[str]):
    """(forward value, op) and (backward value, op) maxima per window, closed form per chunk."""
    n = len(graph.ops)
    cands = arr.candidates
    kept_before, k = [], 0  # kept saved bytes of candidates before each candidate
    run = []  # recomputed run sum up to each candidate (its own saved bytes when kept)
    for pos, i in enumerate(cands):
        kept_before.append(k)
        if graph.ops[i].name in recompute:
            prev = run[pos - 1] if pos and graph.ops[cands[pos - 1]].name in recompute else 0
            run.append(prev + arr.saved[i])
        else:
            run.append(arr.saved[i])
            k += arr.saved[i]
    kept_all = k
    chunk = arr.chunk_of()
    fwd = (-1, "")
    for j in range(arr.start, n):
        c = chunk[j]
        value = (kept_before[c] if c < len(cands) else kept_all) + arr.live[j]
        if value > fwd[0]:
            fwd = (value, graph.ops[j].name)
    bwd = (-1, "")
    for j in range(n - 1, arr.start - 1, -1):
        if not arr.grad[j]:
            continue
        c = chunk[j]
        held = kept_all if c == len(cands) else kept_before[c] + run[c]
        value = held + arr.grad_transient[j]
        if value > bwd[0]:
            bwd = (value, graph.ops[j].name)
    return fwd, bwd


def param_copy_bytes(graph: Graph, trained_params: set[str], start: int = 0) -> tuple[int, int]:
    """Fixed (not per window) bytes of parameter copies (``Op.param_copy_bytes``,
    ``Op.param_grad_bytes``) in a training graph from op ``start`` on, as (forward, backward).

    The copies of ops whose own parameters train live through the whole step (their backward reads
    them); the forward adds the largest copy of a frozen op (alive while that op runs), the backward
    the largest gradient buffers of a trained op (alive while its backward runs). Taking the largest
    at every op instead of at the op itself over-counts by at most that figure."""
    trained = [i for i in range(start, len(graph.ops)) if any(p in trained_params for p in graph.ops[i].params)]
    kept = sum(graph.ops[i].param_copy_bytes for i in trained)
    frozen = set(range(start, len(graph.ops))) - set(trained)
    frozen_copy = max((graph.ops[i].param_copy_bytes for i in frozen), default=0)
    grad_buffers = max((graph.ops[i].param_grad_bytes for i in trained), default=0)
    return kept + frozen_copy, kept + grad_buffers


def _prefix_peak(graph: Graph, cut: int) -> tuple[int, str]:
    live = live_bytes(graph)
    best = (-1, "")
    for j in range(cut + 1):
        if live[j] > best[0]:
            best = (live[j], graph.ops[j].name)
    return best


def predict(graph: Graph, plan: Plan, cost: CostModel | None = None) -> Peak:
    """Predicted peak of a whole device ``adapt`` call carrying out ``plan`` (closed form).

    Args:
        graph: the model's IR (the plan's ``graph`` must name it).
        plan: the plan to cost.
        cost: the constants (default: :meth:`CostModel.default`).

    Returns:
        The peak, where it occurs (``"<phase>:<op>"`` or ``"<phase>"``) and the peak per phase.
    """
    cost = cost or CostModel.default()
    if plan.graph != graph.name:
        raise ValueError(f"the plan was made for graph {plan.graph!r}, not {graph.name!r}")
    trained = trained_bytes(graph, plan.params)
    trained_names = {p.name for p in plan.params if p.trains}
    caching = plan.cache_features and plan.cut >= 0
    start = plan.cut + 1 if caching else 0
    m = plan.micro_batch_windows
    arr = activation_arrays(graph, trained_names, start)
    session = cost.session_bytes(trained, plan.optimizer) + cost.graph_bytes(
        sum(arr.grad), len(graph.ops) - start, channel_weight_bytes(graph, plan.params)) + cost.batch_norm_bytes(
        graph, start, m, arr.grad) + cost.recurrent_bytes(graph)
    cache = plan.n_windows * graph.ops[plan.cut].output_bytes if caching else 0
    rollback = cost.rollback_bytes(trained, plan.optimizer)
    held = session + cache + rollback
    (fwd, fwd_op), (bwd, bwd_op) = _activation_peaks(graph, arr, set(plan.recomputed))
    fwd_copies, bwd_copies = param_copy_bytes(graph, trained_names, start)
    phases: list[tuple[str, int, str]] = [("session", session, "session")]
    if caching:
        pre, pre_op = _prefix_peak(graph, plan.cut)
        phases.append(("features", session + cost.prefix_session_overhead_bytes + cache
                       + cost.activation_bytes(m, pre, inference=True), f"features:{pre_op}"))
    phases.append(("rollback", held, "rollback"))
    phases.append(("forward", held + fwd_copies + cost.activation_bytes(m, fwd), f"forward:{fwd_op}"))
    if bwd >= 0:
        phases.append(("backward", held + bwd_copies + cost.activation_bytes(m, bwd), f"backward:{bwd_op}"))
    phases.append(("optimizer", held + cost.optimizer_bytes(trained), "optimizer"))
    peak, where = max(((v, w) for _, v, w in phases), key=lambda t: t[0])  # first maximum in timeline order
    return Peak(peak, where, {name: v for name, v, _ in phases})


