"""A hand-written :class:`UpdatePolicy` becomes a :class:`Plan`.

Resolution is a pure decision over the graph IR: each parameter's module (``Param.module``,
``Param.module_type``) and local name are matched against the policy's rules; the first rule
that decides it (or the default) gives its mode:

* ``frozen``: it does not train;
* ``bias``: it trains whole (planned as ``full``) if it is the module's ``bias``, else it is frozen;
* ``full``: it trains;
* ``channels``: its selected output channels (axis 0) train; a ratio picks channels by the L2
  norm of the module's weight (of a rule naming parameters: of the weight if it names it, else
  of the first it names; ``weights`` must hold it), and a selection covering every channel
  trains the tensors whole.

:func:`policy_of_plan` is the inverse: rules that resolve to exactly a plan's per-parameter
decisions.

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

__all__ = ["module_pattern", "resolve_channels", "resolve_params", "resolve_param_list", "plan_from_policy",
           "policy_of_plan", "first_trained_op", "cut_of", "trained_bytes", "last_layer_modules", "resolve_last_layer"]


def resolve_channels(rule: Rule, module_path: str, weight: np.ndarray | None,
                     n_out: int | None = None) -> tuple[int, ...]:
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
        by_rule: dict[int, list[Param]] = defaultdict(list)  # rule index (-1: the default) -> its parameters
        rules: dict[int, Rule | None] = {-1: None}
        for p in members:
            rule = policy.rule_for(module, p.module_type, _local_name(p))
            key = -1 if rule is None else policy.rules.index(rule)
            rules[key] = rule
            by_rule[key].append(p)
        for key, decides in by_rule.items():
            rule = rules[key]
            mode = rule.mode if rule is not None else policy.default
            channels = None
            if mode is Mode.CHANNELS:  # a rule naming parameters ranks channels by one of them
                ref, w = _module_weight(members if rule.params is None else decides, weights)
                channels = resolve_channels(rule, module, w, ref.out_channels)
                if len(channels) == ref.out_channels:  # every channel trains: no frozen slice to split off
                    mode = Mode.FULL
                else:
                    for p in decides:
                        if not p.shape or p.shape[0] != ref.out_channels:
                            raise ValueError(
                                f"policy rule {rule.pattern!r} trains output channels of {module}, but its "
                                f"parameter {_local_name(p)!r} has shape {list(p.shape)} without "
                                f"{ref.out_channels} channels on axis 0; use mode 'full' or 'frozen' for it"
                            )
            for p in decides:
                if mode is Mode.FULL or (mode is Mode.BIAS and p.is_bias):
                    decided[p.name] = ParamPlan(p.name, Mode.FULL)
                elif mode is Mode.CHANNELS:
                    decided[p.name] = ParamPlan(p.name, Mode.CHANNELS, channels)
                else:
                    decided[p.name] = ParamPlan(p.name, Mode.FROZEN)
    return decided


def _local_name(param: Param) -> str:
    """The parameter's name within its module (``"weight"`` for ``"blocks.0.bn.weight"``)."""
    return param.name.rsplit(".", 1)[-1]


def module_pattern(module: str) -> str:
    """An ``fnmatch`` pattern matching exactly the module path ``module``."""
    return "".join(f"[{c}]" if c in "*?[" else c for c in module)


def policy_of_plan(graph: Graph, plan: Plan) -> UpdatePolicy:
    """Rules (exact module paths, explicit channels) that resolve over ``graph`` to exactly the
    plan's per-parameter decisions.

    A module whose parameters share one decision gets one rule (``full``, ``bias`` when only its
    bias trains, or ``channels`` with the trained indices); otherwise each decision gets a rule
    naming the parameters it applies to, so any choice the planner makes has a rule form.
    """
    by_module: dict[str, list[tuple[Param, ParamPlan]]] = defaultdict(list)
    for pp in plan.params:
        param = graph.param(pp.name)
        by_module[param.module].append((param, pp))
    rules = []
    for module, members in by_module.items():
        pattern = module_pattern(module)
        trained = [(p, pp) for p, pp in members if pp.trains]
        if not trained:
            continue
        # One rule per decision; channel subsets apply to parameters of one output-channel count.
        by_decision: dict[tuple, list[str]] = defaultdict(list)
        for p, pp in trained:
            by_decision[(pp.mode, pp.channels, p.out_channels if pp.channels else None)].append(_local_name(p))
        if len(trained) == len(members) and len(by_decision) == 1:
            (mode, channels, _), = by_decision
            rules.append(Rule(pattern, mode, indices=channels))
        elif [p for p, _ in trained] == [p for p, _ in members if p.is_bias] and \
                all(pp.mode is Mode.FULL for _, pp in trained):
            rules.append(Rule(pattern, Mode.BIAS))
        else:
            rules += [Rule(pattern, mode, indices=channels, params=tuple(names))
                      for (mode, channels, _), names in by_decision.items()]
    return UpdatePolicy(tuple(rules), Mode.FROZEN)


def last_layer_modules(graph: Graph) -> list[str]:
    """The modules whose parameters lie nearest the output: walking back from every op whose output
    no op reads, through ops that own no parameter (activations, pooling, reshapes), the first
    parameter-owning op on each path. One module for a plain classifier; several when separate
    layers feed the output (parallel heads, a residual around the last layer)."""
    consumed = {src for op in graph.ops for src in op.inputs}
    stack = [i for i, op in enumerate(graph.ops) if op.name not in consumed]
    seen: set[int] = set()
    modules: set[str] = set()
    while stack:
        i = stack.pop()
        if i in seen:
            continue
        seen.add(i)
        op = graph.ops[i]
        if op.params:
            modules.update(graph.param(p).module for p in op.params)
        else:
            stack.extend(graph.op_index(src) for src in op.inputs)
    return sorted(modules)


def resolve_last_layer(graph: Graph, policy: UpdatePolicy) -> UpdatePolicy:
    """``policy`` with its last-layer rule (``UpdatePolicy.last_layer()``) applied to the model's
    final trainable layer (:func:`last_layer_modules`); other policies are returned unchanged.

    Raises:
        ValueError: the graph has no single last layer; names the rule to write instead.
    """
    if not policy.names_last_layer:
        return policy
    modules = last_layer_modules(graph)
    if len(modules) == 1:
        return policy.with_last_layer(module_pattern(modules[0]))
    if not modules:
        raise ValueError(f"the last-layer policy finds no parameter of {graph.name!r} on the way back from its "
                         f"output; name the layer to train, e.g. --policy 'NAME=full' (a module path)")
    named = ", ".join(repr(m) for m in modules)
    raise ValueError(f"the last-layer policy cannot tell the last layer of {graph.name!r}: {named} all feed the "
                     f"output; name it, e.g. --policy '{modules[-1]}=full' (or '{modules[0]}=full,{modules[-1]}=full'; "
                     f"in Python UpdatePolicy.last_layer({modules[-1]!r}))")


def resolve_params(graph: Graph, policy: UpdatePolicy,
                   weights: dict[str, np.ndarray] | None = None) -> tuple[ParamPlan, ...]:
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
    policy = resolve_last_layer(graph, policy)
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
