"""A torch module as a scheduler :class:`~edgeadapt.sched.ir.Graph` at block granularity.

A *block* is the unit the streaming trainer moves between tiers: each item of a top-level
``nn.ModuleList`` / ``nn.Sequential`` child (or of the model itself when it is one), and every
other top-level child module that owns parameters. Modules without parameters (pooling, activations) stay where they are and run as
ordinary torch code between blocks.

Activation bytes come from a shape trace on the ``meta`` device (no memory, no compute, no
random numbers drawn, no statistics updated): forward hooks mark which block runs, and
``saved_tensors_hooks`` sees every tensor autograd keeps for backward. Per block the graph
records (per window, i.e. per sample of the batch):

* ``output_bytes``: the block's output tensors;
* ``saved_bytes``: what its backward keeps, parameters and the block's own inputs excluded
  (inputs are the previous block's output and are counted there);
* ``workspace_bytes``: ``output_bytes`` again (the block's output while it is produced);
* ``flops``: ``2 * parameter elements * positions`` where positions is the output's element
  count over its channel axis, a rough figure the planner only uses for reports.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..sched.ir import DTYPE_BYTES, Graph, Op, Param

__all__ = ["Block", "find_blocks", "trace_graph", "BlockError"]

log = logging.getLogger(__name__)


class BlockError(ValueError):
    """The model cannot be cut into blocks the streaming trainer can move."""


@dataclass(frozen=True)
class Block:
    """One unit of streaming.

    Attributes:
        name: the module path (``"layers.3"``, ``"head"``).
        module: the module itself.
        param_names: full parameter names (``"layers.3.attn.q.weight"``) in registration order.
    """

    name: str
    module: nn.Module
    param_names: tuple[str, ...]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def find_blocks(model: nn.Module) -> list[Block]:
    """The blocks of ``model`` in registration order.

    Raises:
        BlockError: a parameter sits directly on the root module, a parameter is shared
            between two blocks (tied weights), or the model has no parameters.
    """
    root_params = [n for n, _ in model.named_parameters(recurse=False)]
    if root_params:
        raise BlockError(f"parameters {root_params} sit directly on the root module {type(model).__name__}, "
                         "outside any block; move them into a child module (e.g. an nn.Embedding) so that "
                         "they can be streamed")
    blocks: list[Block] = []
    containers = (nn.ModuleList, nn.Sequential)
    top = [("", model)] if isinstance(model, containers) else list(model.named_children())
    for cname, child in top:
        items = list(child.named_children()) if isinstance(child, containers) else [("", child)]
        if isinstance(child, containers) and cname and any(True for _ in child.parameters(recurse=False)):
            raise BlockError(f"container {cname!r} owns parameters directly; they belong in its items")
        for iname, mod in items:
            name = ".".join(n for n in (cname, iname) if n)
            pnames = tuple(f"{name}.{n}" for n, _ in mod.named_parameters(remove_duplicate=False))
            if pnames:
                blocks.append(Block(name, mod, pnames))
    if not blocks:
        raise BlockError(f"{type(model).__name__} has no parameters to train")
    seen: dict[int, str] = {}
    for b in blocks:
        for pn, p in zip(b.param_names, (t for _, t in b.module.named_parameters(remove_duplicate=False))):
            if id(p) in seen:
                raise BlockError(f"parameter {pn!r} is the same tensor as {seen[id(p)]!r} (tied weights); the "
                                 "streaming trainer moves each block's parameters on their own, so untie them "
                                 "(e.g. give the output head its own weight)")
            seen[id(p)] = pn
    return blocks


def _storage_key(t: torch.Tensor) -> int:
    base = t
    while base._base is not None:
        base = base._base
    return id(base)


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def trace_graph(model: nn.Module, example_input: torch.Tensor | Sequence[torch.Tensor],
                blocks: list[Block] | None = None, *, param_shapes: dict[str, tuple[int, ...]] | None = None) -> Graph:
    """Trace ``model`` on the meta device and describe it as a block graph.

    Args:
        model: the model (left untouched: no buffers change, no random numbers are drawn).
        example_input: one batch (or a tuple of positional inputs); byte counts are divided by
            its first dimension to give per-window figures.
        blocks: the blocks, as :func:`find_blocks` returns them (computed if omitted).
        param_shapes: parameter shapes to trace with, when the module's own parameters no longer
            hold them (a model whose weights the trainer has moved out); float32 assumed.

    Returns:
        A :class:`Graph` with one op of kind ``"block"`` per block, in execution order.

    Raises:
        BlockError: a block runs twice in one forward, or never runs.
    """
    blocks = find_blocks(model) if blocks is None else blocks
    inputs = tuple(example_input) if isinstance(example_input, (tuple, list)) else (example_input,)
    batch = int(inputs[0].shape[0]) if inputs[0].dim() else 1
    meta_inputs = tuple(t.to("meta") if isinstance(t, torch.Tensor) else t for t in inputs)
    if param_shapes is None:
        param_shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    state = {n: torch.empty(shape, device="meta", requires_grad=True) for n, shape in param_shapes.items()}
    state.update({n: torch.empty_like(b, device="meta") for n, b in model.named_buffers()})
    param_keys = {id(t) for t in state.values()}

    by_module = {id(b.module): i for i, b in enumerate(blocks)}
    order: list[int] = []
    saved: dict[int, dict[int, int]] = {i: {} for i in range(len(blocks))}
    in_keys: dict[int, set[int]] = {}
    out_bytes: dict[int, int] = {}
    out_numel_per_ch: dict[int, int] = {}
    active: list[int] = []

    def pre(mod, args):
        i = by_module[id(mod)]
        if i in order:
            raise BlockError(f"block {blocks[i].name!r} runs twice in one forward; the streaming trainer "
                             "updates a block once per step, so share no block between two call sites")
        order.append(i)
        active.append(i)
        in_keys[i] = {_storage_key(t) for t in _tensors(args)}

    def post(mod, args, out):
        i = active.pop()
        outs = _tensors(out)
        out_bytes[i] = sum(_nbytes(t) for t in outs)
        first = outs[0] if outs else None
        out_numel_per_ch[i] = (first.numel() // max(1, first.shape[-1] if first.dim() else 1)) if first is not None else 1

    def pack(t: torch.Tensor):
        if active:
            key = _storage_key(t)
            i = active[-1]
            if key not in param_keys and id(t) not in param_keys and key not in in_keys.get(i, ()):
                saved[i][key] = max(saved[i].get(key, 0), _nbytes(t))
        return t

    handles = []
    for b in blocks:
        handles.append(b.module.register_forward_pre_hook(pre))
        handles.append(b.module.register_forward_hook(post))
    try:
        with torch.random.fork_rng(devices=[]), torch.enable_grad(), \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            torch.func.functional_call(model, state, meta_inputs, strict=False)
    finally:
        for h in handles:
            h.remove()
    missing = [blocks[i].name for i in range(len(blocks)) if i not in order]
    if missing:
        raise BlockError(f"blocks {missing} never run in the forward of the example input; the streaming "
                         "trainer needs every parameter block on the path")

    named = {n: state[n] for n in param_shapes}
    params: list[Param] = []
    ops: list[Op] = []
    prev: str | None = None
    for i in order:
        b = blocks[i]
        for pn in b.param_names:
            p = named[pn]
            mod_path = pn.rsplit(".", 1)[0]
            params.append(Param(pn, tuple(p.shape), DTYPE_BYTES.get(_dtype_name(p.dtype), p.element_size()),
                                module=mod_path, module_type=type(model.get_submodule(mod_path)).__name__))
        numel = sum(named[pn].numel() for pn in b.param_names)
        per = lambda v: -(-v // batch)  # noqa: E731  (ceil per window)
        ops.append(Op(b.name, "block", params=b.param_names, inputs=() if prev is None else (prev,),
                      output_bytes=per(out_bytes[i]), saved_bytes=per(sum(saved[i].values())),
                      workspace_bytes=per(out_bytes[i]),
                      flops=2 * numel * max(1, per(out_numel_per_ch[i])), module=b.name))
        prev = b.name
    input_bytes = -(-sum(_nbytes(t) for t in inputs if isinstance(t, torch.Tensor)) // batch)
    return Graph(tuple(ops), tuple(params), input_bytes=input_bytes, name=type(model).__name__)
