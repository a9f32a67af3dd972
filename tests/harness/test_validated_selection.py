"""The validated selection: torch adaptation of a candidate, the scorer on source subjects, the choice."""

import numpy as np
import pytest
import torch

from edgeadapt.datasets import SyntheticConfig, make_synthetic
from edgeadapt.export.planning import model_graph
from edgeadapt.harness.validated_selection import (FinetuneRecipe, InnerSubjectScorer, choose_update, finetune)
from edgeadapt.models import build_model
from edgeadapt.sched import NoFeasiblePlan, UpdatePolicy, minimum_budget
from edgeadapt.sched.resolve import resolve_params

RECIPE = FinetuneRecipe(lr=1e-2, weight_decay=0.01, epochs=2, batch_windows=8)


def _model():
    torch.manual_seed(0)
    return build_model("cnn", 3, 4, 32).eval()


def _data(n=16):
    rng = np.random.default_rng(1)
    return rng.standard_normal((n, 3, 32)).astype(np.float32), rng.integers(0, 4, n)


def test_finetune_changes_only_what_the_policy_trains():
    model = _model()
    X, y = _data()
    policy = UpdatePolicy.parse("head=full,blocks.2.conv=channels:0.25")
    adapted = finetune(model, policy, X, y, RECIPE)
    before = model.state_dict()
    after = {n: p.detach() for n, p in adapted.named_parameters()}
    # The channel-split weight is rebuilt from its trained and frozen slices.
    w = adapted.blocks[2].conv.weight.detach()
    changed = ~torch.isclose(w, before["blocks.2.conv.weight"], rtol=0, atol=0).flatten(1).all(dim=1)
    assert int(changed.sum()) == int(np.ceil(0.25 * w.shape[0]))
    assert not torch.equal(after["head.weight"], before["head.weight"])
    for name in ("blocks.0.conv.weight", "blocks.1.conv.weight", "blocks.3.conv.weight"):
        assert torch.equal(after[name], before[name]), name
    assert all(torch.equal(p, before[n]) for n, p in model.state_dict().items())  # the model itself untouched


class _Scorer:
    """Gains by what a policy trains: 0.05 per trained module, except that ``favourite`` alone scores 0.5."""

    def __init__(self, graph, favourite):
        self.graph, self.favourite, self.calls = graph, favourite, []

    def gains(self, policy):
        weights = {p.name: np.ones(p.shape) for p in self.graph.params}
        modules = {self.graph.param(pp.name).module for pp in resolve_params(self.graph, policy, weights) if pp.trains}
        self.calls.append(modules)
        return (0.5,) if modules == {self.favourite} else (0.05 * len(modules),)


def _graph():
    model = _model()
    graph, weights = model_graph(model, torch.zeros(2, 3, 32), "frozen")
    return graph, weights


def test_the_best_scoring_candidate_that_fits_wins():
    graph, weights = _graph()
    kwargs = dict(importance=None, weights=weights, n_windows=16, batch_windows=8)
    low = minimum_budget(graph, n_windows=16, batch_windows=8)
    scorer = _Scorer(graph, "blocks.1.conv")
    choice = choose_update(graph, 64 << 20, scorer, **kwargs)
    assert choice.chosen.label == "only:blocks.1.conv" and choice.chosen.score == 0.5
    assert choice.chosen.predicted_peak_bytes <= 64 << 20
    # At the least budget only small candidates fit; the others are listed unscored.
    small = choose_update(graph, low, scorer, **kwargs)
    assert small.chosen.plan is not None and small.chosen.predicted_peak_bytes <= low
    unfit = [c for c in small.candidates if c.plan is None]
    assert unfit and all(c.gains is None for c in unfit)
    assert small.chosen.score == max(c.score for c in small.candidates if c.plan is not None)
    assert small.to_dict()["chosen"] == small.chosen.label
    with pytest.raises(NoFeasiblePlan):
        choose_update(graph, low // 4, scorer, **kwargs)


def test_ties_go_to_the_smaller_peak():
    graph, weights = _graph()

    class Flat:
        def gains(self, policy):
            return (0.1,)

    choice = choose_update(graph, 64 << 20, Flat(), importance=None, weights=weights, n_windows=16, batch_windows=8)
    fitting = [c for c in choice.candidates if c.plan is not None]
    assert choice.chosen.predicted_peak_bytes == min(c.predicted_peak_bytes for c in fitting)


def test_scorer_adapts_on_source_subjects_only_and_caches():
    ds = make_synthetic(SyntheticConfig(n_subjects=3, windows_per_subject=40, n_time_steps=64))
    source = ds.subset(ds.subject != 2)
    scorer = InnerSubjectScorer(source, "cnn", RECIPE, k_per_class=2, pretrain_epochs=1, validation_subjects=1,
                                seed=0, target_subject=2)
    assert len(scorer.subjects) == 1
    head = UpdatePolicy.parse("head=full")
    gains = scorer.gains(head)
    (model, ad, ev, before), = scorer._prepared_folds()
    assert set(ad.subject.tolist()) == set(ev.subject.tolist()) == set(scorer.subjects)
    from edgeadapt.export.pretrain import accuracy

    assert gains[0] == pytest.approx(accuracy(finetune(model, head, ad.X, ad.y, RECIPE), ev.X, ev.y) - before)
    assert scorer.gains(UpdatePolicy.parse("head=full")) is gains  # cached by the policy's content
    assert scorer.score(head) == pytest.approx(gains[0])
    with pytest.raises(ValueError, match="at least 2"):
        InnerSubjectScorer(ds.subset(ds.subject == 0), "cnn", RECIPE, k_per_class=2, pretrain_epochs=1)
    with pytest.raises(ValueError, match="fold's target"):  # the new subject must not take part in the choice
        InnerSubjectScorer(ds, "cnn", RECIPE, k_per_class=2, target_subject=2)


def test_scorer_takes_the_users_own_training_function():
    ds = make_synthetic(SyntheticConfig(n_subjects=3, windows_per_subject=40, n_time_steps=64))
    seen = []

    def pretrain(split):
        seen.append((sorted(set(split.source_train.subject.tolist())), split.target_subject))
        torch.manual_seed(0)
        return build_model("cnn", split.source_train.X.shape[1], ds.n_classes, split.source_train.X.shape[2])

    scorer = InnerSubjectScorer(ds.subset(ds.subject != 0), pretrain, RECIPE, k_per_class=2, validation_subjects=1)
    scorer.score(UpdatePolicy.parse("head=full"))
    scorer.score(UpdatePolicy.parse("blocks.3.conv=full"))
    (subjects, held_out), = seen  # trained once, on the source subjects other than the one held out
    assert held_out in (1, 2) and subjects == [s for s in (1, 2) if s != held_out]


def test_the_choice_exports_within_its_budget(tmp_path):
    import json

    from edgeadapt.export import export_bundle
    from edgeadapt.harness.validated_selection import choose_update_for_model

    model, example = _model(), torch.zeros(2, 3, 32)
    graph, _ = _graph()
    budget = 3 * minimum_budget(graph, n_windows=16, batch_windows=8)
    choice = choose_update_for_model(model, example, budget, _Scorer(graph, "blocks.3.bn"), n_windows=16,
                                     batch_windows=8)
    assert choice.chosen.label == "only:blocks.3.bn"
    export_bundle(model, example, tmp_path / "b", memory_budget=budget, policy=choice.chosen.policy,
                  n_windows=16, batch_windows=8)
    plan = json.loads((tmp_path / "b" / "manifest.json").read_text())["plan"]
    trained = {p["name"] for p in plan["params"] if p["mode"] != "frozen"}
    assert trained == {"blocks.3.bn.weight", "blocks.3.bn.bias"}
    assert plan["predicted"]["peak_bytes"] <= budget


def test_a_gain_within_the_noise_buys_no_memory():
    graph, weights = _graph()

    class TwoSubjects:
        """The whole model gains most; one module alone a little less, within one standard error."""

        def gains(self, policy):
            weights_ = {p.name: np.ones(p.shape) for p in graph.params}
            n = sum(pp.trains for pp in resolve_params(graph, policy, weights_))
            if n == len(graph.params):
                return (0.30, 0.10)
            if policy.rules and policy.rules[0].pattern == "blocks.3.bn" and len(policy.rules) == 1:
                return (0.10, 0.20)  # mean 0.15 vs 0.20; paired difference (-0.2, +0.1): se 0.15
            return (0.0, 0.0)

    kwargs = dict(importance=None, weights=weights, n_windows=16, batch_windows=8)
    noisy = choose_update(graph, 64 << 20, TwoSubjects(), **kwargs)
    assert noisy.chosen.label == "only:blocks.3.bn"
    strict = choose_update(graph, 64 << 20, TwoSubjects(), tolerance_se=0.0, **kwargs)
    assert strict.chosen.score == pytest.approx(0.20)
    assert strict.chosen.predicted_peak_bytes > noisy.chosen.predicted_peak_bytes


def test_finetune_adapts_as_the_device_runner_does(tmp_path):
    """The score is what the device would get: the same windows, order, AdamW and trained slices."""
    from edgeadapt.export import OptimizerConfig, export_bundle
    from edgeadapt.runtime import Runner

    model = _model()
    X, y = _data(20)
    policy = UpdatePolicy.parse("head=full,blocks.2.conv=channels:0.25,blocks.1.bn=full")
    export_bundle(model, torch.from_numpy(X[:2]), tmp_path / "b", policy=policy, n_windows=20, batch_windows=8,
                  optimizer=OptimizerConfig("adamw", lr=RECIPE.lr, weight_decay=RECIPE.weight_decay))
    runner = Runner.load(tmp_path / "b", device="cpu")
    source = runner.predict(X)
    runner.adapt(X, y, epochs=RECIPE.epochs, batch_size=RECIPE.batch_windows, lr=RECIPE.lr, seed=RECIPE.seed,
                 progress=False)
    adapted = finetune(model, policy, X, y, RECIPE)
    with torch.no_grad():
        torch_logits = adapted(torch.from_numpy(X)).numpy()
    change = np.abs(runner.predict(X) - source).max()
    assert change > 1e-2  # adaptation moved the logits
    # Float32 reduction order differs between the engines: over 8 random models, data and policies the
    # logits differed by at most 4e-6 of the change; another window order or trained set by 25 % of it.
    np.testing.assert_allclose(torch_logits, runner.predict(X), rtol=0, atol=1e-2 * change)


def test_every_fitting_candidate_exports_within_a_tight_budget(tmp_path):
    from edgeadapt.export import export_bundle
    from edgeadapt.harness.validated_selection import choose_update_for_model

    model, example = _model(), torch.zeros(2, 3, 32)
    graph, _ = _graph()

    class Flat:
        def gains(self, policy):
            return (0.0,)

    budget = int(1.6 * minimum_budget(graph, n_windows=16, batch_windows=8))
    choice = choose_update_for_model(model, example, budget, Flat(), n_windows=16, batch_windows=8)
    fitting = [c for c in choice.candidates if c.plan is not None]
    assert fitting and len(fitting) < len(choice.candidates)
    for i, c in enumerate(fitting):
        manifest = export_bundle(model, example, tmp_path / f"b{i}", memory_budget=budget, policy=c.policy,
                                 n_windows=16, batch_windows=8)
        assert manifest.plan["predicted"]["peak_bytes"] <= budget, c.label


def test_picks_are_counted_per_method_most_frequent_first():
    from edgeadapt.harness.validated_selection import describe_picks

    picks = [("b1", "only:x"), ("b2", "last+y"), ("b1", "last+y"), ("b1", "last+y")]
    assert describe_picks(picks) == "b1: last+y x2, only:x x1; b2: last+y x1"
