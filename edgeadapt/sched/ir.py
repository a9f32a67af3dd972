"""The scheduler's graph IR: what the planner knows about a model, as plain frozen values.

A :class:`Graph` is a list of ops in execution order. Each op owns some parameters and carries
per-window byte counts (its output, what its backward would keep) and FLOPs. The IR is built
on the export side from the ONNX graph (``edgeadapt.export.sched_graph``) and on the server
side from a torch module (``edgeadapt.server.trace``); the planner never sees either library.

Granularity is up to the builder: an op may be one ONNX node or one whole block of a torch
model. Byte counts are ints and are *per window* (one sample of the batch) unless a name says
otherwise; a batch of ``b`` windows multiplies them by ``b``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Param", "Op", "Graph", "DTYPE_BYTES"]

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int64": 8, "int32": 4, "bool": 1}


def _check_nonneg(owner: str, **values: int) -> None:
    for key, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{owner}: {key} must be an int >= 0, got {value!r}")


@dataclass(frozen=True)
class Param:
    """One parameter tensor of the source model.

    Attributes:
        name: the source (torch) parameter name, e.g. ``"blocks.3.conv.weight"``.
        shape: full shape; axis 0 is the output-channel axis that channel subsets select on.
        dtype_bytes: bytes per element (4 for float32).
        module: the module path that owns it (``"blocks.3.conv"``), used by update policies.
        module_type: the module's class name (``"Conv1d"``, ``"FrozenBatchNorm"``...).
    """

    name: str
    shape: tuple[int, ...]
    dtype_bytes: int = 4
    module: str = ""
    module_type: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        _check_nonneg(f"param {self.name!r}", dtype_bytes=self.dtype_bytes,
                      **{f"shape[{i}]": s for i, s in enumerate(self.shape)})

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def param_bytes(self) -> int:
        return self.numel * self.dtype_bytes

    @property
    def out_channels(self) -> int:
        """Length of axis 0 (1 for a scalar)."""
        return self.shape[0] if self.shape else 1

    @property
    def is_bias(self) -> bool:
        return self.name.rsplit(".", 1)[-1] == "bias"


@dataclass(frozen=True)
class Op:
    """One op (or block) in execution order.

    Attributes:
        name: unique within the graph.
        kind: the op type (``"Conv"``, ``"Gemm"``, ``"Relu"``; ``"block"`` for a torch block).
        params: names of the :class:`Param` this op owns (its trainable inputs).
        inputs: names of the ops whose outputs it reads; ``()`` reads the model input.
        output_bytes: bytes of its output per window.
        saved_bytes: bytes its backward keeps per window when a gradient must flow through it
            (inputs it re-reads, masks); 0 for ops whose backward needs nothing.
        workspace_bytes: transient bytes per window while it runs (forward), freed after.
        kernel_bytes: transient bytes per window its forward kernel allocates beyond the graph's
            tensors (a recurrent layer's gate buffers), freed after it; unlike ``workspace_bytes``
            not counted in its backward, whose kernel keeps no such buffer.
        param_copy_bytes: bytes (not per window) of the tensors the op reads that are computed from
            its parameters at every step, e.g. a recurrent layer's weights re-ordered per gate
            (``Split`` + ``Concat`` of the initializers): alive while it runs and, when its
            parameters train, until its backward has read them.
        param_grad_bytes: bytes (not per window) its backward allocates for its parameters'
            gradients beyond the gradients themselves when they train: the gradient with respect
            to each copy above and one transform step's gradient as it is carried back to the
            parameter, plus a recurrent gradient kernel's own weight-sized accumulators.
        recurrent_layers: the recurrent layers (ONNX ``GRU``/``LSTM`` nodes) the op runs; each has
            a fixed cost in the adapt call (``CostModel.recurrent_layer_bytes``).
        flops: forward FLOPs per window (backward is costed as 2x by the planner).
        module: the module path it belongs to.
        saved_traced_bytes: what its backward keeps for exactly ``Graph.traced_windows`` windows
            (a server block graph's trace of a whole batch; tighter than ``saved_bytes`` times the
            windows where part of it does not grow with them); unused when ``traced_windows`` is 0.
        differentiable: ``False`` when the training runtime cannot propagate a gradient through
            it (an op without a gradient); no parameter whose gradient must flow through such an
            op can train (:meth:`Graph.gradient_blocked`). Default ``True`` (graphs written
            before the field existed).
    """

    name: str
    kind: str
    params: tuple[str, ...] = ()
    inputs: tuple[str, ...] = ()
    output_bytes: int = 0
    saved_bytes: int = 0
    workspace_bytes: int = 0
    flops: int = 0
    module: str = ""
    differentiable: bool = True
    saved_traced_bytes: int = 0
    kernel_bytes: int = 0
    param_copy_bytes: int = 0
    param_grad_bytes: int = 0
    recurrent_layers: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.differentiable, bool):
            raise ValueError(f"op {self.name!r}: differentiable must be a bool, got {self.differentiable!r}")
        object.__setattr__(self, "params", tuple(self.params))
        object.__setattr__(self, "inputs", tuple(self.inputs))
        _check_nonneg(f"op {self.name!r}", output_bytes=self.output_bytes, saved_bytes=self.saved_bytes,
                      workspace_bytes=self.workspace_bytes, flops=self.flops,
                      saved_traced_bytes=self.saved_traced_bytes, kernel_bytes=self.kernel_bytes,
                      param_copy_bytes=self.param_copy_bytes, param_grad_bytes=self.param_grad_bytes,
                      recurrent_layers=self.recurrent_layers)


@dataclass(frozen=True)
class Graph:
    """Ops in execution order plus the parameters they own.

    Attributes:
        ops: execution order; every ``inputs`` name refers to an earlier op.
        params: every parameter; each is owned by exactly one op.
        input_bytes: bytes of one input window (with its targets, when the graph measured the loss).
        name: a label for reports (the model's class name).
        loss_saved_bytes: per window, what the training loss holds from the end of the forward
            until the backward (its saved tensors); 0 when not measured.
        loss_peak_bytes: per window, the most the loss holds at once, forward and backward (its
            saved tensors, its backward's transients, the gradient it hands to the output).
        outside_saved_bytes: per window, what the model's own code outside every op (between the
            server's blocks) saves for the backward; 0 when not measured.
        traced_windows: the windows of the batch the graph was traced on (0: none), for which
            ``Op.saved_traced_bytes`` and ``outside_traced_bytes`` are exact.
        outside_traced_bytes: what the model's own code keeps for exactly ``traced_windows``
            windows.
    """

    ops: tuple[Op, ...]
    params: tuple[Param, ...]
    input_bytes: int
    name: str = "model"
    loss_saved_bytes: int = 0
    loss_peak_bytes: int = 0
    outside_saved_bytes: int = 0
    traced_windows: int = 0
    outside_traced_bytes: int = 0
    _op_index: dict[str, int] = field(init=False, repr=False, compare=False)
    _param_index: dict[str, Param] = field(init=False, repr=False, compare=False)
    _owner: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "ops", tuple(self.ops))
        object.__setattr__(self, "params", tuple(self.params))
        _check_nonneg(f"graph {self.name!r}", input_bytes=self.input_bytes, loss_saved_bytes=self.loss_saved_bytes,
                      loss_peak_bytes=self.loss_peak_bytes, outside_saved_bytes=self.outside_saved_bytes,
                      traced_windows=self.traced_windows, outside_traced_bytes=self.outside_traced_bytes)
        if not self.ops:
            raise ValueError(f"graph {self.name!r} has no ops")
        op_index: dict[str, int] = {}
        for i, op in enumerate(self.ops):
            if op.name in op_index:
                raise ValueError(f"graph {self.name!r}: op name {op.name!r} appears twice")
            for src in op.inputs:
                if src not in op_index:
                    raise ValueError(f"graph {self.name!r}: op {op.name!r} reads {src!r}, which is not an earlier op")
            op_index[op.name] = i
        params = {p.name: p for p in self.params}
        if len(params) != len(self.params):
            raise ValueError(f"graph {self.name!r}: a parameter name appears twice")
        owner: dict[str, int] = {}
        for i, op in enumerate(self.ops):
            for p in op.params:
                if p not in params:
                    raise ValueError(f"graph {self.name!r}: op {op.name!r} owns unknown parameter {p!r}")
                if p in owner:
                    raise ValueError(f"graph {self.name!r}: parameter {p!r} is owned by two ops")
                owner[p] = i
        unowned = sorted(set(params) - set(owner))
        if unowned:
            raise ValueError(f"graph {self.name!r}: parameters owned by no op: {unowned}")
        object.__setattr__(self, "_op_index", op_index)
        object.__setattr__(self, "_param_index", params)
        object.__setattr__(self, "_owner", owner)

    def op_index(self, name: str) -> int:
        """Position of op ``name`` in execution order."""
        try:
            return self._op_index[name]
        except KeyError:
            raise KeyError(f"graph {self.name!r} has no op {name!r}") from None

    def param(self, name: str) -> Param:
        try:
            return self._param_index[name]
        except KeyError:
            raise KeyError(f"graph {self.name!r} has no parameter {name!r}") from None

    def owner_index(self, param_name: str) -> int:
        """Position of the op that owns ``param_name``."""
        self.param(param_name)
        return self._owner[param_name]

    @property
    def param_bytes(self) -> int:
        return sum(p.param_bytes for p in self.params)

    def gradient_blocked(self) -> frozenset[str]:
        """Parameters whose gradient would have to flow through an op that is not differentiable:
        those owned by such an op or by any op whose output reaches one. They cannot train."""
        consumers: list[list[int]] = [[] for _ in self.ops]
        for i, op in enumerate(self.ops):
            for src in op.inputs:
                consumers[self._op_index[src]].append(i)
        blocked = [False] * len(self.ops)
        for i in range(len(self.ops) - 1, -1, -1):
            blocked[i] = not self.ops[i].differentiable or any(blocked[c] for c in consumers[i])
        return frozenset(p for i, op in enumerate(self.ops) if blocked[i] for p in op.params)

    # ---- JSON ------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "input_bytes": self.input_bytes,
            "params": [{"name": p.name, "shape": list(p.shape), "dtype_bytes": p.dtype_bytes,
                        "module": p.module, "module_type": p.module_type} for p in self.params],
            "ops": [{"name": o.name, "kind": o.kind, "params": list(o.params), "inputs": list(o.inputs),
                     "output_bytes": o.output_bytes, "saved_bytes": o.saved_bytes,
                     "workspace_bytes": o.workspace_bytes, "flops": o.flops, "module": o.module,
                     # only when False / nonzero: graphs without them serialise as before the fields existed
                     **({} if o.differentiable else {"differentiable": False}),
                     **({"saved_traced_bytes": o.saved_traced_bytes} if o.saved_traced_bytes else {}),
                     **({"kernel_bytes": o.kernel_bytes} if o.kernel_bytes else {}),
                     **({"param_copy_bytes": o.param_copy_bytes} if o.param_copy_bytes else {}),
                     **({"param_grad_bytes": o.param_grad_bytes} if o.param_grad_bytes else {}),
                     **({"recurrent_layers": o.recurrent_layers} if o.recurrent_layers else {})}
                    for o in self.ops],
            # only when measured: graphs without a loss serialise as before the fields existed
            **({"loss_saved_bytes": self.loss_saved_bytes, "loss_peak_bytes": self.loss_peak_bytes}
               if self.loss_peak_bytes else {}),
            **({"outside_saved_bytes": self.outside_saved_bytes} if self.outside_saved_bytes else {}),
            **({"traced_windows": self.traced_windows, "outside_traced_bytes": self.outside_traced_bytes}
               if self.traced_windows else {}),
        }

    def traced_at(self, windows: int) -> bool:
        """Whether the graph was traced on exactly ``windows`` windows: its ``Op.saved_traced_bytes``
        and ``outside_traced_bytes`` are then the figures for them."""
        return self.traced_windows == windows

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Graph:
        return cls(ops=tuple(Op(**o) for o in d["ops"]),
                   params=tuple(Param(**{**p, "shape": tuple(p["shape"])}) for p in d["params"]),
                   input_bytes=d["input_bytes"], name=d.get("name", "model"),
                   loss_saved_bytes=d.get("loss_saved_bytes", 0), loss_peak_bytes=d.get("loss_peak_bytes", 0),
                   outside_saved_bytes=d.get("outside_saved_bytes", 0),
                   traced_windows=d.get("traced_windows", 0), outside_traced_bytes=d.get("outside_traced_bytes", 0))
