"""What trains under a budget, chosen by what adapting it gains on source subjects.

The planner's own selection maximises the summed importance (empirical Fisher) of the units it
trains. That sum keeps growing with the budget, while accuracy on a new person does not: with a
few dozen windows, training more layers over-fits, and the layers with the largest Fisher on
the source data (often the first convolutions) are not the ones worth training. Here the
choice is validated instead, never on the target:

1. **candidates**: the structured policies of :mod:`edgeadapt.sched.candidates` (one module,
   the last layer plus one module or a fraction of its channels, every module from one on)
   and the planner's importance selections at the budget and at halvings of it;
2. **fit**: each candidate is fitted to the budget by the planner
   (:func:`edgeadapt.sched.plan_for_budget` with the policy); the ones that do not fit drop out;
3. **score**: leave-one-source-subject-out. A few source subjects, chosen with the seed, each
   play the new subject once: a model pretrained on the other source subjects is adapted
   with the candidate (torch, the device's recipe: frozen BatchNorm, AdamW, the same epochs,
   batch and learning rate) on ``k_per_class`` of that subject's windows per class, and its
   accuracy on the subject's other windows, minus the unadapted model's, is the gain;
4. **choice**: the candidate with the largest mean gain, unless one with a smaller predicted peak
   is within one standard error of it (the paired difference over the validation subjects):
   then the smallest such one. A gain within the noise of a few subjects is not worth memory.

Scores depend on the policy only, so one :class:`InnerSubjectScorer` serves every budget of a
fold.
"""

from __future__ import annotations

import fnmatch
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..datasets import WindowDataset
from ..sched import Mode, NoFeasiblePlan, Plan, Rule, UpdatePolicy, plan_for_budget, policy_of_plan
from ..sched.candidates import structured_policies
from ..sched.cost import CostModel
from ..sched.ir import Graph
from ..sched.resolve import resolve_params
from ..units import parse_bytes
from .study import PRETRAIN_THREADS, SplitData, fold_rng, pick_validation_subjects, pinned_torch, validation_folds

__all__ = ["FinetuneRecipe", "finetune", "InnerSubjectScorer", "CandidateResult", "Choice", "choose_update",
           "choose_update_for_model", "source_importance", "IMPORTANCE_WINDOWS", "describe_picks"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FinetuneRecipe:
    """How a candidate is adapted when it is scored: the device's recipe, in torch.

    Attributes:
        lr: AdamW learning rate.
        weight_decay: AdamW (decoupled) weight decay.
        epochs: passes over the adaptation windows.
        batch_windows: windows per optimizer step.
        seed: seeds the window order of every epoch.
    """

    lr: float
    weight_decay: float
    epochs: int
    batch_windows: int
    seed: int = 0


def finetune(model, policy: UpdatePolicy, X: np.ndarray, y: np.ndarray, recipe: FinetuneRecipe):
    """A copy of ``model`` with frozen BatchNorm, adapted with ``policy`` on windows ``X`` with
    labels ``y`` as ``Runner.adapt`` (constant schedule) adapts a bundle exported with that policy:
    channel subsets train their slice alone, AdamW, the same window order; eval mode."""
    import torch

    from ..export.prepare import prepare_model

    prepared = prepare_model(model, policy, "frozen")
    module = prepared.module.eval()
    # The trained tensors: a whole parameter, or a channel-split one's trained slice.
    trained = {e.onnx_names.get("trained", e.onnx_names.get("value")) for e in prepared.entries if e.trainable_numel}
    params = []
    for name, p in module.named_parameters():
        p.requires_grad_(name in trained)
        if name in trained:
            params.append(p)
    opt = torch.optim.AdamW(params, lr=recipe.lr, weight_decay=recipe.weight_decay)
    Xt, yt = torch.from_numpy(np.ascontiguousarray(X, dtype=np.float32)), torch.from_numpy(np.asarray(y, np.int64))
    for epoch in range(recipe.epochs):
        # Runner.adapt's window order (constant learning rate), so the score is what the device gets
        order = torch.from_numpy(np.random.default_rng(recipe.seed + epoch).permutation(len(yt)))
        for start in range(0, len(yt), recipe.batch_windows):
            idx = order[start:start + recipe.batch_windows]
            loss = torch.nn.functional.cross_entropy(module(Xt[idx]), yt[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    return module


def _policy_key(policy: UpdatePolicy) -> str:
    return json.dumps(policy.to_dict(), sort_keys=True)


@dataclass
class InnerSubjectScorer:
    """Mean accuracy gain of adapting with a policy, over source subjects playing the new one.

    Attributes:
        source: the labelled source windows (the target subject already removed), not normalised.
        pretrain: how a validation subject's model is made: a reference model's name
            (:func:`edgeadapt.models.build_model`, pretrained by :func:`.study.pretrain_source`
            with ``pretrain_epochs``), or a function taking the :class:`.study.SplitData` of a
            validation subject (its ``source_train`` normalised) and returning the model trained
            on it, as the user's own training code would.
        recipe: how candidates are adapted.
        k_per_class: adaptation windows per class of a validation subject.
        pretrain_epochs: epochs of each validation model's pretraining (a reference model name only).
        validation_subjects: how many source subjects play the new one.
        seed: picks the validation subjects (with ``target_subject``) and seeds pretraining.
        target_subject: the fold's held-out subject, if any; ``source`` must not hold it (checked).
            Mixed into the pick, which is then the one the study's other source-subject
            choices make for that fold.
        threads: torch intra-op threads of the adaptation runs (pinned, deterministic
            algorithms), so that a score does not depend on the machine's core count.
    """

    source: WindowDataset
    pretrain: str | Callable[[SplitData], Any]
    recipe: FinetuneRecipe
    k_per_class: int
    pretrain_epochs: int = 15
    validation_subjects: int = 3
    seed: int = 0
    target_subject: int | None = None
    threads: int = PRETRAIN_THREADS
    _folds: list | None = field(default=None, init=False, repr=False)
    _cache: dict = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.validation_subjects < 1:
            raise ValueError(f"validation_subjects must be >= 1, got {self.validation_subjects}")
        if len(self.source.subjects) < 2:
            raise ValueError("scoring on source subjects needs at least 2 of them; "
                             f"the source holds {len(self.source.subjects)}")
        if self.target_subject is not None and np.any(self.source.subject == self.target_subject):
            raise ValueError(f"the source windows hold subject {self.target_subject}, the fold's target: the choice "
                             "would see the new subject; pass ds.subset(ds.subject != target)")

    @property
    def subjects(self) -> tuple[int, ...]:
        """The source subjects that play the new one."""
        return tuple(pick_validation_subjects(self.source, self.validation_subjects, self.seed, self.target_subject))

    def _prepared_folds(self) -> list:
        """Per validation subject: (pretrained model, adapt windows, eval windows, unadapted accuracy)."""
        if self._folds is None:
            from ..export.pretrain import accuracy

            self._folds = []
            for v, split, model in validation_folds(self.source, self.target_subject, self.pretrain,
                                                    n=self.validation_subjects, k_per_class=self.k_per_class,
                                                    pretrain_epochs=self.pretrain_epochs, seed=self.seed):
                ev = split.target_eval
                self._folds.append((model, split.target_adapt, ev, accuracy(model, ev.X, ev.y)))
                log.info("validation subject %d pretrained (unadapted accuracy %.3f)", v, self._folds[-1][3])
        return self._folds

    def gains(self, policy: UpdatePolicy) -> tuple[float, ...]:
        """Accuracy gain (fraction) of adapting with ``policy``, per validation subject."""
        key = _policy_key(policy)
        if key not in self._cache:
            from ..export.pretrain import accuracy

            folds = self._prepared_folds()
            with pinned_torch(self.threads):
                out = tuple(accuracy(finetune(model, policy, ad.X, ad.y, self.recipe), ev.X, ev.y) - before
                            for model, ad, ev, before in folds)
            self._cache[key] = out
        return self._cache[key]

    def score(self, policy: UpdatePolicy) -> float:
        """Mean accuracy gain (fraction) over the validation subjects."""
        return float(np.mean(self.gains(policy)))


@dataclass(frozen=True)
class CandidateResult:
    """One candidate at one budget: ``plan`` is ``None`` when it does not fit (then unscored)."""

    label: str
    policy: UpdatePolicy
    plan: Plan | None
    gains: tuple[float, ...] | None

    @property
    def score(self) -> float | None:
        return None if self.gains is None else float(np.mean(self.gains))

    @property
    def predicted_peak_bytes(self) -> int | None:
        return None if self.plan is None else self.plan.predicted.peak_bytes


@dataclass(frozen=True)
class Choice:
    """The chosen candidate and every candidate considered at the budget."""

    budget_bytes: int
    chosen: CandidateResult
    candidates: tuple[CandidateResult, ...]

    def to_dict(self) -> dict:
        return {"budget_bytes": self.budget_bytes, "chosen": self.chosen.label, "score": self.chosen.score,
                "candidates": [{"label": c.label, "fits": c.plan is not None, "score": c.score,
                                "gains": None if c.gains is None else list(c.gains),
                                "predicted_peak_bytes": c.predicted_peak_bytes} for c in self.candidates]}


def describe_picks(picks) -> str:
    """``"method: label xN, ...; method2: ..."`` from ``(method, chosen label)`` pairs, one per fold,
    the most frequent label first (for the studies' tables)."""
    counts: dict[str, dict[str, int]] = {}
    for method, label in picks:
        counts.setdefault(method, {}).setdefault(label, 0)
        counts[method][label] += 1
    return "; ".join(f"{m}: " + ", ".join(f"{k} x{n}" for k, n in sorted(c.items(), key=lambda kv: -kv[1]))
                     for m, c in counts.items())


def _worth_its_memory(fitting: list[CandidateResult], tolerance_se: float) -> CandidateResult:
    """The candidate with the smallest predicted peak among those whose mean gain the best one's
    does not exceed by more than ``tolerance_se`` standard errors of the paired difference (per
    validation subject): a difference within the noise of a few subjects buys no memory."""
    best = max(fitting, key=lambda r: (round(r.score, 9), -r.predicted_peak_bytes))
    ref = np.asarray(best.gains)

    def within(r: CandidateResult) -> bool:
        d = np.asarray(r.gains) - ref
        se = float(d.std(ddof=1) / np.sqrt(d.size)) if d.size > 1 else 0.0
        return float(d.mean()) >= -tolerance_se * se - 1e-12

    return min((r for r in fitting if within(r)), key=lambda r: (r.predicted_peak_bytes, -r.score))


# Labelled source windows on which the importance of the planner's own candidates is measured.
IMPORTANCE_WINDOWS = 128


def source_importance(model, example_input, source: WindowDataset, *, seed: int, target_subject: int | None = None,
                      n_windows: int = IMPORTANCE_WINDOWS) -> dict:
    """Empirical Fisher importance of ``model``'s parameters (``example_input``: its input shape)
    on ``n_windows`` labelled windows of ``source`` (a seeded choice, ``[seed, target_subject]``;
    ``None``: outside a fold, as 0), for the planner's importance selection: decided on source
    data only."""
    import torch

    from ..export.importance import measure_importance
    from ..export.planning import model_graph

    graph, _ = model_graph(model, example_input, "frozen")
    n = min(n_windows, len(source.y))
    idx = np.sort(fold_rng(seed, target_subject).choice(len(source.y), size=n, replace=False))
    return measure_importance(model, torch.from_numpy(source.X[idx]), graph, labels=torch.from_numpy(source.y[idx]),
                              batch_windows=32, max_batches=-(-n // 32))


def _as_ratio_rules(graph: Graph, policy: UpdatePolicy) -> UpdatePolicy:
    """``policy`` with explicit channel indices replaced by the same number of channels picked by
    weight magnitude, so that the policy means the same on every model it is scored on (the
    indices the importance picked on one model are arbitrary channels of another)."""
    rules = []
    for r in policy.rules:
        if r.mode is Mode.CHANNELS and r.indices is not None:
            n_out = max(p.out_channels for p in graph.params if fnmatch.fnmatchcase(p.module, r.pattern))
            # ceil(ratio * n_out) is exactly len(indices) (half a channel below it)
            r = Rule(r.pattern, Mode.CHANNELS, ratio=(len(r.indices) - 0.5) / n_out, types=r.types, params=r.params)
        rules.append(r)
    return UpdatePolicy(tuple(rules), policy.default)


def _importance_candidates(graph: Graph, budget: int, halvings: int, plan_kwargs: dict) -> dict[str, UpdatePolicy]:
    """The planner's importance selections at ``budget / 2**i``, ``i = 0..halvings``, as policies
    (channel subsets as counts, :func:`_as_ratio_rules`).

    Raises:
        NoFeasiblePlan: nothing fits ``budget`` itself (with the smallest budget that would).
    """
    out = {"importance@1/1": plan_for_budget(graph, budget, **plan_kwargs)}
    for i in range(1, halvings + 1):
        try:
            out[f"importance@1/{2 ** i}"] = plan_for_budget(graph, budget >> i, **plan_kwargs)
        except NoFeasiblePlan:
            break
    return {label: _as_ratio_rules(graph, policy_of_plan(graph, plan)) for label, plan in out.items()}


def choose_update(graph: Graph, budget_bytes: int | str, scorer: InnerSubjectScorer, *, importance: dict | None,
                  weights: dict[str, np.ndarray], n_windows: int, batch_windows: int, optimizer: str = "adamw",
                  cost: CostModel | None = None, recompute: bool = False, halvings: int = 3,
                  channel_ratio: float = 0.25, tolerance_se: float = 1.0) -> Choice:
    """The candidate (module docstring) with the largest validated gain among those that fit.

    Args:
        graph: the model's IR (``weights``: its parameter arrays, for channel ratios).
        budget_bytes: the whole ``adapt`` call's budget (bytes, or a string such as ``"600KiB"``).
        scorer: scores a policy on source subjects.
        importance: the planner's importance (per parameter) for its own selections.
        n_windows, batch_windows, cost: as for :func:`edgeadapt.sched.plan_for_budget`.
        optimizer: ``"adamw"``, the optimizer candidates are scored with.
        recompute: candidates may fit by recomputing activations; give the export the same value
            (``export_bundle(..., recompute=...)``), or a chosen candidate may not fit there.
        halvings: the planner's selection is also tried at the budget halved this many times.
        channel_ratio: fraction of channels of the ``last+M@R`` candidates.
        tolerance_se: candidates whose mean gain is within this many standard errors of the
            best one's count as equally good, and the one with the smallest predicted peak
            among them is chosen (0: the best mean gain, ties to the smaller peak).

    Raises:
        NoFeasiblePlan: no candidate fits the budget.
        ValueError: an optimizer other than AdamW.
    """
    budget_bytes = parse_bytes(budget_bytes)
    if optimizer != "adamw":
        raise ValueError(f"candidates are scored with AdamW (FinetuneRecipe); plan with optimizer='adamw', "
                         f"not {optimizer!r}")
    common = dict(n_windows=n_windows, batch_windows=batch_windows, optimizer=optimizer, cost=cost,
                  allow_remat=recompute)
    policies = {**_importance_candidates(graph, budget_bytes, halvings, {**common, "importance": importance}),
                **structured_policies(graph, channel_ratio)}
    results, seen = [], set()
    for label, policy in policies.items():
        trained = frozenset((pp.name, pp.channels) for pp in resolve_params(graph, policy, weights) if pp.trains)
        if trained in seen:  # trains what an earlier candidate trains: scored once
            continue
        seen.add(trained)
        try:
            plan = plan_for_budget(graph, budget_bytes, policy=policy, weights=weights, **common)
        except NoFeasiblePlan:
            results.append(CandidateResult(label, policy, None, None))
            continue
        results.append(CandidateResult(label, policy, plan, scorer.gains(policy)))
    fitting = [r for r in results if r.plan is not None]
    if not fitting:  # the importance selection at the budget itself fitted above
        raise RuntimeError("internal: the planner's own selection does not fit its budget as a policy")
    best = _worth_its_memory(fitting, tolerance_se)
    log.info("budget %d: chose %s (gain %+.3f) among %d fitting candidates of %d", budget_bytes, best.label,
             best.score, len(fitting), len(results))
    return Choice(budget_bytes, best, tuple(results))


def choose_update_for_model(model, example_input, budget_bytes: int | str, scorer: InnerSubjectScorer, *,
                            n_windows: int, batch_windows: int, importance: dict | None = None,
                            backend: str = "auto", recompute: bool = False, **kwargs) -> Choice:
    """:func:`choose_update` for a torch model as :func:`edgeadapt.export.export_bundle` plans it:
    frozen BatchNorm, the cost constants of the engines ``backend`` writes, recompute only when
    asked, and (``importance=None``) the importance the exporter measures on the example. Export
    the choice with ``export_bundle(model, example_input, out, memory_budget=budget_bytes,
    policy=choice.chosen.policy, recompute=recompute, backend=backend)``."""
    from ..export.exporter import plan_cost, resolve_backends
    from ..export.importance import measure_importance
    from ..export.planning import model_graph

    graph, weights = model_graph(model, example_input, "frozen")
    recompute = recompute and "ort-training" in resolve_backends(backend)  # as the exporter decides
    if importance is None:
        importance = measure_importance(model, example_input, graph)
    return choose_update(graph, budget_bytes, scorer, importance=importance, weights=weights, n_windows=n_windows,
                         batch_windows=batch_windows, cost=plan_cost(backend), recompute=recompute, **kwargs)
