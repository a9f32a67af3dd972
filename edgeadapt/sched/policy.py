"""Update policies: which parameters, biases and output channels may change on the device.

A policy is a value (JSON round-trip, no torch). It is a list of rules matched in order against
module paths with shell-style patterns (``fnmatch``); the first matching rule decides the mode
of a module's own parameters, and modules no rule matches get ``default``::

    UpdatePolicy(rules=(Rule("head", "full"), Rule("blocks.3.conv", "channels", ratio=0.25)),
                 default="frozen")

A rule may name the module's parameters it decides (``params=("weight",)``, by their local
names); the others fall through to the next matching rule. So any per-parameter choice has a
rule form, e.g. a norm layer's weight trained without its bias::

    UpdatePolicy(rules=(Rule("blocks.0.bn", "full", params=("weight",)),))

Modes:
    frozen:   nothing changes.
    bias:     only the module's ``bias`` changes.
    full:     every parameter of the module changes.
    channels: a subset of output channels (axis 0) of every parameter the rule decides changes,
              given as explicit ``indices`` or as a ``ratio`` of channels picked by weight
              magnitude (largest L2 norm of the output channel's weights).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from enum import Enum
from typing import Any

__all__ = ["Mode", "Rule", "UpdatePolicy", "LAST_LAYER"]

# The pattern of :meth:`UpdatePolicy.last_layer` without a module: it stands for the model's final
# trainable layer, which resolving the policy over the model's graph finds
# (:func:`edgeadapt.sched.resolve.resolve_last_layer`); it matches no module path itself.
LAST_LAYER = "<last layer>"


class Mode(str, Enum):
    """How a parameter may change during adaptation."""

    FROZEN = "frozen"
    BIAS = "bias"
    FULL = "full"
    CHANNELS = "channels"


@dataclass(frozen=True)
class Rule:
    """Mode for the modules whose path matches ``pattern`` (and, if given, whose class is in ``types``).

    Attributes:
        pattern: ``fnmatch`` pattern over module paths, e.g. ``"head"``, ``"blocks.3.*"``, ``"*"``.
        mode: a :class:`Mode` or its string value.
        indices: for ``channels``: the output channels that train.
        ratio: for ``channels``: the fraction of output channels that train, in (0, 1].
        types: optional module class names the rule is restricted to, e.g. ``("BatchNorm1d",)``.
        params: optional local names of the module's parameters the rule decides, e.g.
            ``("weight",)``; the module's other parameters are left to later rules (``None``:
            every parameter of the module).
    """

    pattern: str
    mode: Mode | str
    indices: tuple[int, ...] | None = None
    ratio: float | None = None
    types: tuple[str, ...] | None = None
    params: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", Mode(self.mode))
        if self.indices is not None:
            object.__setattr__(self, "indices", tuple(int(i) for i in self.indices))
        if self.types is not None:
            object.__setattr__(self, "types", tuple(self.types))
        if self.params is not None:
            object.__setattr__(self, "params", tuple(self.params))
            if not self.params or not all(isinstance(n, str) and n and "." not in n for n in self.params):
                raise ValueError(f"rule {self.pattern!r}: params must be a non-empty list of local parameter names "
                                 f"such as 'weight' (no module path), got {list(self.params)}")
        if self.mode is Mode.CHANNELS:
            if (self.indices is None) == (self.ratio is None):
                raise ValueError(f"rule {self.pattern!r}: mode 'channels' needs exactly one of indices= or ratio=")
            if self.ratio is not None and not 0.0 < self.ratio <= 1.0:
                raise ValueError(f"rule {self.pattern!r}: ratio must be in (0, 1], got {self.ratio}")
            if self.indices is not None and (not self.indices or min(self.indices) < 0):
                raise ValueError(f"rule {self.pattern!r}: indices must be a non-empty list of channels >= 0")
        elif self.indices is not None or self.ratio is not None:
            raise ValueError(f"rule {self.pattern!r}: indices/ratio only apply to mode 'channels', "
                             f"not {self.mode.value!r}")

    def matches(self, module_path: str, module_type: str, param: str | None = None) -> bool:
        """Whether the rule decides parameter ``param`` (a local name) of the module at
        ``module_path``; with ``param=None``, whether it decides any of the module's parameters."""
        if self.types is not None and module_type not in self.types:
            return False
        if param is not None and self.params is not None and param not in self.params:
            return False
        return fnmatch.fnmatchcase(module_path, self.pattern)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"pattern": self.pattern, "mode": self.mode.value}
        if self.indices is not None:
            d["indices"] = list(self.indices)
        if self.ratio is not None:
            d["ratio"] = self.ratio
        if self.types is not None:
            d["types"] = list(self.types)
        if self.params is not None:
            d["params"] = list(self.params)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Rule:
        return cls(d["pattern"], d["mode"], d.get("indices"), d.get("ratio"), d.get("types"), d.get("params"))


NORM_TYPES = ("BatchNorm1d", "BatchNorm2d", "LayerNorm", "FrozenBatchNorm")


@dataclass(frozen=True)
class UpdatePolicy:
    """Ordered rules plus a default mode; see the module docstring."""

    rules: tuple[Rule, ...] = ()
    default: Mode | str = Mode.FROZEN

    def __post_init__(self) -> None:
        object.__setattr__(self, "rules", tuple(self.rules))
        object.__setattr__(self, "default", Mode(self.default))
        if self.default is Mode.CHANNELS:
            raise ValueError("the default mode cannot be 'channels'; give a rule with a pattern instead")

    # ---- common policies -------------------------------------------------------------
    @classmethod
    def full(cls) -> UpdatePolicy:
        """Every parameter trains (full fine-tuning)."""
        return cls(default=Mode.FULL)

    @classmethod
    def last_layer(cls, module: str | None = None) -> UpdatePolicy:
        """Only ``module`` trains; by default the model's final trainable layer (the module whose
        parameters lie nearest the output), found when the policy is resolved over the graph."""
        return cls(rules=(Rule(LAST_LAYER if module is None else module, Mode.FULL),))

    @classmethod
    def bias_and_norm(cls) -> UpdatePolicy:
        """Every bias plus the affine weights of normalisation layers (TinyTL / BitFit style)."""
        return cls(rules=(Rule("*", Mode.FULL, types=NORM_TYPES),), default=Mode.BIAS)

    @classmethod
    def sparse_channels(cls, modules: tuple[str, ...] | list[str], ratio: float, head: str = "head") -> UpdatePolicy:
        """The head trains fully; the given modules train a ``ratio`` of their output channels."""
        return cls(rules=(Rule(head, Mode.FULL), *(Rule(m, Mode.CHANNELS, ratio=ratio) for m in modules)))

    # ---- resolution ------------------------------------------------------------------
    @property
    def names_last_layer(self) -> bool:
        """Whether a rule stands for the model's last layer (:data:`LAST_LAYER`), still to be found."""
        return any(r.pattern == LAST_LAYER for r in self.rules)

    def with_last_layer(self, pattern: str) -> UpdatePolicy:
        """This policy with every :data:`LAST_LAYER` rule applied to the modules ``pattern`` matches."""
        rules = tuple(Rule(pattern, r.mode, r.indices, r.ratio, r.types, r.params) if r.pattern == LAST_LAYER else r
                      for r in self.rules)
        return UpdatePolicy(rules, self.default)

    def rule_for(self, module_path: str, module_type: str, param: str | None = None) -> Rule | None:
        """The first rule deciding parameter ``param`` (a local name such as ``"weight"``) of the
        module at ``module_path``; ``None``: the default applies. With ``param=None``, the
        first rule matching the module whatever parameters it names."""
        for rule in self.rules:
            if rule.matches(module_path, module_type, param):
                return rule
        return None

    def to_dict(self) -> dict[str, Any]:
        return {"rules": [r.to_dict() for r in self.rules], "default": self.default.value}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> UpdatePolicy:
        return cls(tuple(Rule.from_dict(r) for r in d.get("rules", ())), d.get("default", "frozen"))

    @classmethod
    def parse(cls, spec: str) -> UpdatePolicy:
        """Parse the command-line form.

        Named policies: ``full``, ``last-layer``, ``bias-norm``. Otherwise comma-separated
        ``pattern=mode`` items, where mode is ``frozen|bias|full|channels:RATIO|channels:I+J+K``;
        an item ``*=mode`` sets the default. ``pattern:P+Q=mode`` restricts the rule to the
        module's parameters named P and Q (local names). Example:
        ``head=full,blocks.3.conv=channels:0.25,blocks.0.bn:weight=full``.
        """
        named = {"full": cls.full, "last-layer": cls.last_layer, "bias-norm": cls.bias_and_norm}
        if spec in named:
            return named[spec]()
        rules, default = [], Mode.FROZEN
        for item in filter(None, (s.strip() for s in spec.split(","))):
            if "=" not in item:
                raise ValueError(
                    f"policy item {item!r} is not pattern=mode; use e.g. 'head=full' or one of {sorted(named)}"
                )
            pattern, mode = (s.strip() for s in item.split("=", 1))
            pattern, _, names = pattern.partition(":")
            params = tuple(names.split("+")) if names else None
            if mode.startswith("channels:"):
                arg = mode.split(":", 1)[1]
                if "+" in arg or arg.isdigit():
                    rules.append(Rule(pattern, Mode.CHANNELS, indices=tuple(int(i) for i in arg.split("+")),
                                      params=params))
                else:
                    rules.append(Rule(pattern, Mode.CHANNELS, ratio=float(arg), params=params))
            elif pattern == "*" and params is None:
                default = Mode(mode)
            else:
                rules.append(Rule(pattern, Mode(mode), params=params))
        return cls(tuple(rules), default)
