"""A torch module as a scheduler :class:`~edgeadapt.sched.ir.Graph` at block granularity.

A *block* is the unit the streaming trainer moves between tiers: each item of a top-level
``nn.ModuleList`` / ``nn.Sequential`` child (or of the model itself when it is one), and every
other top-level child module that owns parameters. Modules without parameters (pooling,
activations) stay where they are and run as
ordinary torch code between blocks.

The parameters outside every such block (directly on the root module, e.g. a positional
embedding or a class token, or directly on a top-level container) form one more block, the
*root block* :data:`ROOT_BLOCK`, with ``resident=True``: the trainer brings it in before the
model's forward, keeps it for the whole step and updates it after the backward, so it may be
read anywhere in the model's own ``forward`` and passed into blocks as an argument. It comes
first in :func:`find_blocks`' list and in the graph, as an op of kind ``"resident"``.

Activation bytes come from a shape trace on a copy of the module tree that shares the model's
parameters and buffers (no random numbers drawn, no statistics updated, nothing a forward caches
left on the model): forward hooks mark which block runs, and
``saved_tensors_hooks`` sees every tensor autograd keeps for backward. What an op saves depends
on the kernel the compute device picks (on the CPU, ``scaled_dot_product_attention`` runs a
fused kernel that keeps the output and its log-sum-exp; the ``meta`` device runs the unfused
math, which also keeps the attention matrix), so a CPU step is traced with fake tensors of the
CPU (:data:`FAKE_TRACE_DEVICES`), which pick the CPU's kernels, and anything else (or a model the
fake trace cannot run) on ``meta``, where the unfused ops save at least what fused ones do.
Neither sees a kernel's private workspace: a CPU LSTM keeps one its fake and meta kernels report
empty, so every recurrent layer (LSTM, GRU, RNN) of a block is also run for real, configured the
same with fresh weights, on one and two windows of zeros on the CPU, and counted per window
instead of its traced bytes (:func:`_recurrent_window_bytes`; a GPU's cuDNN workspaces are not
measured). An op without a fake kernel may run its real kernel on empty data. Per block the graph
records (per window, i.e. per sample of the batch):

* ``output_bytes``: the block's output tensors;
* ``saved_bytes``: what its backward keeps per window, parameters and the block's own inputs
  excluded (inputs are the previous block's output and are counted there, or, made by the
  model's own code, with what that code keeps); ``saved_traced_bytes``: the same for the whole
  traced batch (``Graph.traced_windows``), where what does not grow with the windows counts once;
* ``workspace_bytes``: ``output_bytes`` again (the block's output while it is produced);
* ``flops``: ``2 * parameter elements * positions`` where positions is the output's element
  count over its channel axis, a rough figure the planner only uses for reports.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._pytree import tree_map

from ..sched.ir import DTYPE_BYTES, Graph, Op, Param
from ..sched.offload import RESIDENT_KIND
from .loss_memory import TargetKind, first_window, loss_memory_per_window, per_window_bytes

__all__ = ["Block", "find_blocks", "trace_graph", "BlockError", "TraceError", "ROOT_BLOCK", "nested_tensors",
           "FAKE_TRACE_DEVICES"]

ROOT_BLOCK = "<root>"
"""Name of the block of the parameters outside every streamed block (no module path has it)."""

FAKE_TRACE_DEVICES = frozenset({"cpu"})
"""Device types traced with fake tensors of the device itself (its own kernels' saved tensors);
the others are traced on ``meta``. CUDA stays on ``meta`` until a GPU run has checked its fused
kernels' fake trace against the run-time ledger."""

log = logging.getLogger(__name__)


class BlockError(ValueError):
    """The model cannot be cut into blocks the streaming trainer can move."""


class TraceError(RuntimeError):
    """The model's forward cannot be traced, neither on the meta device nor with one real window."""


@dataclass(frozen=True)
class Block:
    """One unit of streaming.

    Attributes:
        name: the module path (``"layers.3"``, ``"head"``); :data:`ROOT_BLOCK` for the root block.
        module: the module itself (the model for the root block).
        param_names: full parameter names (``"layers.3.attn.q.weight"``) in registration order.
        resident: the root block: the parameters outside every streamed block, held in the
            compute tier for the whole step instead of streamed.
    """

    name: str
    module: nn.Module
    param_names: tuple[str, ...]
    resident: bool = False

    @property
    def local_names(self) -> tuple[str, ...]:
        """Parameter names relative to :attr:`module` (the full names for the root block)."""
        if self.resident:
            return self.param_names
        return tuple(n[len(self.name) + 1:] for n in self.param_names)

    def full_name(self, local: str) -> str:
        """The full parameter name of ``local`` (a name of :attr:`local_names`)."""
        return local if self.resident else f"{self.name}.{local}"

    def parameters(self) -> list[torch.Tensor]:
        """The block's parameter tensors, in :attr:`param_names` order."""
        return [get_param(self.module, n) for n in self.local_names]


def get_param(module: nn.Module, name: str) -> torch.Tensor:
    """The tensor registered as parameter ``name`` (a dotted path) under ``module``."""
    owner, _, leaf = name.rpartition(".")
    return (module.get_submodule(owner) if owner else module)._parameters[leaf]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def find_blocks(model: nn.Module) -> list[Block]:
    """The blocks of ``model``: the root block (if any) first, then the streamed blocks in
    registration order.

    The root block (:data:`ROOT_BLOCK`, ``resident=True``) holds the parameters registered
    directly on the root module and directly on a top-level ``nn.ModuleList``/``nn.Sequential``
    (outside its items); it exists only when there are such parameters.

    Raises:
        BlockError: a parameter is shared between two blocks, or registered twice (tied
            weights), or the model has no parameters.
    """
    containers = (nn.ModuleList, nn.Sequential)
    loose = [n for n, _ in model.named_parameters(recurse=False, remove_duplicate=False)]
    blocks: list[Block] = []
    top = [("", model)] if isinstance(model, containers) else list(model.named_children())
    for cname, child in top:
        items = list(child.named_children()) if isinstance(child, containers) else [("", child)]
        if isinstance(child, containers) and cname:
            loose += [f"{cname}.{n}" for n, _ in child.named_parameters(recurse=False, remove_duplicate=False)]
        for iname, mod in items:
            name = ".".join(n for n in (cname, iname) if n)
            pnames = tuple(f"{name}.{n}" for n, _ in mod.named_parameters(remove_duplicate=False))
            if pnames:
                blocks.append(Block(name, mod, pnames))
    if loose:
        blocks.insert(0, Block(ROOT_BLOCK, model, tuple(loose), resident=True))
    if not blocks:
        raise BlockError(f"{type(model).__name__} has no parameters to train")
    seen: dict[int, str] = {}
    for b in blocks:
        for pn, p in zip(b.param_names, b.parameters()):
            if id(p) in seen:
                raise BlockError(f"parameter {pn!r} is the same tensor as {seen[id(p)]!r} (tied weights); the "
                                 "streaming trainer moves each block's parameters on their own, so untie them "
                                 "(e.g. give the output head its own weight)")
            seen[id(p)] = pn
    return blocks


def _storage_key(t: torch.Tensor) -> int:
    """The storage itself (as the runtime's ledger keys it): views, detached aliases and split
    pieces share it. A tensor without one storage (sparse, nested) is its own base's."""
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        base = t
        while base._base is not None:
            base = base._base
        return id(base)


def nested_tensors(value) -> list[torch.Tensor]:
    """The tensors in ``value`` (a tensor, or tuples, lists and dicts of them, nested), in order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in nested_tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in nested_tensors(v)]
    return []


def _held(t: torch.Tensor) -> int:
    """The bytes of ``t``'s whole storage (what the runtime charges for a saved view of a larger tensor)."""
    try:
        return t.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):
        return _nbytes(t)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass
class _BlockRun:
    """One shape-traced forward of the model, per block: bytes saved for the backward and of the
    output, the output's elements per channel, the order the blocks ran in, and the recurrent
    layers' calls (whose kernels' workspaces the trace does not see)."""

    order: list[int]
    saved_bytes: dict[int, int]
    out_bytes: dict[int, int]
    out_numel_per_ch: dict[int, int]
    output: object
    outside_saved_bytes: int  # what the model's own code between the blocks saved
    recurrent: list[_RecurrentCall] = field(default_factory=list)


@dataclass
class _RecurrentCall:
    """A recurrent layer's call inside block ``block``: its input's shape and the bytes the trace
    saw it save."""

    block: int
    module: nn.RNNBase
    input_shape: tuple[int, ...]
    traced_bytes: int
    input_order: tuple[int, ...] = ()  # the input's dimensions from the outermost in memory (a transposed view)
    windows: int = 1  # the traced pass's windows (the layer may fold more sequences per window into its batch)


def _run_blocks(model: nn.Module, blocks: list[Block], state: dict[str, torch.Tensor], param_keys: set[int],
                traced_inputs: tuple) -> _BlockRun:
    """Run the model once on ``traced_inputs`` (meta or fake tensors) with hooks on the streamed
    blocks (see :func:`trace_graph`)."""
    by_module = {id(b.module): i for i, b in enumerate(blocks) if not b.resident}
    order: list[int] = []
    saved: dict[int, dict[int, int]] = {i: {} for i in range(len(blocks))}
    in_keys: dict[int, set[int]] = {}
    out_bytes: dict[int, int] = {}
    out_numel_per_ch: dict[int, int] = {}
    active: list[int] = []

    def pre(mod, args, kwargs):
        i = by_module[id(mod)]
        if i in order:
            raise BlockError(f"block {blocks[i].name!r} runs twice in one forward; the streaming trainer "
                             "updates a block once per step, so share no block between two call sites")
        order.append(i)
        active.append(i)
        given = nested_tensors((args, kwargs))
        in_keys[i] = {_storage_key(t) for t in given}
        # a block holds its arguments until its backward: one the model's own code made (not a block's
        # output, the batch or a weight) counts with what that code saves, as the trainer charges it
        for t in given:
            key = _storage_key(t)
            if key not in block_outs and key not in input_keys and key not in param_keys and id(t) not in param_keys:
                keep.append(t)
                outside[key] = max(outside.get(key, 0), _held(t))

    def post(mod, args, out):
        i = active.pop()
        outs = nested_tensors(out)
        out_bytes[i] = sum({_storage_key(t): _held(t) for t in outs}.values())  # as the runtime charges them
        block_outs.update(_storage_key(t) for t in outs)
        keep.extend(outs)  # storages are keyed by address: none is freed and reused during the run
        first = outs[0] if outs else None
        per_ch = first.numel() // max(1, first.shape[-1] if first.dim() else 1) if first is not None else 1
        out_numel_per_ch[i] = per_ch

    outside: dict[int, int] = {}
    block_outs: set[int] = set()
    keep: list[torch.Tensor] = []
    input_keys = {_storage_key(t) for t in nested_tensors(traced_inputs)}

    def pack(t: torch.Tensor):
        # no backward runs: autograd keeps nothing (a saved output returned to it would form a
        # cycle through its graph that outlives the trace, with real tensors real memory), and
        # `keep` holds every tensor until the run ends, so no address is reused meanwhile
        key = _storage_key(t)
        keep.append(t)
        if key in param_keys or id(t) in param_keys:
            return None
        if active:
            i = active[-1]
            if key not in in_keys.get(i, ()):
                saved[i][key] = max(saved[i].get(key, 0), _held(t))
        elif key not in input_keys:  # the model's own code between blocks (the batch is the input's)
            outside[key] = max(outside.get(key, 0), _held(t))
        return None

    recurrent: list[_RecurrentCall] = []
    first = nested_tensors(traced_inputs)
    windows = int(first[0].shape[0]) if first and first[0].dim() else 1

    def rnn_pre(mod, args):
        if active and args and isinstance(args[0], torch.Tensor):
            i = active[-1]
            x = args[0]
            order = tuple(sorted(range(x.dim()), key=lambda d: -x.stride(d)))
            recurrent.append(_RecurrentCall(i, mod, tuple(x.shape), -sum(saved[i].values()), order, windows))

    def rnn_post(mod, args, out):
        if recurrent and recurrent[-1].module is mod and recurrent[-1].traced_bytes <= 0:
            recurrent[-1].traced_bytes += sum(saved[recurrent[-1].block].values())

    handles = []
    for b in blocks:
        if b.resident:
            continue
        handles.append(b.module.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(b.module.register_forward_hook(post))
        for m in b.module.modules():
            if isinstance(m, nn.RNNBase):
                handles.append(m.register_forward_pre_hook(rnn_pre))
                handles.append(m.register_forward_hook(rnn_post))
    try:
        with torch.random.fork_rng(devices=[]), torch.enable_grad(), \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda _: None):
            out = torch.func.functional_call(model, state, traced_inputs, strict=False)
    finally:
        for h in handles:
            h.remove()
        keep.clear()
    missing = [blocks[i].name for i in range(len(blocks)) if i not in order and not blocks[i].resident]
    if missing:
        raise BlockError(f"blocks {missing} never run in the forward of the example input; the streaming "
                         "trainer needs every parameter block on the path")
    # a block's output saved by the code after it is already charged to the block; the model's final
    # outputs made by its own code (not a block's output, not the batch) are charged with the outside
    for t in nested_tensors(out):
        key = _storage_key(t)
        if key not in block_outs and key not in input_keys and key not in param_keys:
            outside[key] = max(outside.get(key, 0), _held(t))
    return _BlockRun(order, {i: sum(v.values()) for i, v in saved.items()}, out_bytes, out_numel_per_ch, out,
                     sum(v for k, v in outside.items() if k not in block_outs), recurrent)


def _batch_axis(module: nn.RNNBase, input_shape: tuple[int, ...]) -> int | None:
    """The axis of a recurrent layer's input that holds its sequences (``None``: one, unbatched)."""
    return (0 if module.batch_first else 1) if len(input_shape) == 3 else None


def _recurrent_config(module: nn.RNNBase) -> tuple[type[nn.RNNBase], tuple[tuple[str, object], ...], bool] | None:
    """What rebuilds a layer like ``module`` with fresh weights (its class, constructor arguments,
    training mode), or ``None`` for a layer that is none of LSTM, GRU, RNN."""
    kinds = [k for k in (nn.LSTM, nn.GRU, nn.RNN) if isinstance(module, k)]
    if not kinds:
        return None
    kw = dict(input_size=module.input_size, hidden_size=module.hidden_size, num_layers=module.num_layers,
              bias=module.bias, batch_first=module.batch_first, dropout=module.dropout,
              bidirectional=module.bidirectional)
    if kinds[0] is nn.LSTM:
        kw["proj_size"] = module.proj_size
    if kinds[0] is nn.RNN:
        kw["nonlinearity"] = module.nonlinearity
    return kinds[0], tuple(kw.items()), module.training


@functools.lru_cache(maxsize=256)
def _recurrent_saved_bytes(config: tuple[type[nn.RNNBase], tuple[tuple[str, object], ...], bool],
                           shape: tuple[int, ...], order: tuple[int, ...]) -> int:
    """What a real CPU forward of a fresh layer of ``config`` (:func:`_recurrent_config`) keeps for
    its backward on zeros of ``shape`` laid out in memory as ``order`` (its dimensions from the
    outermost; a kernel copies a transposed input and keeps the copy), its input included when
    kept (the trace's bytes for the call, taken out, may hold the tensor the input is a piece of),
    its parameters excluded. Cached: the same layer met again (a loop, the first window's trace,
    the trainer's second trace) is not run again."""
    kind, kw, training = config
    layer = kind(**dict(kw)).train(training)
    x = torch.zeros([shape[d] for d in order]).permute(*(order.index(d) for d in range(len(shape))))
    x.requires_grad_()
    skip = {t.untyped_storage().data_ptr() for t in layer.parameters()}
    storages: dict[int, int] = {}
    keep: list[torch.Tensor] = []  # alive until the run ends: no address is reused meanwhile

    def pack(t):
        keep.append(t)
        if t.untyped_storage().data_ptr() not in skip:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return None  # no backward runs: autograd keeps nothing (see _run_blocks)

    with torch.random.fork_rng(devices=[]), torch.enable_grad(), \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda _: None):
        out = layer(x)
    del out
    keep.clear()
    return sum(storages.values())


def _recurrent_window_bytes(module: nn.RNNBase, input_shape: tuple[int, ...],
                            input_order: tuple[int, ...] = (), windows: int = 1) -> int | None:
    """Bytes per window that a real CPU forward of a layer configured like ``module`` keeps for its
    backward on an input of ``input_shape`` laid out in memory as ``input_order``
    (:func:`_recurrent_saved_bytes`): the larger of a run on one window and half a run on two,
    with fresh weights and zeros. A CPU LSTM's workspace does not grow evenly with the windows (for
    2 x 16 units over 10 steps: 59, 70, 113, 123, 133, 177 KB for 1 to 6 windows) but has a large
    part that does not grow at all, so the one-window run's bytes per window bound every size met.
    The input's batch axis holds ``input_shape[axis] / windows`` sequences per window of the traced
    pass of ``windows`` windows (a block may fold another axis into it). ``None`` where the layer
    cannot be rebuilt (a packed sequence, an unknown subclass's constructor)."""
    config = _recurrent_config(module)
    if config is None or len(input_shape) not in (2, 3):
        return None
    axis = _batch_axis(module, input_shape)
    per_window = max(1, input_shape[axis] // max(1, windows)) if axis is not None else 1
    order = input_order if sorted(input_order) == list(range(len(input_shape))) else tuple(range(len(input_shape)))

    def measured(n_windows: int) -> int:
        shape = list(input_shape)
        if axis is not None:
            shape[axis] = n_windows * per_window
        return _recurrent_saved_bytes(config, tuple(shape), order)

    try:
        return max(measured(1), -(-measured(2) // 2)) if axis is not None else measured(1)
    except Exception:  # noqa: BLE001 - a layer that cannot be rebuilt this way is left as traced
        return None


def _take_out_recurrent(run: _BlockRun) -> dict[int, int]:
    """Take the recurrent layers' traced bytes out of their blocks' saved bytes and return, per
    block, what their real CPU kernels keep per window of the pass (a CPU LSTM keeps a workspace
    its fake and meta kernels report empty): each call's sequences, measured per window's worth
    of them, over the pass's windows (a layer called once per window in a loop, or on a batch
    with sequences of its own beside the windows', counts what it holds)."""
    per_window: dict[int, int] = {}
    for call in run.recurrent:
        real = _recurrent_window_bytes(call.module, call.input_shape, call.input_order, call.windows)
        if real is None:
            continue
        run.saved_bytes[call.block] -= call.traced_bytes
        axis = _batch_axis(call.module, call.input_shape)
        sequences = call.input_shape[axis] if axis is not None else 1
        share = sequences / (max(1, sequences // call.windows) * call.windows)  # measured groups per window
        per_window[call.block] = per_window.get(call.block, 0) + math.ceil(real * share)
    return per_window


def _attributes(model: nn.Module) -> dict[tuple[int, str], tuple[nn.Module, object]]:
    """Every module's own attributes (``vars``), by module and name."""
    return {(id(m), k): (m, v) for m in model.modules() for k, v in vars(m).items()}


def _traced(value) -> bool:
    """``value`` is, or (a dict, list or tuple) holds, a meta or fake tensor."""
    return any(t.device.type == "meta" or isinstance(t, FakeTensor) for t in nested_tensors(value))


@contextlib.contextmanager
def _restoring(model: nn.Module, real: bool = False):
    """Put back what a traced forward cached on the modules: a plain attribute now a tensor (a
    table of positions, a mask) returns to what it was (``None``, or absent), and a dict or list
    attribute that now holds a meta or fake tensor gets its former items back (``real``: a
    forward on real tensors, whose caches hold real ones: any dict or list whose items changed)."""
    before = _attributes(model)
    items = {key: (dict(v) if isinstance(v, dict) else list(v)) for key, (_, v) in before.items()
             if isinstance(v, (dict, list)) and (real or not _traced(v))}

    def changed(key, v) -> bool:
        if not real:
            return _traced(v)
        old = items[key]
        if isinstance(v, dict):
            return v.keys() != old.keys() or any(v[k] is not old[k] for k in v)
        return len(v) != len(old) or any(a is not b for a, b in zip(v, old))

    try:
        yield
    finally:
        for key, (m, v) in _attributes(model).items():
            if isinstance(v, torch.Tensor):
                if key not in before:
                    del m.__dict__[key[1]]
                elif before[key][1] is not v:
                    m.__dict__[key[1]] = before[key][1]
            elif key in items and changed(key, v):
                if isinstance(v, dict):
                    v.clear()
                    v.update(items[key])
                else:
                    v[:] = items[key]


def _twin(model: nn.Module, blocks: list[Block]) -> tuple[nn.Module, list[Block]] | None:
    """A copy of ``model``'s module tree that shares its parameters and buffers (nothing of theirs
    is copied), and the blocks on it: what a traced forward caches or counts on its modules (in
    attributes, containers, helper objects) stays on the copy. ``None`` where the model cannot be
    copied (an attribute that refuses ``copy.deepcopy``)."""
    memo: dict[int, object] = {}
    for m in model.modules():
        for t in (*m._parameters.values(), *m._buffers.values()):
            if t is not None:
                memo[id(t)] = t
    try:
        twin = copy.deepcopy(model, memo)
        return twin, [dataclasses.replace(b, module=twin if b.module is model else twin.get_submodule(b.name))
                      for b in blocks]
    except Exception:  # noqa: BLE001 - traced in place, its plain caches put back (_restoring)
        return None


@contextlib.contextmanager
def _traceable(model: nn.Module, blocks: list[Block], real: bool = False):
    """The model and blocks a traced forward runs on: a twin (:func:`_twin`), or the model itself
    with what its forward caches put back afterwards (:func:`_restoring`; ``real``: a forward on
    real tensors) where it cannot be copied."""
    twin = _twin(model, blocks)
    if twin is not None:
        yield twin
    else:
        with _restoring(model, real):
            yield model, blocks


def _finished(whole: _BlockRun, one: _BlockRun | None, param_shapes: dict[str, tuple[int, ...]]):
    """What :func:`_trace_runs` returns of its runs: ``whole`` and ``one``, the traced parameters
    by name, and per block what its recurrent layers keep per window (taken out of the runs' saved
    bytes and measured on the CPU; the larger of the two runs')."""
    recurrent = _take_out_recurrent(whole)
    if one is not None:  # per window, the larger of the batch's and the first window's alone
        for i, b in _take_out_recurrent(one).items():
            recurrent[i] = max(recurrent.get(i, 0), b)
    # the loss is measured on meta from the output's shapes: no fake or real tensor leaves the trace
    whole.output = tree_map(lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta")
                            if isinstance(t, torch.Tensor) else t, whole.output)
    named = {n: torch.empty(shape, device="meta") for n, shape in param_shapes.items()}
    return whole, one, named, recurrent


def _trace_runs(model: nn.Module, blocks: list[Block], inputs: tuple, param_shapes: dict[str, tuple[int, ...]],
                batch: int, kind: str) -> tuple[_BlockRun, _BlockRun | None, dict[str, torch.Tensor], dict[int, int]]:
    """The forward of the whole batch and of its first window alone (``None`` when that cannot run
    or runs the blocks in another order), on ``meta`` or with fake tensors of device type ``kind``
    (their saved bytes without the recurrent layers'), the traced parameters by name, and per block
    what its recurrent layers keep per window (measured on the CPU)."""
    space = contextlib.nullcontext() if kind == "meta" else FakeTensorMode(allow_non_fake_inputs=True)
    with _traceable(model, blocks) as (model, blocks), space:
        traced = tuple(torch.empty(t.shape, dtype=t.dtype, device=kind) if isinstance(t, torch.Tensor) else t
                       for t in inputs)
        state = {n: torch.empty(shape, device=kind, requires_grad=True) for n, shape in param_shapes.items()}
        state.update({n: torch.empty_like(b, device=kind) for n, b in model.named_buffers()})
        param_keys = {id(t) for t in state.values()} | {_storage_key(t) for t in state.values()}
        whole = _run_blocks(model, blocks, state, param_keys, traced)
        one = None  # the first window alone: what does not grow with the batch, once per window
        if batch > 1:
            try:
                one = _run_blocks(model, blocks, state, param_keys, first_window(traced, batch))
            except Exception:  # a model that needs more than one window (BatchNorm in training mode)
                one = None
            if one is not None and one.order != whole.order:
                one = None
    return _finished(whole, one, param_shapes)


def _real_trace_runs(model: nn.Module, blocks: list[Block], inputs: tuple, param_shapes: dict[str, tuple[int, ...]],
                     batch: int, cause: Exception) -> tuple[_BlockRun, None, dict[str, torch.Tensor], dict[int, int]]:
    """:func:`_trace_runs` for a model whose forward the meta trace cannot run (``cause``): shapes
    that depend on the data (``torch.nonzero``, boolean indexing, ``.item()`` in control flow).
    One real window of the batch runs on the CPU, with the model's own weights where they are on
    the CPU (a CPU copy of others; seeded random values of the traced shapes where the model no
    longer holds them, which only size what depends on them) and copies of its buffers; the model
    is left as it was. What depends on the data is sized by that window: a later batch that keeps
    more is caught by the trainer's ledger.

    Raises:
        TraceError: the real run failed too (both causes in the message).
    """
    log.warning("the meta trace of %s failed (%s: %s); traced with one real window on the CPU instead: "
                "what depends on the data is sized by that window (with the model's own weights when it still "
                "holds them: pass example_input to the Trainer for such a model)", type(model).__name__,
                type(cause).__name__, str(cause).splitlines()[0] if str(cause) else "")
    own = dict(model.named_parameters())
    gen = torch.Generator().manual_seed(0)
    state: dict[str, torch.Tensor] = {}
    for n, shape in param_shapes.items():
        p = own.get(n)
        real = p is not None and tuple(p.shape) == tuple(shape) and p.device.type != "meta"
        # the weights themselves where they are on the CPU (a forward does not change them; no
        # copy of the model is made), a CPU copy of others
        value = (p.detach().to("cpu") if real
                 else torch.randn(shape, generator=gen) / max(1, shape[-1] if shape else 1) ** 0.5)
        state[n] = value.requires_grad_(value.is_floating_point())
    state.update({n: b.detach().to("cpu", copy=True) for n, b in model.named_buffers()})  # a forward updates some
    window = tuple(t.detach().to("cpu") if isinstance(t, torch.Tensor) else t for t in first_window(inputs, batch))
    param_keys = {id(t) for t in state.values()} | {_storage_key(t) for t in state.values()}
    try:
        with _traceable(model, blocks, real=True) as (model, blocks):
            whole = _run_blocks(model, blocks, state, param_keys, window)
    except BlockError:
        raise
    except Exception as e:
        raise TraceError(f"cannot trace {type(model).__name__}'s forward to plan its memory: on the meta device "
                         f"{type(cause).__name__}: {cause}; with one real window on the CPU {type(e).__name__}: {e}. "
                         "Make the forward run on one window of the example input on the CPU") from e
    return _finished(whole, None, param_shapes)


def trace_graph(model: nn.Module, example_input: torch.Tensor | Sequence[torch.Tensor],
                blocks: list[Block] | None = None, *, param_shapes: dict[str, tuple[int, ...]] | None = None,
                loss_fn: Callable | None = None, target: torch.Tensor | TargetKind | None = None,
                device: torch.device | str | None = None) -> Graph:
    """Trace ``model`` without memory or compute and describe it as a block graph.

    Args:
        model: the model (left untouched: no buffers change, no random numbers are drawn).
        example_input: one batch (or a tuple of positional inputs); byte counts are divided by
            its first dimension to give per-window figures, each raised to the first window's
            alone when that is larger (what does not grow with the batch, such as positions
            built inside the model, counts once per window: an upper bound for any micro-batch
            whose bytes grow no faster than the windows); the saved bytes of the whole batch are
            also kept as they are (``Op.saved_traced_bytes``, ``Graph.outside_traced_bytes``)
            for a plan of exactly this batch.
        blocks: the blocks, as :func:`find_blocks` returns them (computed if omitted).
        param_shapes: parameter shapes to trace with, when the module's own parameters no longer
            hold them (a model whose weights the trainer has moved out); float32 assumed.
        loss_fn: the training loss ``fn(output, target)``: its bytes are measured on the meta
            device (:func:`~edgeadapt.server.loss_memory.loss_memory`) into the graph's
            ``loss_saved_bytes`` / ``loss_peak_bytes``; ``None``: not measured (0).
        target: the batch's targets (shape and dtype), or their kind (``"class"`` ids or
            ``"like"`` the output); ``None``: each kind is tried; a loss that takes neither is
            left unmeasured.
        device: the compute device the step will run on: a type in :data:`FAKE_TRACE_DEVICES` is
            traced with its own kernels (fake tensors), any other, or ``None``, on ``meta`` (the
            unfused math: at least what fused kernels save); recurrent layers are measured on the
            CPU either way (module docstring).

    Returns:
        A :class:`Graph` with one op of kind ``"block"`` per streamed block, in execution
        order, after the root block's op of kind ``"resident"`` (no activation bytes: it is
        held for the whole step) when the model has one.

    Raises:
        BlockError: a block runs twice in one forward, or never runs.
        TraceError: the forward runs neither on the meta device nor on one real window.
    """
    blocks = find_blocks(model) if blocks is None else blocks
    inputs = tuple(example_input) if isinstance(example_input, (tuple, list)) else (example_input,)
    batch = int(inputs[0].shape[0]) if inputs[0].dim() else 1
    if param_shapes is None:
        param_shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    kind = torch.device(device).type if device is not None else "meta"
    runs = None
    if kind in FAKE_TRACE_DEVICES:
        try:
            runs = _trace_runs(model, blocks, inputs, param_shapes, batch, kind)
        except BlockError:
            raise
        except Exception as e:  # an op without a fake kernel: the meta trace's upper bound instead
            log.info("the %s fake trace of %s failed (%s: %s); traced on meta, an upper bound", kind,
                     type(model).__name__, type(e).__name__, e)
    windows = batch  # the windows the trace ran
    if runs is None:
        try:
            runs = _trace_runs(model, blocks, inputs, param_shapes, batch, "meta")
        except BlockError:
            raise
        except Exception as e:  # noqa: BLE001 - shapes that depend on the data: one real window instead
            runs, windows = _real_trace_runs(model, blocks, inputs, param_shapes, batch, e), 1
            if isinstance(target, torch.Tensor):
                target = first_window(target, batch)
    whole, one, named, recurrent = runs
    order, out = whole.order, whole.output
    params: list[Param] = []
    ops: list[Op] = []
    prev: str | None = None
    per = lambda v: -(-v // windows)  # noqa: E731  (ceil per window)

    def per_window(field: str, i: int) -> int:
        return per_window_bytes(getattr(whole, field)[i], getattr(one, field)[i] if one is not None else None,
                                windows)

    def add_params(b: Block) -> None:
        for pn in b.param_names:
            p = named[pn]
            mod_path = pn.rpartition(".")[0]
            params.append(Param(pn, tuple(p.shape), DTYPE_BYTES.get(_dtype_name(p.dtype), p.element_size()),
                                module=mod_path, module_type=type(model.get_submodule(mod_path)).__name__))

    for b in blocks:
        if b.resident:
            add_params(b)
            ops.append(Op(b.name, RESIDENT_KIND, params=b.param_names, module=""))
    for i in order:
        b = blocks[i]
        add_params(b)
        numel = sum(named[pn].numel() for pn in b.param_names)
        rec = recurrent.get(i, 0)  # the recurrent layers' bytes per window, measured apart
        saved = (per_window("saved_bytes", i) + rec, whole.saved_bytes[i] + rec * windows)
        ops.append(Op(b.name, "block", params=b.param_names, inputs=() if prev is None else (prev,),
                      output_bytes=per_window("out_bytes", i), saved_bytes=saved[0], saved_traced_bytes=saved[1],
                      workspace_bytes=per_window("out_bytes", i),
                      flops=2 * numel * max(1, per(whole.out_numel_per_ch[i])), module=b.name))
        prev = b.name
    loss = None  # per window
    if loss_fn is not None:
        loss = loss_memory_per_window(loss_fn, out, target, windows)
    if loss_fn is not None and loss is None and isinstance(target, torch.Tensor):
        log.warning("the loss could not run on the meta device with the batch's targets: its memory is not in the "
                    "plan, so leave room for it in the budget")
    # the step holds its input batch and, when the loss was measured, its targets throughout
    batch_bytes = sum(_nbytes(t) for t in inputs if isinstance(t, torch.Tensor))
    input_bytes = -(-batch_bytes // batch) + (loss.target_bytes if loss else 0)
    outside = per_window_bytes(whole.outside_saved_bytes, one.outside_saved_bytes if one is not None else None,
                               windows)
    return Graph(tuple(ops), tuple(params), input_bytes=input_bytes, name=type(model).__name__,
                 loss_saved_bytes=loss.saved_bytes if loss else 0, loss_peak_bytes=loss.peak_bytes if loss else 0,
                 outside_saved_bytes=outside, traced_windows=windows, outside_traced_bytes=whole.outside_saved_bytes)
