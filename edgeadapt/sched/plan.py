"""The ``Plan``: what the scheduler decided, as one immutable, JSON-round-tripping value.

The plan is the contract between the planner and the executors: policies return plans,
:func:`edgeadapt.sched.verify` re-derives their peak independently, and executors (the
on-device runner, the server's streaming trainer) carry them out without re-deciding.

A plan says, for every parameter, how it may change (:class:`Mode`) and where its master copy
lives (:class:`Tier`); for every saved activation, whether it is kept or recomputed
(:class:`Action`); where the frozen prefix ends (``cut``); how many windows a micro-batch
holds; and what the planner predicts the peak to be, and where in the step it occurs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from .policy import Mode

__all__ = ["Mode", "Tier", "Action", "UpdateOverlap", "ParamPlan", "Peak", "Plan", "PLAN_VERSION"]

PLAN_VERSION = 1


class Tier(str, Enum):
    """Where a parameter's master copy (and its gradient and optimizer state) lives."""

    COMPUTE = "compute"
    HOST = "host"
    DISK = "disk"


class UpdateOverlap(str, Enum):
    """How far a streamed block's optimizer update (server) runs beside the next block's backward.

    ``BACKWARD``: through the whole next backward (two blocks' gradients are held at once);
    ``RECOMPUTE``: while the next block's weights come in and its activations are recomputed,
    finishing before its gradients exist; ``NONE``: before the next block starts.
    """

    BACKWARD = "backward"
    RECOMPUTE = "recompute"
    NONE = "none"


class Action(str, Enum):
    """What happens to an activation saved for backward."""

    KEEP = "keep"
    RECOMPUTE = "recompute"
    OFFLOAD = "offload"


@dataclass(frozen=True)
class ParamPlan:
    """The decision for one parameter.

    Attributes:
        name: the source parameter name (``Graph.params``).
        mode: frozen / bias / full / channels (bias applies to the module's bias parameter,
            which is then planned as ``full``; ``bias`` is kept for reporting the rule).
        channels: for ``channels``: the sorted output channels that train.
        tier: where the master copy lives.
    """

    name: str
    mode: Mode
    channels: tuple[int, ...] | None = None
    tier: Tier = Tier.COMPUTE

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", Mode(self.mode))
        object.__setattr__(self, "tier", Tier(self.tier))
        if self.channels is not None:
            object.__setattr__(self, "channels", tuple(int(c) for c in self.channels))
        if (self.mode is Mode.CHANNELS) != (self.channels is not None):
            raise ValueError(f"parameter {self.name!r}: channels are given exactly when the mode is 'channels'")
        if self.channels is not None and (not self.channels or list(self.channels) != sorted(set(self.channels))
                                          or self.channels[0] < 0):
            raise ValueError(f"parameter {self.name!r}: channels must be sorted, unique and >= 0")

    @property
    def trains(self) -> bool:
        return self.mode is not Mode.FROZEN

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"name": self.name, "mode": self.mode.value, "tier": self.tier.value}
        if self.channels is not None:
            d["channels"] = list(self.channels)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ParamPlan:
        ch = d.get("channels")
        return cls(d["name"], d["mode"], None if ch is None else tuple(ch), d.get("tier", "compute"))


@dataclass(frozen=True)
class Peak:
    """A predicted (or verified) memory peak.

    Attributes:
        peak_bytes: the largest total over the span.
        where: the position of the peak (e.g. ``"backward:blocks.3.conv"``, ``"features:prefix"``).
        phases_bytes: the largest total per phase (``"load"``, ``"features"``, ``"forward"``,
            ``"backward"``, ``"optimizer"``, ``"rollback"``...), for reports and timelines.
    """

    peak_bytes: int
    where: str
    phases_bytes: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"peak_bytes": self.peak_bytes, "where": self.where, "phases_bytes": dict(self.phases_bytes)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Peak:
        return cls(int(d["peak_bytes"]), str(d["where"]), {k: int(v) for k, v in d.get("phases_bytes", {}).items()})


@dataclass(frozen=True)
class Plan:
    """Everything an executor needs to carry out one training configuration under a budget.

    Attributes:
        graph: the name of the :class:`~edgeadapt.sched.ir.Graph` it was made for.
        params: one :class:`ParamPlan` per graph parameter, in graph order.
        cut: index of the last op of the frozen prefix (no op up to it owns a trained
            parameter and nothing before it needs a gradient); ``-1``: no frozen prefix.
        batch_windows: windows per optimizer step.
        micro_batch_windows: windows per forward/backward; gradients are accumulated over
            ``ceil(batch / micro)`` micro-batches inside one step.
        n_windows: adaptation windows the plan was made for (feature cache size).
        cache_features: compute the prefix's output once per call and train the suffix on it.
        activations: per op name with saved activations after the cut: keep or recompute.
        order: execution / prefetch order of blocks (server); empty on the device.
        prefetch_depth: blocks brought in ahead of use (server).
        update_chunk_numel: elements per chunk of the staged optimizer update (server); ``None``
            on the device.
        update_overlap: how far each block's optimizer update runs beside the next block's
            backward (server; :class:`UpdateOverlap`, the whole backward by default: the
            fastest).
        optimizer: ``"adamw"`` or ``"sgd"`` (decides optimizer-state bytes).
        budget_bytes: the budget the plan was made for; ``None`` for an unconstrained plan.
        predicted: the planner's predicted peak.
        policy: the hand-written :class:`UpdatePolicy` it came from, as a dict, if any.
    """

    graph: str
    params: tuple[ParamPlan, ...]
    cut: int = -1
    batch_windows: int = 32
    micro_batch_windows: int = 32
    n_windows: int = 128
    cache_features: bool = False
    activations: tuple[tuple[str, Action], ...] = ()
    order: tuple[str, ...] = ()
    prefetch_depth: int = 0
    optimizer: str = "adamw"
    budget_bytes: int | None = None
    predicted: Peak | None = None
    policy: dict[str, Any] | None = None
    update_chunk_numel: int | None = None
    update_overlap: UpdateOverlap = UpdateOverlap.BACKWARD

    def __post_init__(self) -> None:
        object.__setattr__(self, "params", tuple(self.params))
        object.__setattr__(self, "activations", tuple((str(n), Action(a)) for n, a in self.activations))
        object.__setattr__(self, "order", tuple(self.order))
        object.__setattr__(self, "update_overlap", UpdateOverlap(self.update_overlap))
        for key in ("batch_windows", "micro_batch_windows", "n_windows"):
            if int(getattr(self, key)) < 1:
                raise ValueError(f"plan: {key} must be >= 1, got {getattr(self, key)}")
        if self.micro_batch_windows > self.batch_windows:
            raise ValueError(f"plan: micro_batch_windows ({self.micro_batch_windows}) exceeds batch_windows "
                             f"({self.batch_windows})")
        if self.update_chunk_numel is not None and self.update_chunk_numel < 1:
            raise ValueError(f"plan: update_chunk_numel must be >= 1, got {self.update_chunk_numel}")
        if self.cut < -1 or self.prefetch_depth < 0:
            raise ValueError("plan: cut must be >= -1 and prefetch_depth >= 0")
        if self.optimizer not in ("adamw", "sgd"):
            raise ValueError(f"plan: optimizer must be 'adamw' or 'sgd', got {self.optimizer!r}")
        if self.budget_bytes is not None and self.budget_bytes <= 0:
            raise ValueError("plan: budget_bytes must be > 0")
        names = [p.name for p in self.params]
        if len(set(names)) != len(names):
            raise ValueError("plan: a parameter is planned twice")

    # ---- queries ---------------------------------------------------------------------
    def param(self, name: str) -> ParamPlan:
        for p in self.params:
            if p.name == name:
                return p
        raise KeyError(f"plan has no parameter {name!r}")

    @property
    def trained(self) -> tuple[ParamPlan, ...]:
        return tuple(p for p in self.params if p.trains)

    def action(self, op_name: str) -> Action:
        """Keep unless the plan says otherwise."""
        return dict(self.activations).get(op_name, Action.KEEP)

    @property
    def recomputed(self) -> tuple[str, ...]:
        return tuple(n for n, a in self.activations if a is Action.RECOMPUTE)

    # ---- JSON ------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = {
            "plan_version": PLAN_VERSION,
            "graph": self.graph,
            "params": [p.to_dict() for p in self.params],
            "cut": self.cut,
            "batch_windows": self.batch_windows,
            "micro_batch_windows": self.micro_batch_windows,
            "n_windows": self.n_windows,
            "cache_features": self.cache_features,
            "activations": [[n, a.value] for n, a in self.activations],
            "order": list(self.order),
            "prefetch_depth": self.prefetch_depth,
            "optimizer": self.optimizer,
            "budget_bytes": self.budget_bytes,
            "predicted": None if self.predicted is None else self.predicted.to_dict(),
            "policy": self.policy,
        }
        if self.update_chunk_numel is not None:  # server plans only: device manifests keep their keys
            d["update_chunk_numel"] = self.update_chunk_numel
            d["update_overlap"] = self.update_overlap.value
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        if d.get("plan_version") != PLAN_VERSION:
            raise ValueError(f"plan_version {d.get('plan_version')!r} is not supported (this edgeadapt reads "
                             f"{PLAN_VERSION}); re-export the bundle with this version")
        return cls(
            graph=d["graph"], params=tuple(ParamPlan.from_dict(p) for p in d["params"]), cut=int(d["cut"]),
            batch_windows=int(d["batch_windows"]), micro_batch_windows=int(d["micro_batch_windows"]),
            n_windows=int(d["n_windows"]), cache_features=bool(d["cache_features"]),
            activations=tuple((n, a) for n, a in d.get("activations", ())), order=tuple(d.get("order", ())),
            prefetch_depth=int(d.get("prefetch_depth", 0)), optimizer=d.get("optimizer", "adamw"),
            budget_bytes=d.get("budget_bytes"),
            predicted=None if d.get("predicted") is None else Peak.from_dict(d["predicted"]),
            policy=d.get("policy"),
            update_chunk_numel=None if d.get("update_chunk_numel") is None else int(d["update_chunk_numel"]),
            update_overlap=UpdateOverlap(d.get("update_overlap", UpdateOverlap.BACKWARD.value)),
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        return cls.from_dict(json.loads(text))
