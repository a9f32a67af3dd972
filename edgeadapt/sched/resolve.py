"""A hand-written :class:`UpdatePolicy` becomes a :class:`Plan`.

Resolution is a pure decision over the graph IR: each parameter's module (``Param.module``,
``Param.module_type``) is matched against the policy's rules; the first matching rule (or the
default) decides the mode of that module's own parameters:

* ``frozen``: nothing trains;
* ``bias``: the module's ``bias`` parameter trains whole (planned as ``full``), the others stay frozen;
* ``full``: every parameter of the module trains;
* ``channels``: the selected output channels (axis 0) of every parameter of the module train;
  a ratio picks channels by the L2 norm of the module's weight (``weights`` must hold it), and a
  selection covering every channel trains the tensors whole.

The cut is the last op such that no op at or before it owns a trained parameter.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable

import numpy as np

from .ir import Graph, Param
from .plan import Mode, ParamPlan, Plan
from .policy import Rule, UpdatePolicy

__all__ = ["resolve_channels", "resolve_params", "resolve_param_list", "plan_from_policy", "first_trained_op", "cut_of", "trained_bytes"]


def resolve_channels(rule: Rule, module_path: str, weight: np.ndarray | None, n_out: int | None = None) -> tuple[int, ...]:
    """The sorted output channels that ``rule`` trains for a module.

    Args:
        rule: a ``channels`` rule (explicit ``indices`` or a ``ratio``).
        module_path: the module's path, for messages.
        weight: the module's weight (output channels on axis 0); needed for a ``ratio``, which
            keeps the channels of largest L2 norm (ties keep the lower index).
        n_out: output channels when ``weight`` is not given (explicit indices only).

    Raises:
        ValueError: indices out of range, or a ratio without the weight to rank channels by.
    """
    if weight is not None:
        n_out = int(weight.shape[0])
    if n_out is None:
        raise ValueError(f"policy rule {rule.pattern!r}: the number of output channels of {module_path} is unknown")
    if rule.indices is not None:
        bad = [i for i in rule.indices if i >= n_out]
        if bad:
            raise ValueError(
                f"policy rule {rule.pattern!r}: channels {bad} out of range for {module_path} "
                f"which has {n_out} output channels"
            )
        return tuple(sorted(set(rule.indices)))
    if weight is None:
        raise ValueError(
            f"policy rule {rule.pattern!r} picks a ratio of the channels of {module_path} by weight magnitude; "
            "pass weights={name: array} (the module's weight) or give explicit channel indices"
        )
    k = max(1, math.ceil(rule.ratio * n_out))
    norms = np.linalg.norm(np.asarray(weight, dtype=np.float64).reshape(n_out, -1), axis=1)
    # Stable sort on -norm: ties keep the lower index, so the choice is deterministic.
    return tuple(sorted(np.argsort(-norms, kind="stable")[:k].tolist()))


def _module_weight(members: list[Param], weights: dict[str, np.ndarray] | None) -> tuple[Param, np.ndarray | None]:
    ref = next((p for p in members if p.name.rsplit(".", 1)[-1] == "weight"), members[0])
    w = None if weights is None else weights.get(ref.name)
    return ref, None if w is None else np.asarray(w)


def resolve_param_list(params: Iterable[Param], policy: UpdatePolicy,
                       weights: dict[str, np.ndarray] | None = None) -> dict[str, ParamPlan]:
    """Parameter name -> :class:`ParamPlan` for ``params`` (see the module docstring).

    Raises:
        ValueError: a channel rule on a module whose parameters do not share the output-channel
            axis, indices out of range, or a ratio without weights.
    """
    by_module: dict[str, list[Param]] = defaultdict(list)
    for p in params:
        by_module[p.module].append(p)
    decided: dict[str, ParamPlan] = {}
    for module, members in by_module.items():
        rule = policy.rule_for(module, members[0].module_type)
        mode = rule.mode if rule is not None else policy.default
        channels = None
        if mode is Mode.CHANNELS:
            ref, w = _module_weight(members, weights)
            channels = resolve_channels(rule, module, w, ref.out_channels)
            if len(channels) == ref.out_channels:  # every channel trains: no frozen slice to split off
                mode = Mode.FULL
            else:
                for p in members:
                    if not p.shape or p.shape[0] != ref.out_channels:
                        raise ValueError(
                            f"policy rule {rule.pattern!r} trains output channels of {module}, but its "
                            f"parameter {p.name.rsplit('.', 1)[-1]!r} has shape {list(p.shape)} without "
                            f"{ref.out_channels} channels on axis 0; use mode 'full' or 'frozen' for this module"
                        )
        for p in members:
            if mode is Mode.FULL or (mode is Mode.BIAS and p.is_bias):
                decided[p.name] = ParamPlan(p.name, Mode.FULL)
            elif mode is Mode.CHANNELS:
                decided[p.name] = ParamPlan(p.name, Mode.CHANNELS, channels)
            else:
                decided[p.name] = ParamPlan(p.name, Mode.FROZEN)
    return decided


def resolve_params(graph: Graph, policy: UpdatePolicy, weights: dict[str, np.ndarray] | None = None) -> tuple[ParamPlan, ...]:
    """One :class:`ParamPlan` per graph parameter, in graph order (see :func:`resolve_param_list`)."""
    decided = resolve_param_list(graph.params, policy, weights)
    return tuple(decided[p.name] for p in graph.params)


def first_trained_op(graph: Graph, params: tuple[ParamPlan, ...] | dict[str, ParamPlan]) -> int | None:
    """Index of the earliest op owning a trained parameter; ``None`` when nothing trains."""
    items = params.values() if isinstance(params, dict) else params
    owners = [graph.owner_index(p.name) for p in items if p.trains]
    return min(owners) if owners else None


def cut_of(graph: Graph, params: tuple[ParamPlan, ...]) -> int:
    """The last op index such that no op at or before it owns a trained parameter (-1: op 0 trains).

    When nothing trains the whole graph is the prefix (``len(ops) - 1``).
    """
    first = first_trained_op(graph, params)
    return len(graph.ops) - 1 if first is None else first - 1


def trained_numel(param: Param, plan: ParamPlan) -> int:
    if not plan.trains:
        return 0
    if plan.mode is Mode.CHANNELS:
        return param.numel // max(1, param.out_channels) * len(plan.channels)
    return param.numel


def trained_bytes(graph: Graph, params: tuple[ParamPlan, ...]) -> int:
    """Bytes of the trained elements (channel subsets count only their slice)."""
    return sum(trained_numel(graph.param(p.name), p) * graph.param(p.name).dtype_bytes for p in params)


def plan_from_policy(graph: Graph, policy: UpdatePolicy, *, weights: dict[str, np.ndarray] | None = None,
                     batch_windows: int = 32, micro_batch_windows: int | None = None, n_windows: int = 128,
                     optimizer: str = "adamw", cache_features: bool = False) -> Plan:
    """Resolve ``policy`` over ``graph`` into an unverified :class:`Plan` (no budget, no prediction).

    Args:
        graph: the model's IR.
        policy: the hand-written update policy.
        weights: parameter name -> array, needed only for ``channels`` rules given as a ratio.
        batch_windows: windows per optimizer step.
        micro_batch_windows: windows per forward/backward (default: the whole batch).
        n_windows: adaptation windows the plan is made for.
        optimizer: ``"adamw"`` or ``"sgd"``.
        cache_features: run the frozen prefix once per call and cache its output.

    Raises:
        ValueError: the policy trains nothing in this graph (the message lists module paths),
            or a rule cannot be resolved.
    """
    params = resolve_params(graph, policy, weights)
    if not any(p.trains for p in params):
        modules = sorted({p.module for p in graph.params})
        raise ValueError(
            f"the update policy trains no parameter of {graph.name!r}; check the rule patterns against "
            f"the module paths (e.g. {modules[:6]})"
        )
    return Plan(graph=graph.name, params=params, cut=cut_of(graph, params), batch_windows=batch_windows,
                micro_batch_windows=micro_batch_windows or batch_windows, n_windows=n_windows,
                cache_features=cache_features, optimizer=optimizer, policy=policy.to_dict())
