"""The shared memory scheduler: a pure planner (numpy/scipy only) used by the device runner
(:func:`plan_for_budget`) and the server trainer (:func:`plan_offload`) alike.

It decides and never touches tensors: policies turn a :class:`Graph` and a budget into a
:class:`Plan`; :func:`verify` re-derives a plan's peak and refuses one over budget; executors
carry plans out. See docs/scheduler.md and docs/cost_model.md.
"""

from ..units import format_bytes, parse_bytes
from .batching import minimum_budget, plan_for_budget, refit, replan
from .cost import ENGINES, PHASES, CostModel, predict
from .errors import BudgetExceeded, NoFeasiblePlan
from .ir import Graph, Op, Param
from .label_free_cost import predict_label_free
from .offload import BlockTooLarge, plan_offload
from .plan import Action, Mode, ParamPlan, Peak, Plan, Tier, UpdateOverlap
from .policy import Rule, UpdatePolicy
from .remat import Chain, chain_from_graph, min_flops_schedule, min_peak_schedule, sqrt_schedule
from .resolve import cut_of, plan_from_policy, policy_of_plan, resolve_channels, resolve_params, trained_bytes
from .select import Unit, candidate_units, select_greedy, select_milp
from .verify import TimelineEvent, check_plan, timeline, verify

__all__ = [
    "Graph", "Op", "Param",
    "Plan", "ParamPlan", "Peak", "Mode", "Tier", "Action", "UpdateOverlap", "parse_bytes", "format_bytes",
    "Rule", "UpdatePolicy",
    "plan_from_policy", "policy_of_plan", "resolve_params", "resolve_channels", "cut_of", "trained_bytes",
    "CostModel", "predict", "predict_label_free", "PHASES", "ENGINES",
    "verify", "timeline", "TimelineEvent", "check_plan", "BudgetExceeded", "NoFeasiblePlan",
    "Unit", "candidate_units", "select_milp", "select_greedy",
    "Chain", "chain_from_graph", "min_flops_schedule", "min_peak_schedule", "sqrt_schedule",
    "plan_for_budget", "replan", "refit", "minimum_budget",
    "plan_offload", "BlockTooLarge",
]
