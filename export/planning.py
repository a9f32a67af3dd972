"""The export side of the memory plan: graph IR of the model, the plan, and carrying it out.

:func:`plan_export` builds the scheduler's :class:`~edgeadapt.sched.ir.Graph` from the exported
ONNX model (every parameter a plain tensor, so the IR names each source parameter once), asks
the planner for a :class:`~edgeadapt.sched.plan.Plan` — resolved from a hand-written policy, or
chosen for a memory budget, verified by the planner. :func:`policy_of_plan` turns the
plan's per-parameter decisions back into the rules that ``prepare_model`` applies to the torch
module (channel subsets as explicit indices), and :func:`cut_model` splits the final ONNX model
at the plan's cut when the plan caches the prefix's features (where it cannot, the planner plans
again without the cache: :func:`edgeadapt.sched.refit`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import onnx
import torch
from torch import nn

from ..bundle import ParameterEntry
from ..sched import CostModel, plan_for_budget, plan_from_policy, predict, refit
from ..sched.ir import Graph
from ..sched.plan import Plan
from ..sched.policy import UpdatePolicy
from ..sched.resolve import policy_of_plan
from .onnx_export import to_onnx
from .importance import measure_importance
from .prepare import prepare_model
from .split import CutError, SplitModel, split_model

__all__ = ["PlannedExport", "plan_export", "policy_of_plan", "cut_model", "manifest_plan", "node_groups", "cut_tensor",
           "model_graph", "clean_cut_before", "check_entries"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PlannedExport:
    """The graph IR of the whole model and the plan made for it; both ``None`` when the model's
    graph IR cannot be built and no budget was asked for (the export then goes ahead unplanned)."""

    graph: Graph | None
    plan: Plan | None


def model_graph(model: nn.Module, example_input: torch.Tensor, batchnorm: str) -> tuple[Graph, dict[str, np.ndarray]]:
    """The sched graph of ``model`` as exported (BatchNorm mode applied, no channel split) and
    its parameter values by source name."""
    from .sched_graph import graph_from_onnx

    neutral = prepare_model(model, UpdatePolicy.full(), batchnorm)
    proto, entries = to_onnx(neutral.module, example_input, neutral.entries)
    types = {path: type(m).__name__ for path, m in neutral.module.named_modules() if path}
    graph = graph_from_onnx(proto, entries, tuple(example_input.shape), name=type(model).__name__,
                            module_types=types)
    weights = {n: p.detach().cpu().numpy() for n, p in neutral.module.named_parameters()}
    return graph, weights


def clean_cut_before(graph: Graph, cut: int) -> int:
    """The latest op index <= ``cut`` at which the prefix can run as a model of its own (its one
    output feeds everything after it); -1 when there is none."""
    from ..sched.cost import clean_cut

    return next((c for c in range(cut, -1, -1) if clean_cut(graph, c)), -1)


def _choose_cache(graph: Graph, plan: Plan, cache_features: bool | None, cost: CostModel) -> Plan:
    """Without a budget: cache the frozen prefix's features (at the latest clean cut) when that
    lowers the predicted peak, or as ``cache_features`` says."""
    plain = replace(plan, cache_features=False)
    plain = replace(plain, predicted=predict(graph, plain, cost))
    cut = clean_cut_before(graph, plan.cut)
    if cut < 0 or cache_features is False:
        if cache_features:
            log.warning("no frozen prefix can run on its own before the first trained op; features are not cached")
        return plain
    cached = replace(plan, cut=cut, cache_features=True)
    cached = replace(cached, predicted=predict(graph, cached, cost))
    if cache_features or cached.predicted.peak_bytes < plain.predicted.peak_bytes:
        return cached
    return plain


def plan_export(model: nn.Module, example_input: torch.Tensor, *, policy: UpdatePolicy | None,
                budget_bytes: int | None, batchnorm: str, optimizer: str, n_windows: int, batch_windows: int,
                importance: dict[str, float] | None = None, cache_features: bool | None = None,
                loss: str = "cross_entropy", recompute: bool = False, cost: CostModel | None = None,
                on_stage: Callable[[str], None] = lambda name: None) -> PlannedExport:
    """Build the graph IR and make the plan (see the module docstring).

    * no budget: the policy (default: the model's last layer) resolved; the prefix's features are cached when
      that lowers the predicted peak (``cache_features`` True/False forces the choice);
    * a budget and a policy: the best plan for that policy under the budget (micro-batch, cut,
      and recompute when ``recompute``), refused when none fits;
    * a budget and no policy: the planner picks what trains.

    ``cost``: the cost constants the plan is made with (default: the ONNX Runtime training
    engine's; the exporter passes constants that bound every engine the bundle holds).
    ``on_stage("planning")`` is called once the model is traced, before the importance
    measurement and the planner.

    Raises:
        edgeadapt.sched.NoFeasiblePlan: nothing fits the budget (names the smallest that would).
        edgeadapt.sched.BudgetExceeded: the plan's verified peak is over the budget.
    """
    try:
        graph, weights = model_graph(model, example_input, batchnorm)
    except ValueError as e:
        if budget_bytes is not None:
            raise ValueError(f"cannot plan for a memory budget: the model's graph IR cannot be built ({e})") from None
        log.warning("exporting without a memory plan: the model's graph IR cannot be built (%s)", e)
        return PlannedExport(None, None)
    on_stage("planning")
    cost = cost or CostModel.default()
    if budget_bytes is None:
        plan = plan_from_policy(graph, policy or UpdatePolicy.last_layer(), weights=weights,
                                      batch_windows=batch_windows, n_windows=n_windows, optimizer=optimizer)
        plan = _choose_cache(graph, plan, cache_features, cost)
    else:
        if importance is None and policy is None:  # empirical Fisher per output channel, on the example
            importance = measure_importance(model, example_input, graph, batchnorm=batchnorm,
                                            **({"loss": loss} if loss in ("cross_entropy", "mse") else {}))
        plan = plan_for_budget(graph, budget_bytes, importance=importance, n_windows=n_windows,
                                     batch_windows=batch_windows, optimizer=optimizer, policy=policy,
                                     weights=weights, allow_remat=recompute, cost=cost)  # verified there
    if plan.predicted is None:
        plan = replace(plan, predicted=predict(graph, plan, cost))
    return PlannedExport(graph, plan)


def check_entries(plan: Plan, entries: tuple[ParameterEntry, ...]) -> None:
    """The prepared model trains exactly the plan's parameters (an internal consistency check)."""
    want = {p.name for p in plan.trained}
    got = {e.name for e in entries if e.trainable_numel}
    if want != got:
        raise RuntimeError(f"internal: the plan trains {sorted(want)} but the prepared model {sorted(got)}")


def node_groups(model_proto: onnx.ModelProto, graph: Graph) -> dict[str, list[onnx.NodeProto]]:
    """The ONNX nodes behind each op of ``graph``, by op name.

    ``graph_from_onnx`` fuses consecutive per-window nodes of one module path into one op (see
    :mod:`.sched_graph`); this regroups ``model_proto``'s nodes the same way.

    Raises:
        CutError: the regrouping does not reproduce the graph's ops (a different model).
    """
    from .sched_graph import _CONSTANT_OUTPUT, module_path_of_node

    g = model_proto.graph
    inits = {i.name for i in g.initializer}
    per_window = {i.name for i in g.input if i.name not in inits}
    groups: list[tuple[str, list[onnx.NodeProto]]] = []
    for node in g.node:
        if node.op_type not in _CONSTANT_OUTPUT and any(t in per_window for t in node.input if t):
            module = module_path_of_node(node.name)
            if not groups or groups[-1][0] != module:
                groups.append((module, []))
            groups[-1][1].append(node)
            per_window.update(t for t in node.output if t)
    if [m for m, _ in groups] != [op.module for op in graph.ops]:
        raise CutError("the exported model's nodes do not regroup into the plan's ops; re-plan for this model")
    return {op.name: nodes for op, (_, nodes) in zip(graph.ops, groups)}


def cut_tensor(model_proto: onnx.ModelProto, graph: Graph, cut: int) -> str:
    """The one tensor that ops up to ``cut`` produce and later ops (or the output) read.

    Raises:
        CutError: no such single tensor (the cut is not clean in this model).
    """
    groups = node_groups(model_proto, graph)
    before = [n for op in graph.ops[:cut + 1] for n in groups[op.name]]
    after = [n for op in graph.ops[cut + 1:] for n in groups[op.name]]
    produced = {t for n in before for t in n.output if t}
    read_later = {t for n in after for t in n.input} | {o.name for o in model_proto.graph.output}
    crossing = sorted(produced & read_later)
    if len(crossing) != 1:
        raise CutError(f"{len(crossing)} tensors cross the cut after op {graph.ops[cut].name!r} "
                       f"({crossing[:4]}); the prefix must hand exactly one tensor to the rest")
    return crossing[0]


def _trained_initializers(entries: tuple[ParameterEntry, ...]) -> list[str]:
    return [e.onnx_names["trained" if e.is_split else "value"] for e in entries if e.trainable_numel]


def cut_model(model_proto: onnx.ModelProto, graph: Graph, plan: Plan, entries: tuple[ParameterEntry, ...],
              batchnorm: str, *, allow_remat: bool = False,
              cost: CostModel | None = None) -> tuple[SplitModel | None, Plan]:
    """Split the final model at ``plan.cut`` when the plan caches features.

    Returns:
        The split (``None``: no prefix model) and the plan actually carried out: where the ONNX
        graph cannot honour the cut (a connection crossing it, BatchNorm with batch statistics
        in the prefix, whose inference form would differ), the planner plans again without the
        feature cache (recomputing activations only if ``allow_remat``; with ``cost``, the plan's
        constants), with a warning.

    Raises:
        edgeadapt.sched.NoFeasiblePlan: without the cache nothing fits the plan's budget.
    """
    if plan.cut < 0 or not plan.cache_features:
        return None, plan
    op = graph.ops[plan.cut]
    try:
        split = split_model(model_proto, cut_tensor(model_proto, graph, plan.cut),
                            trained_initializers=_trained_initializers(entries))
        if batchnorm == "batch" and any(n.op_type == "BatchNormalization" for n in split.prefix.graph.node):
            raise CutError("the prefix holds BatchNormalization trained with batch statistics; "
                           "as an inference model it would use the running statistics")
    except CutError as e:
        log.warning("not caching the prefix's features (cut after %s): %s", op.name, e)
        return None, refit(graph, plan, cache_features=False, allow_remat=allow_remat, cost=cost)
    return split, plan


def manifest_plan(plan: Plan, batchnorm: str, graph: Graph | None = None, engines: tuple[str, ...] = ()) -> dict:
    """The plan as the manifest stores it: ``Plan.to_dict()`` plus ``predicted_peak_bytes`` (the
    bound on the peak of one whole ``adapt`` call over ``plan.n_windows`` windows, which the
    budget was checked against, under constants bounding every engine the bundle holds) and,
    given the ``graph`` and the bundle's ``engines``, ``expected_peak_bytes``: per engine, the
    point estimate of the same peak (:meth:`CostModel.expected`) on that engine.

    With batch statistics (``batchnorm="batch"``) each forward pass normalises with its own
    windows, so a step over several micro-batches would differ from one over the batch and the
    runner never splits a step: the plan's batch becomes its micro-batch (the predicted peak
    depends on the micro-batch, not the batch).
    """
    if batchnorm == "batch" and plan.micro_batch_windows < plan.batch_windows:
        log.info("batch-statistics BatchNorm: steps of %d windows (the budget's micro-batch), not %d",
                 plan.micro_batch_windows, plan.batch_windows)
        plan = replace(plan, batch_windows=plan.micro_batch_windows)
    d = plan.to_dict()
    d["predicted_peak_bytes"] = None if plan.predicted is None else int(plan.predicted.peak_bytes)
    if graph is not None and engines:
        d["expected_peak_bytes"] = {e: predict(graph, plan, CostModel.expected(e)).peak_bytes for e in engines}
    return d
