"""The trainer's two ways of running a step, behind one interface: in memory and streamed.

:class:`InMemorySteps` keeps the whole model, its gradients and ``torch.optim`` state in the
compute tier (the baseline, and what a model that fits uses); :class:`StreamedSteps` runs the
:class:`~edgeadapt.server.executor.StreamingExecutor`, with master weights and optimizer state
in the host or disk tier. The :class:`~edgeadapt.server.trainer.Trainer` drives either through
:class:`StepStrategy` (the forward, the loss and the micro-batches are its own), and reads and
writes their state through it (checkpoints, :meth:`Trainer.model`).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from typing import Protocol

import torch
from torch import nn

from ..optimizer_config import OptimizerConfig
from ..sched.errors import BudgetExceeded
from ..sched.plan import Plan
from ..units import format_bytes
from .executor import StreamingExecutor
from .residency import MemoryLedger, Residency
from .store import StateStore
from .trace import Block

__all__ = ["StepStrategy", "InMemorySteps", "StreamedSteps"]

BlockState = dict[str, dict[str, torch.Tensor]]


class StepStrategy(Protocol):
    """What the trainer needs of a way to run steps.

    A step of one micro-batch: :meth:`begin`, the model's forward and loss, :meth:`charge`,
    :meth:`before_backward`, ``loss.backward()``, :meth:`after_backward` (the update, after
    the last micro-batch), and :meth:`end` whatever happened.
    """

    lr: float

    @property
    def plan(self) -> Plan | None: ...
    def prepare(self, plan: Plan | None, micro_count: int) -> None: ...
    def begin(self, micro: int, micro_count: int, batch: list[torch.Tensor]) -> None: ...
    def charge(self, outside: list[torch.Tensor], outputs: list[torch.Tensor], loss: torch.Tensor,
               batch: list[torch.Tensor]) -> None: ...
    def before_backward(self) -> None: ...
    def blocks_updated(self) -> int: ...
    def after_backward(self) -> None: ...
    def end(self) -> None: ...
    def tracing(self) -> contextlib.AbstractContextManager: ...
    def block_state(self, index: int) -> BlockState: ...
    def set_block_state(self, index: int, state: BlockState) -> None: ...
    def block_residency(self) -> dict[str, str]: ...
    def tier_bytes(self) -> dict[str, int]: ...
    @property
    def optimizer_state_bytes(self) -> int: ...
    def model_copy(self) -> nn.Module: ...
    def close(self) -> None: ...


class InMemorySteps:
    """The whole model, its gradients and ``torch.optim`` (foreach) state in the compute tier.

    Raises:
        BudgetExceeded: weights, gradients and optimizer state alone exceed ``budget_bytes``.
    """

    def __init__(self, model: nn.Module, blocks: list[Block], spec: OptimizerConfig, ledger: MemoryLedger,
                 device: torch.device, *, budget_bytes: int | None, buffer_bytes: int,
                 reduce: Callable[[str, list[torch.Tensor]], None]):
        self.model, self.blocks, self.spec, self.ledger, self.reduce = model, blocks, spec, ledger, reduce
        model.to(device)
        params = [p for p in model.parameters()]
        if spec.name == "adamw":
            self.opt = torch.optim.AdamW(params, lr=spec.lr, betas=spec.betas, eps=spec.eps,
                                         weight_decay=spec.weight_decay, foreach=True)
        else:
            self.opt = torch.optim.SGD(params, lr=spec.lr, foreach=True)
        state_copies = 1 + len(spec.state_kinds)
        need = buffer_bytes + sum(4 * p.numel() for p in params) * (1 + state_copies)
        if budget_bytes is not None and need > budget_bytes:
            raise BudgetExceeded(
                need, budget_bytes, "in-memory training",
                detail=f"weights, gradients and {spec.name} state alone take {format_bytes(need)}; "
                       "use offload='host' or 'disk'")
        ledger.reserve("buffers", buffer_bytes)
        ledger.reserve("weights", sum(4 * p.numel() for p in params))
        ledger.reserve("optimizer", sum(4 * p.numel() for p in params) * len(spec.state_kinds))

    plan = None

    @property
    def lr(self) -> float:
        return self.opt.param_groups[0]["lr"]

    @lr.setter
    def lr(self, value: float) -> None:
        for g in self.opt.param_groups:
            g["lr"] = float(value)

    def prepare(self, plan: Plan | None, micro_count: int) -> None:
        pass

    def begin(self, micro: int, micro_count: int, batch: list[torch.Tensor]) -> None:
        pass

    def charge(self, outside: list[torch.Tensor], outputs: list[torch.Tensor], loss: torch.Tensor,
               batch: list[torch.Tensor]) -> None:
        """Charge what autograd saved and the outputs as activations (the parameters are weights,
        the batch's inputs and targets are the input)."""
        seen: dict[int, int] = {}
        charged_otherwise = {p.untyped_storage().data_ptr() for p in [*self.model.parameters(), *batch]}
        for t in outside + outputs:
            ptr = t.untyped_storage().data_ptr()
            if ptr and ptr not in charged_otherwise:
                seen[ptr] = t.untyped_storage().nbytes()
        self.ledger.reserve("activations", sum(seen.values()))

    def before_backward(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        self.ledger.reserve("grads", sum(4 * p.numel() for p in self.model.parameters()))

    def blocks_updated(self) -> int:
        return 0  # one optimizer step after the whole backward: a failed step applies nothing

    def after_backward(self) -> None:
        for b in self.blocks:
            grads = [p.grad for p in b.parameters() if p.grad is not None]
            self.reduce(b.name, grads)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def end(self) -> None:
        self.ledger.release("grads")
        self.ledger.release("activations")

    def tracing(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def block_state(self, index: int) -> BlockState:
        b = self.blocks[index]
        params = dict(zip(b.param_names, b.parameters()))
        out: BlockState = {"param": {n: p.detach().cpu().clone() for n, p in params.items()}}
        for k in self.spec.state_kinds:
            out[k] = {n: (self.opt.state[p][k].detach().cpu().clone() if p in self.opt.state
                          else torch.zeros_like(p, device="cpu")) for n, p in params.items()}
        out["steps"] = {n: torch.tensor(int(self.opt.state[p]["step"]) if p in self.opt.state
                                        and "step" in self.opt.state[p] else 0)
                        for n, p in params.items()}
        return out

    def set_block_state(self, index: int, state: BlockState) -> None:
        b = self.blocks[index]
        params = dict(zip(b.param_names, b.parameters()))
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(state["param"][n])
                steps = int(state["steps"][n])
                if self.spec.name == "adamw" and steps > 0:
                    self.opt.state[p] = {"step": torch.tensor(float(steps)),
                                         **{k: state[k][n].to(p.device).clone() for k in self.spec.state_kinds}}
                else:
                    self.opt.state.pop(p, None)

    def block_residency(self) -> dict[str, str]:
        return {b.name: Residency.RESIDENT.value for b in self.blocks}

    def tier_bytes(self) -> dict[str, int]:
        return {"host": 0, "disk": 0}

    @property
    def optimizer_state_bytes(self) -> int:
        return sum(4 * p.numel() for p in self.model.parameters()) * len(self.spec.state_kinds)

    def model_copy(self) -> nn.Module:
        return copy.deepcopy(self.model).cpu()

    def close(self) -> None:
        pass


class StreamedSteps:
    """Steps of the :class:`~edgeadapt.server.executor.StreamingExecutor`, state in ``store``.

    Args:
        executor: the installed executor.
        store: its master weights and optimizer state.
        sharding: ZeRO-1's :class:`~edgeadapt.server.zero.OptimizerSharding` (owners broadcast
            the updated weights after each step), or ``None``.
    """

    def __init__(self, model: nn.Module, blocks: list[Block], spec: OptimizerConfig, executor: StreamingExecutor,
                 store: StateStore, sharding=None):
        self.model, self.blocks, self.spec = model, blocks, spec
        self.executor, self.store, self.sharding = executor, store, sharding
        self.ledger = executor.ledger

    @property
    def plan(self) -> Plan | None:
        return self.executor.plan

    @property
    def lr(self) -> float:
        return self.executor.lr

    @lr.setter
    def lr(self, value: float) -> None:
        self.executor.lr = float(value)

    def prepare(self, plan: Plan | None, micro_count: int) -> None:
        self.executor.set_plan(plan)
        if micro_count > 1:
            self.store.add_accumulators()

    def begin(self, micro: int, micro_count: int, batch: list[torch.Tensor]) -> None:
        self.executor.begin_step(micro=micro, micro_count=micro_count)
        # the batch's inputs and targets are charged as the input, the buffers once as "buffers":
        # never as the activations of a block they are passed to, nor of the ops between blocks
        for t in [*batch, *self.model.buffers()]:
            self.executor.residency.mark_charged(t)

    def charge(self, outside: list[torch.Tensor], outputs: list[torch.Tensor], loss: torch.Tensor,
               batch: list[torch.Tensor]) -> None:
        """Charge what the ops between blocks saved, the outputs and the loss (each storage once;
        the batch was marked as charged by :meth:`begin`)."""
        self.executor.charge_activations("outside", outside + outputs + [loss])

    def before_backward(self) -> None:
        pass

    def blocks_updated(self) -> int:
        """Blocks whose optimizer update this step has handed out (applied, or being applied)."""
        return self.executor.updater.blocks_updated

    def after_backward(self) -> None:
        # the backward freed what the ops outside the blocks saved; then the root block's update
        self.ledger.release("activations:outside")
        self.executor.update_resident()
        if self.sharding is not None:  # ZeRO-1: owners send the updated weights
            self.sharding.broadcast_weights(self.executor)

    def end(self) -> None:
        self.executor.end_step()
        self.ledger.release("activations:outside")

    def tracing(self) -> contextlib.AbstractContextManager:
        return self.executor.uninstalled()

    def block_state(self, index: int) -> BlockState:
        b, slot = self.blocks[index], self.executor.slots[index]
        out: BlockState = {}
        for k in ("param", *self.spec.state_kinds):
            if not self.store.holds(index, k):
                continue
            flat = self.store.read(index, k).clone()
            out[k] = {n: v.clone() for n, v in zip(b.param_names, slot.views(flat))}
        out["steps"] = {n: torch.tensor(s) for n, s in zip(b.param_names, slot.steps)}
        return out

    def set_block_state(self, index: int, state: BlockState) -> None:
        b, slot = self.blocks[index], self.executor.slots[index]
        for k in ("param", *self.spec.state_kinds):
            if not self.store.holds(index, k):
                continue
            flat = torch.empty(slot.numel, dtype=torch.float32)
            for n, v in zip(b.param_names, slot.views(flat)):
                v.copy_(state[k][n])
            self.store.write(index, k, flat)
        slot.steps = [int(state["steps"][n]) for n in b.param_names]

    def block_residency(self) -> dict[str, str]:
        return {s.name: s.state.value for s in self.executor.slots}

    def tier_bytes(self) -> dict[str, int]:
        tiers = {"host": 0, "disk": 0}
        tiers[self.store.tier] = self.store.total_bytes
        return tiers

    @property
    def optimizer_state_bytes(self) -> int:
        return self.store.optimizer_state_bytes

    def model_copy(self) -> nn.Module:
        m = copy.deepcopy(self.model)
        if self.executor.root_hook_id is not None:
            m._forward_pre_hooks.pop(self.executor.root_hook_id, None)
        for b in self.blocks:
            if not b.resident:
                m.get_submodule(b.name).__dict__.pop("forward", None)
        for i, b in enumerate(self.blocks):
            slot = self.executor.slots[i]
            st = dict(zip(b.param_names, (v.clone() for v in slot.views(self.store.read(i, "param")))))
            for full, t in st.items():
                owner, _, leaf = full.rpartition(".")
                m.get_submodule(owner)._parameters[leaf] = nn.Parameter(t)
        return m.cpu()

    def close(self) -> None:
        self.executor.close()
        self.store.close()
