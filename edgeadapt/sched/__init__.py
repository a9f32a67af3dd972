"""The shared memory scheduler: a pure planner (numpy/scipy only) used by the device runner
and the server trainer alike.

It decides and never touches tensors: policies turn a :class:`Graph` and a budget into a
:class:`Plan`; :func:`verify` re-derives a plan's peak and refuses one over budget; executors
carry plans out.
"""

from .ir import Graph, Op, Param
from .plan import Action, Mode, ParamPlan, Peak, Plan, Tier, format_bytes, parse_bytes
from .policy import Rule, UpdatePolicy

__all__ = [
    "Graph", "Op", "Param",
    "Plan", "ParamPlan", "Peak", "Mode", "Tier", "Action", "parse_bytes", "format_bytes",
    "Rule", "UpdatePolicy",
]
