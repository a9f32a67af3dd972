"""Structured update policies: the shapes a selection can take besides the importance ranking's.

The planner's selection (:mod:`.select`) maximises a sum of per-unit importances, which assumes
that the benefits of training two units add up. Adapting to a new person does not behave that
way: one trained layer often recovers most of what can be recovered and training every layer
over-fits the few windows there are. A validated selection therefore compares whole policies
(see ``edgeadapt.harness.validated_selection``); this module lists the structured ones, the same
for any graph, in the module order of the graph:

* ``only:M`` — module ``M`` alone;
* ``last+M`` — the last layer plus ``M``;
* ``last+M@R`` — the last layer plus a fraction ``R`` of ``M``'s output channels (by weight
  magnitude), for modules whose weight has channel groups;
* ``from:M`` — ``M`` and every trainable module after it.

Pure planning: no torch, no tensors.
"""

from __future__ import annotations

from .ir import Graph
from .policy import Mode, Rule, UpdatePolicy
from .resolve import module_pattern, last_layer_modules

__all__ = ["trainable_modules", "structured_policies"]


def trainable_modules(graph: Graph) -> list[str]:
    """Module paths owning a parameter that can train (its gradient is not blocked), in op order."""
    blocked = graph.gradient_blocked()
    seen: list[str] = []
    for op in graph.ops:
        for name in op.params:
            module = graph.param(name).module
            if name not in blocked and module not in seen:
                seen.append(module)
    return seen


def _channel_module(graph: Graph, module: str, min_channels: int) -> bool:
    """Whether ``module``'s weight has at least ``min_channels`` output channels and more than one axis."""
    return any(len(p.shape) >= 2 and p.out_channels >= min_channels
               for p in graph.params if p.module == module)


def structured_policies(graph: Graph, channel_ratio: float = 0.25,
                        min_channels: int = 16) -> dict[str, UpdatePolicy]:
    """Label -> policy for every structured shape of the module docstring, without duplicates.

    Args:
        graph: the model's IR.
        channel_ratio: the fraction of output channels of the ``last+M@R`` shapes.
        min_channels: smallest output-channel count for which a ``last+M@R`` shape is listed.

    Raises:
        ValueError: ``channel_ratio`` outside (0, 1) or a graph with nothing to train.
    """
    if not 0.0 < channel_ratio < 1.0:
        raise ValueError(f"channel_ratio must be in (0, 1), got {channel_ratio}")
    modules = trainable_modules(graph)
    if not modules:
        raise ValueError(f"{graph.name!r} has no parameter that can train")
    last = [m for m in last_layer_modules(graph) if m in modules]

    def full(*names: str) -> tuple[Rule, ...]:
        return tuple(Rule(module_pattern(m), Mode.FULL) for m in names)

    last_rules = full(*last)

    out: dict[str, UpdatePolicy] = {}
    seen: set[tuple] = set()

    def add(label: str, rules: tuple[Rule, ...]) -> None:
        key = tuple(sorted((r.pattern, r.mode.value, r.ratio or 0.0) for r in rules))
        if key not in seen:
            seen.add(key)
            out[label] = UpdatePolicy(rules, Mode.FROZEN)

    for m in modules:
        add(f"only:{m}", full(m))
    for m in modules:
        if m not in last:
            add(f"last+{m}", last_rules + full(m))
    for m in modules:
        if m not in last and _channel_module(graph, m, min_channels):
            part = Rule(module_pattern(m), Mode.CHANNELS, ratio=channel_ratio)
            add(f"last+{m}@{channel_ratio:g}", last_rules + (part,))
    for i, m in enumerate(modules):
        add(f"from:{m}", full(*modules[i:]))
    return out
