"""The streaming executor's autograd wiring: each streamed block's call as one autograd node.

:class:`BlockWiring` routes each block's ``forward`` through one ``torch.autograd.Function``
(``install``) and the root block's parameters through a forward pre-hook on the model:

* **forward**: the block's weights are made resident (:class:`~edgeadapt.server.coordinator.ResidencyCoordinator`),
  the block runs on them, and the weights are released. With ``keep`` the block's autograd
  graph is kept (its weights' storage is freed and brought back for backward, so saved views
  stay valid); with ``recompute`` it runs without a graph and only its inputs are kept.
* **backward**: the weights come back, the block's gradient is computed (re-running its
  forward from the saved input first, with the same random numbers, when recomputed), and the
  gradient goes to the :class:`~edgeadapt.server.updater.BlockUpdater`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn
from torch.nn.utils.stateless import _reparametrize_module

from ..sched.plan import Plan
from .coordinator import BlockSlot, ResidencyCoordinator, bind_parameters, storage_ptr
from .residency import LOSS_KEY, Residency
from .trace import nested_tensors
from .updater import BlockUpdater

__all__ = ["BlockWiring"]

CLOSED_MODEL = ("this model was taken over by a Trainer that was closed (Trainer.close(), or the end of its 'with' "
                "block), which dropped its weights, so the model cannot run any more; take a copy with "
                "Trainer.model() (or outputs with Trainer.predict) before closing the trainer, or build the model "
                "again and continue from a checkpoint with Trainer.resume")


class _BlockFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, runner, anchor, *inputs):  # noqa: D401 - autograd protocol
        return runner.forward(ctx, inputs)

    @staticmethod
    def backward(ctx, *grads):
        return (None, None, *ctx.runner.backward(ctx, grads))


class BlockWiring:
    """Installs the blocks' autograd nodes and the root block's pre-hook on a model.

    Args:
        slots: the blocks' slots.
        residency: brings the blocks' weights in and out.
        updater: takes each block's gradients.
    """

    def __init__(self, slots: list[BlockSlot], residency: ResidencyCoordinator, updater: BlockUpdater):
        self.slots, self.residency, self.updater = slots, residency, updater
        self.ledger = residency.ledger
        self.resident_slots = [s for s in slots if s.resident]
        self.recompute: set[int] = set()
        self._root_hook = None
        self._root_module: nn.Module | None = None
        self._hooks_on = True
        self._originals: dict[int, Callable] = {}
        self._ran: set[int] = set()
        self._act_keys: dict[int, set[int]] = {}
        self.in_step = False  # between begin_step and end_step (a trainer step, or Trainer.predict)
        self._anchor = torch.zeros((), requires_grad=True)

    def set_plan(self, plan: Plan) -> None:
        """Adopt the plan's recomputed blocks."""
        self.recompute = {self.residency.index_of(n) for n in plan.recomputed}

    def install(self) -> None:
        """Route each block's calls through its autograd node and drop its own parameter storage;
        the root block's parameters are brought in by a forward pre-hook on the model."""
        for s in self.slots:
            if s.index in self._originals:
                continue
            mod = s.module
            self._originals[s.index] = type(mod).forward.__get__(mod)
            placeholders = [nn.Parameter(torch.empty(0), requires_grad=True) for _ in s.local_names]
            bind_parameters(mod, s.local_names, placeholders)
            if s.resident:
                s.placeholders = placeholders
                if self._root_hook is None:
                    wiring = self

                    def root_pre_hook(module, args):  # a plain function: a deepcopy of the model shares it
                        wiring.load_resident()

                    self._root_hook = mod.register_forward_pre_hook(root_pre_hook)
                    self._root_module = mod
            else:
                mod.forward = self._make_forward(s)

    @property
    def root_hook_id(self) -> int | None:
        """The id of the model's forward pre-hook (to remove it from a copy of the model)."""
        return None if self._root_hook is None else self._root_hook.id

    @contextlib.contextmanager
    def uninstalled(self):
        """The blocks' own forwards for the body (a shape trace of the model), the root hook off."""
        patched = {s.index: s.module.__dict__.pop("forward") for s in self.slots if "forward" in s.module.__dict__}
        self._hooks_on = False
        try:
            yield
        finally:
            self._hooks_on = True
            for s in self.slots:
                if s.index in patched:
                    s.module.forward = patched[s.index]

    def remove_root_hook(self) -> None:
        if self._root_hook is not None:
            self._root_hook.remove()
            self._root_hook = None

    def close(self) -> None:
        """The trainer is closed and the blocks' weights are gone: from now on a call of the taken-over
        model (or of one of its streamed blocks) raises ``RuntimeError`` saying so, instead of failing
        inside the closed store; the model no longer refers to this wiring."""
        def closed(*args, **kwargs):
            raise RuntimeError(CLOSED_MODEL)

        self.remove_root_hook()
        if self._root_module is not None:
            self._root_hook = self._root_module.register_forward_pre_hook(lambda module, args: closed())
        for s in self.slots:
            if "forward" in s.module.__dict__:
                s.module.forward = closed

    # ---- the root block ---------------------------------------------------------------------
    def load_resident(self) -> None:
        """Bring the root block in for the step (the model's forward pre-hook): its weights and,
        with gradients enabled, the reservation of its gradients, held until
        :meth:`update_resident` (or :meth:`end_step`)."""
        if not self._hooks_on:
            return
        for s in self.resident_slots:
            self.check_in_step(s.name)
        grad = torch.is_grad_enabled()
        for s in self.resident_slots:
            if s.state is Residency.RESIDENT:
                continue  # a second forward in the same step: the gradients accumulate
            if grad:
                self.ledger.reserve(f"grads:{s.name}", s.weight_bytes)
            try:
                self.residency.acquire(s.index)
            except BaseException:
                self.ledger.release(f"grads:{s.name}")
                raise
            if not grad:
                s.leaves = [v.detach() for v in s.leaves]
            # autograd keeps these leaves for backward: they are charged as weights, not activations
            self.residency.mark_charged(s.flat)
            bind_parameters(s.module, s.local_names, s.leaves)

    def update_resident(self) -> None:
        """After the backward: reduce and update the root block with the gradient accumulated over
        the step, then release its weights (the gradients' reservation goes with the update)."""
        for s in self.resident_slots:
            if s.state is not Residency.RESIDENT or s.leaves is None:
                continue
            grads = [v.grad for v in s.leaves]
            for v in s.leaves:
                v.grad = None
            self.residency.release(s.index)
            if all(g is None for g in grads):
                self.ledger.release(f"grads:{s.name}")
                continue
            self.updater.update(s, grads)  # owns the gradients' reservation from here on
            del grads

    # ---- the step ---------------------------------------------------------------------------
    def begin_step(self) -> None:
        self._ran.clear()
        self._act_keys.clear()
        self.in_step = True

    def end_step(self) -> None:
        """Release what a step left behind: the root block's gradients of a step that failed
        before :meth:`update_resident`, and the activations of blocks whose backward did not run."""
        for s in self.resident_slots:
            self.ledger.release(f"grads:{s.name}")
        for k in list(self._act_keys):
            self.ledger.release(f"activations:{self.slots[k].name}")
        self._act_keys.clear()
        self.in_step = False

    def check_in_step(self, name: str) -> None:
        """Refuse a call of the taken-over model with gradients on outside a trainer step."""
        if torch.is_grad_enabled() and not self.in_step:
            raise RuntimeError(f"block {name!r} was called with gradients on outside Trainer.step: the trainer has "
                               "taken this model over and its backward would update the weights. Train with "
                               "Trainer.step, predict with Trainer.predict (or under torch.no_grad()), or work on "
                               "a copy from Trainer.model()")

    def _make_forward(self, slot: BlockSlot):
        def forward(*args, **kwargs):
            return self._call_block(slot, args, kwargs)
        return forward

    def _call_block(self, slot: BlockSlot, args: tuple, kwargs: dict):
        if not torch.is_grad_enabled():  # inference (Trainer.predict): stream the weights, keep nothing
            self.residency.acquire_in_order(slot.index, backward=False)
            try:
                return self.run(slot, args, kwargs, [v.detach() for v in slot.leaves])
            finally:
                self.residency.release(slot.index)
        self.check_in_step(slot.name)
        if slot.index in self._ran:
            raise RuntimeError(f"block {slot.name!r} ran twice in one step; the streaming trainer updates each "
                               "block once per step, so a block may be called only once per forward")
        self._ran.add(slot.index)
        tensor_pos = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        hidden = [t for i, a in enumerate(args) if i not in tensor_pos for t in nested_tensors(a)]
        hidden += [t for v in kwargs.values() for t in nested_tensors(v)]
        if any(t.requires_grad for t in hidden):
            raise TypeError(f"block {slot.name!r} is called with a tensor that needs a gradient inside a keyword "
                            "argument or a container; the streaming trainer passes gradients through positional "
                            "tensor arguments only, so pass it positionally")
        # the call holds its arguments until the block's backward (to run it, or to recompute it): an
        # argument the model's own code made (not a block's output, the batch or a weight) is
        # charged with what that code saved
        self.residency.charge_activations("outside", [args[i] for i in tensor_pos] + hidden)
        runner = _Call(self, slot, args, kwargs, tensor_pos)
        # the anchor requires grad so that the block's backward runs even when no input needs a
        # gradient (the first block): the block's parameters are not inputs of the Function
        outs = _BlockFn.apply(runner, self._anchor, *[args[i] for i in tensor_pos])
        return outs[0] if runner.single else outs

    def run(self, slot: BlockSlot, args: tuple, kwargs: dict, params: list[torch.Tensor],
            buffers: dict[str, torch.Tensor] | None = None):
        """The block's own forward on ``params`` (and ``buffers``) in place of its parameters."""
        mapping = dict(zip(slot.local_names, params))
        if buffers:
            mapping.update(buffers)
        with _reparametrize_module(slot.module, mapping, strict=False):
            return self._originals[slot.index](*args, **kwargs)


class _Call:
    """One call of one block: carries state from the autograd forward to its backward."""

    def __init__(self, wiring: BlockWiring, slot: BlockSlot, args: tuple, kwargs: dict, tensor_pos: list[int]):
        self.wiring, self.slot, self.args, self.kwargs, self.tensor_pos = wiring, slot, args, kwargs, tensor_pos
        self.single = True

    def _args_with(self, tensors) -> tuple:
        args = list(self.args)
        for i, t in zip(self.tensor_pos, tensors):
            args[i] = t
        return tuple(args)

    def forward(self, ctx, inputs: tuple[torch.Tensor, ...]):
        w, slot = self.wiring, self.slot
        res = w.residency
        ctx.runner = self
        res.acquire_in_order(slot.index, backward=False)
        self.recompute = slot.index in w.recompute
        if self.recompute:
            self.rng = _rng_state(res.device)
            with torch.no_grad():
                out = w.run(slot, self._args_with(inputs), self.kwargs, slot.leaves)
            self.inputs = inputs
            outs = _as_tuple(out)
            res.charge_activations(slot.name, list(outs))
            res.release(slot.index)
        else:
            xs = [t.detach().requires_grad_(t.requires_grad or ctx.needs_input_grad[2 + j])
                  if t.is_floating_point() else t.detach() for j, t in enumerate(inputs)]
            saved: list[torch.Tensor] = []
            skip = {storage_ptr(slot.flat)} | {storage_ptr(t) for t in inputs}
            skip |= {storage_ptr(b) for b in slot.module.buffers()}

            def pack(t):
                if storage_ptr(t) not in skip:
                    saved.append(t)
                return t

            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = w.run(slot, self._args_with(xs), self.kwargs, slot.leaves)
            outs = _as_tuple(out)
            self.xs, self.inner = xs, outs
            res.charge_activations(slot.name, saved + list(outs))
            res.release(slot.index, keep_storage_object=True)
        self.single = isinstance(out, torch.Tensor)
        w._act_keys.setdefault(slot.index, set())
        result = tuple(o.detach() for o in outs)
        nondiff = [o for o in result if not o.is_floating_point()]
        if nondiff:
            ctx.mark_non_differentiable(*nondiff)
        return result

    def backward(self, ctx, grads):
        w, slot = self.wiring, self.slot
        res = w.residency
        w.ledger.release(LOSS_KEY)  # the loss's backward is over once a block's backward starts
        res.acquire_in_order(slot.index, backward=True)
        need_in = [bool(n) for n in ctx.needs_input_grad[2:]]
        if self.recompute:
            xs = [t.detach().requires_grad_(need) if t.is_floating_point() else t.detach()
                  for t, need in zip(self.inputs, need_in)]
            buffers = {n: b.clone() for n, b in slot.module.named_buffers()}
            with _fork_rng(res.device, self.rng), torch.enable_grad():
                outs = _as_tuple(w.run(slot, self._args_with(xs), self.kwargs, slot.leaves, buffers))
            self.inputs = None
        else:
            xs, outs = self.xs, self.inner
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
        wrt_in = [x for x, need in zip(xs, need_in) if need and x.requires_grad]
        w.updater.before_gradients()
        w.ledger.reserve(f"grads:{slot.name}", slot.weight_bytes)
        try:
            if pairs:
                got = torch.autograd.grad([o for o, _ in pairs], slot.leaves + wrt_in, [g for _, g in pairs],
                                          allow_unused=True)
            else:
                got = (None,) * (len(slot.leaves) + len(wrt_in))
            del pairs, outs
            self.xs = self.inner = None
            pgrads, igrads = list(got[:len(slot.leaves)]), list(got[len(slot.leaves):])
            del got
            res.release(slot.index)
            w.ledger.release(f"activations:{slot.name}")
            w._act_keys.pop(slot.index, None)
        except BaseException:
            w.ledger.release(f"grads:{slot.name}")
            raise
        w.updater.update(slot, pgrads)  # owns the gradients' reservation from here on
        del pgrads
        it = iter(igrads)
        return tuple(next(it) if need and x.requires_grad else None for x, need in zip(xs, need_in))


def _as_tuple(out) -> tuple[torch.Tensor, ...]:
    if isinstance(out, torch.Tensor):
        return (out,)
    if isinstance(out, (tuple, list)) and all(isinstance(o, torch.Tensor) for o in out):
        return tuple(out)
    raise TypeError(f"a streamed block must return a tensor or a tuple of tensors, got {type(out).__name__}")


def _rng_state(device: torch.device):
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


@contextlib.contextmanager
def _fork_rng(device: torch.device, state):
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], device)
        yield
