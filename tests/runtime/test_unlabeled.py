"""Safe label-free adaptation (edgeadapt.runtime.unlabeled, .safety_gate, .head_features).

A hand-built toy model makes every expected outcome computable: a 1x1 convolution (identity),
BatchNorm (source statistics mean 0, variance 1), the mean over time and a linear head equal
to the identity, so the logits are the per-channel means of the (normalised) input. Class ``k``
windows carry ``AMPLITUDE`` on channel ``k`` plus small noise: the source model is right on them.
"""

from __future__ import annotations

import gc
import logging
import sys
import tracemalloc

import numpy as np
import pytest

from edgeadapt.runtime.safety_gate import (
    GateSettings, ModelEvidence, agreement_changes, agreement_loss, augmented_views, decide, evidence, pool_evidence,
    view_logits,
)
from edgeadapt.runtime.unlabeled import MAX_RESETS_KEPT, UnlabeledAdapter, UnlabeledSettings

N_CLASSES = 3
TIME_STEPS = 8
AMPLITUDE = 6.0
NOISE = 0.1
# stages off unless a test turns them on
OFF = dict(stats_prior_windows=float("inf"), prototype_mix=0.0, gate=False)


def export_toy(out, backend: str, loss: str = "entropy"):
    import torch
    from torch import nn

    from edgeadapt.export import UpdatePolicy, export_bundle

    class Toy(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv1d(N_CLASSES, N_CLASSES, 1, bias=False)
            self.bn = nn.BatchNorm1d(N_CLASSES)
            self.head = nn.Linear(N_CLASSES, N_CLASSES)

        def forward(self, x):
            return self.head(self.bn(self.conv(x)).mean(-1))

    model = Toy()
    with torch.no_grad():
        model.conv.weight.copy_(torch.eye(N_CLASSES)[:, :, None])
        model.head.weight.copy_(torch.eye(N_CLASSES))
        model.head.bias.zero_()
    model.eval()
    example = torch.from_numpy(windows(AMPLITUDE * np.eye(N_CLASSES)[[0, 1]]))
    export_bundle(model, example, out, policy=UpdatePolicy.parse("bias-norm"),
                  loss=loss, batchnorm="batch", backend=backend)
    return out


@pytest.fixture(scope="module")
def toy_bundle(tmp_path_factory):
    return export_toy(tmp_path_factory.mktemp("toy") / "bundle", "ort-training")


@pytest.fixture(scope="module")
def portable_toy(tmp_path_factory):
    return export_toy(tmp_path_factory.mktemp("toy-portable") / "bundle", "portable")


def windows(means: np.ndarray, seed: int = 0) -> np.ndarray:
    """Windows whose channel means are the rows of ``means`` (plus noise of std NOISE)."""
    rng = np.random.default_rng(seed)
    noise = NOISE * rng.standard_normal((len(means), N_CLASSES, TIME_STEPS))
    return (means[:, :, None] + noise).astype(np.float32)


def balanced(n_per_class: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    y = np.repeat(np.arange(N_CLASSES), n_per_class)
    return windows(AMPLITUDE * np.eye(N_CLASSES)[y], seed), y


def load(bundle):
    from edgeadapt.runtime import Runner

    return Runner.load(bundle, device="cpu", threads=1)


def accuracy(runner, X, y) -> float:
    return float((runner.predict(X).argmax(1) == y).mean())


def test_source_anchored_statistics_weight_and_values(toy_bundle):
    """Count weighting: a common offset on every channel is removed in proportion w = n / (n + N0)."""
    X, y = balanced(20)
    offset = np.float32(4.0)
    runner = load(toy_bundle)
    adapter = UnlabeledAdapter(runner, UnlabeledSettings(**{**OFF, "stats_prior_windows": 20.0,
                                                            "stats_weighting": "count"}))
    adapter.update(X + offset)
    n = len(X)
    w = n / (n + 20.0)
    assert adapter.stats_weight == pytest.approx(w)
    # target statistics of the BatchNorm input: per channel mean offset + AMPLITUDE / 3
    target_mean = offset + AMPLITUDE / N_CLASSES
    target_var = AMPLITUDE**2 * (1 / N_CLASSES) * (1 - 1 / N_CLASSES) + NOISE**2
    mean = runner._backend.get_tensor("bn.running_mean")
    var = runner._backend.get_tensor("bn.running_var")
    # tolerance: the sample mean/var of 60 windows x 8 steps of noise std 0.1 (a few 1e-2 at most)
    np.testing.assert_allclose(mean, w * target_mean, atol=0.05)
    np.testing.assert_allclose(var, (1 - w) * 1.0 + w * target_var, rtol=0.05)


def test_statistics_passes_interleave_the_batch_and_pool_to_its_statistics(toy_bundle, monkeypatch):
    """Windows stored class by class (as a recording runs activity by activity): every statistics
    pass holds every class in the batch's proportions, and the pooled statistics of the first
    BatchNorm (whose input no normalisation touches) are those of all the windows."""
    from edgeadapt.runtime import unlabeled

    # 51 windows of unequal classes, class 0 first, then 1, then 2: passes of 13, 13, 13 and 12
    y = np.repeat(np.arange(N_CLASSES), [25, 15, 11])
    X = windows(AMPLITUDE * np.eye(N_CLASSES)[y])
    runner = load(toy_bundle)
    adapter = UnlabeledAdapter(runner, UnlabeledSettings(**{**OFF, "stats_prior_windows": 20.0,
                                                            "stats_weighting": "count"}))
    passes = []
    real = unlabeled.UnlabeledAdapter._batch_statistics

    def spy(self, part):
        if len(part) > unlabeled.STATS_GROUP_WINDOWS:
            passes.append(np.bincount(part.mean(-1).argmax(1), minlength=N_CLASSES))
        return real(self, part)

    monkeypatch.setattr(unlabeled.UnlabeledAdapter, "_batch_statistics", spy)
    adapter.update(X)
    n_passes = -(-len(X) // unlabeled.STATS_BATCH_WINDOWS)
    assert len(passes) == n_passes > 1 and adapter._stats_n == len(X)
    assert len({int(c.sum()) for c in passes}) > 1  # uneven passes: pooling must weight by size
    share = np.bincount(y) / len(y)
    for counts in passes:  # each class within a window of its share of the batch
        assert np.all(np.abs(counts - counts.sum() * share) <= 1) and counts.sum() <= unlabeled.STATS_BATCH_WINDOWS
    mean, var = adapter._pooled("bn.running_mean")
    # Each pass's statistics are float32 reductions over <= 16 windows x 8 steps (relative
    # rounding <= 128 x 6e-8 ~ 8e-6), then divided by the measured (1 - momentum) = 0.1, which
    # amplifies the error about 10x: rtol 2e-4 covers that. Pooling the passes unweighted (their
    # class mixes differ by a window) would be off by ~1e-3.
    np.testing.assert_allclose(mean, X.mean(axis=(0, 2)), rtol=2e-4)
    np.testing.assert_allclose(var, X.var(axis=(0, 2)), rtol=2e-4)


def like_the_source(n: int, seed: int) -> np.ndarray:
    """Windows whose statistics are the toy's source ones (mean 0, variance 1 per channel): the
    windows' means spread with variance 1 - NOISE^2, the noise adds the rest."""
    rng = np.random.default_rng(seed)
    return windows(np.sqrt(1 - NOISE**2) * rng.standard_normal((n, N_CLASSES)), seed)


def test_shrinkage_weight_follows_the_evidence_of_a_shift(toy_bundle):
    """Shrinkage weighting: windows drawn like the source keep the source statistics in most
    draws (the toy has 3 channels, so the layer's estimate is noisy: the mean over 10 draws stays
    small); the same windows offset by 4 source standard deviations take (nearly) the target's,
    the running mean moves by w x the target's mean, and the result reports each layer's weight."""
    settings = UnlabeledSettings(**{**OFF, "stats_prior_windows": 64.0})
    assert settings.stats_weighting == "shrinkage"
    same = []
    for seed in range(10):
        X = like_the_source(40, seed)
        adapter = UnlabeledAdapter(load(toy_bundle), settings)
        adapter.update(X)
        same.append(adapter.stats_weight)
        runner = load(toy_bundle)
        shifted = UnlabeledAdapter(runner, settings)
        shifted.update(X + np.float32(4.0))
        w = shifted.layer_weights()
        assert list(w) == ["bn.running_mean"] and w["bn.running_mean"] > 0.95
        target_mean = X.mean(axis=(0, 2)) + 4.0
        np.testing.assert_allclose(runner._backend.get_tensor("bn.running_mean"),
                                   w["bn.running_mean"] * target_mean, atol=1e-4)
        assert shifted.finish().stats_layer_weights == pytest.approx(w)
    assert np.median(same) == 0.0 and np.mean(same) < 0.3, same


def test_statistics_repair_an_offset_that_fools_the_source(toy_bundle):
    """Channel 2 offset by 1.5 x AMPLITUDE: the source model calls everything class 2; the
    target's statistics (many windows, small N0) put the classes back."""
    X, y = balanced(30)
    X[:, 2] += 1.5 * AMPLITUDE
    runner = load(toy_bundle)
    assert accuracy(runner, X, y) < 0.5
    UnlabeledAdapter(runner, UnlabeledSettings(**{**OFF, "stats_prior_windows": 1.0})).update(X)
    assert accuracy(runner, X, y) > 0.95


def own_class_logit_mean(runner, X) -> float:
    """Mean over ``X`` of each window's logit for its predicted class."""
    logits = runner.predict(X)
    return float(logits.max(axis=1).mean())


def test_prototype_head_is_a_nearest_mean_classifier_on_the_source_scale(toy_bundle):
    """Class 0's windows moved next to class 1's (features (4, 4.4, 0)): the source head is
    unsure on them, so only classes 1 and 2 make prototypes (mu_1 = (0, 6, 0), mu_2 = (0, 0, 6)).
    Their rows become k * mu_c with k = |W rows| / |mu rows| = sqrt(2) / sqrt(72) = 1/6, i.e. the
    unit rows again; class 0 keeps its source row. The biases are -k |mu_c|^2 / 2 = -3 plus one
    common offset: the one that keeps the mean logit of the prototypes' own windows the source
    head's (6 there), so the two classes' biases end where they were (0) and a class with a
    prototype gains no prior over class 0, which has none."""
    y = np.repeat(np.arange(N_CLASSES), 20)
    means = AMPLITUDE * np.eye(N_CLASSES)[y]
    means[y == 0] = (4.0, 4.4, 0.0)
    X = windows(means, seed=1)
    runner = load(toy_bundle)
    own = X[y > 0]
    before = own_class_logit_mean(runner, own)
    adapter = UnlabeledAdapter(runner, UnlabeledSettings(**{**OFF, "prototype_mix": 1.0}))
    adapter.update(X)
    W = runner._backend.get_tensor("head.weight")
    b = runner._backend.get_tensor("head.bias")
    # tolerance: the prototypes are means of 20 windows x 8 steps of noise std 0.1 (~0.01 each)
    np.testing.assert_allclose(W[1:], [[0, 1, 0], [0, 0, 1]], atol=0.02)
    np.testing.assert_array_equal(W[0], [1, 0, 0])  # no confident class-0 window: the source row
    np.testing.assert_allclose(b[1:], [0.0, 0.0], atol=0.1)  # -3 + offset 3
    assert own_class_logit_mean(runner, own) == pytest.approx(before, abs=0.05)
    assert "prototypes" in adapter.stages()


def test_prototypes_of_one_class_do_not_pull_the_others(toy_bundle):
    """Label shift: the windows adapted on show class 1 only, far from the source's class-1 mean
    (8 instead of 6 on its channel). Its prototype is the only one; the offset keeps its windows'
    logit where the source head had it, so the windows of classes 0 and 2 stay right."""
    one = windows(np.tile([0.0, 8.0, 0.0], (30, 1)), seed=3)
    runner = load(toy_bundle)
    before = own_class_logit_mean(runner, one)
    adapter = UnlabeledAdapter(runner, UnlabeledSettings(**{**OFF, "prototype_mix": 1.0}))
    adapter.update(one)
    X, y = balanced(20, seed=4)
    assert accuracy(runner, X, y) == 1.0
    assert own_class_logit_mean(runner, one) == pytest.approx(before, abs=0.05)


def test_the_gate_refuses_an_adaptation_on_windows_of_one_class(toy_bundle):
    """Every window adapted on is predicted as class 1: they may show one activity, not a sensor
    shift, and the gate returns to the source model however stable the views (a mild gain on
    class 1's channel keeps every view's class) and reports the share."""
    X = windows(np.tile([0.0, 7.0, 0.0], (40, 1)), seed=5)
    runner = load(toy_bundle)
    result = runner.adapt_unlabeled(X, UnlabeledSettings(stats_prior_windows=0.0, stats_weighting="count",
                                                         prototype_mix=0.0, gate_fraction=0.5))
    assert not result.kept
    assert result.gate.adapt_max_class_share == 1.0
    assert any("predicted as one class" in r for r in result.gate.reasons), result.gate.reasons


def test_reliable_entropy_steps_train_and_anchor_pulls_back(toy_bundle):
    y = np.repeat(np.arange(N_CLASSES), 10)
    X = windows(1.5 * np.eye(N_CLASSES)[y])  # unsure predictions: entropy has room to fall
    free, anchored = load(toy_bundle), load(toy_bundle)
    source = free._backend.get_tensor("bn.bias")
    settings = dict(**OFF, entropy_steps=5, lr=0.05, entropy_threshold=1.0)
    UnlabeledAdapter(free, UnlabeledSettings(**settings, anchor=0.0)).update(X)
    UnlabeledAdapter(anchored, UnlabeledSettings(**settings, anchor=0.5)).update(X)
    moved_free = np.abs(free._backend.get_tensor("bn.bias") - source).max()
    moved_anchored = np.abs(anchored._backend.get_tensor("bn.bias") - source).max()
    assert moved_free > 1e-3
    assert moved_anchored < moved_free
    # the running statistics belong to stage 1 (off here): training steps must not move them
    np.testing.assert_array_equal(anchored._backend.get_tensor("bn.running_mean"), np.zeros(N_CLASSES, np.float32))


def test_no_reliable_window_means_no_step(toy_bundle):
    X, _ = balanced(5)
    runner = load(toy_bundle)
    adapter = UnlabeledAdapter(runner, UnlabeledSettings(**OFF, entropy_steps=3, entropy_threshold=0.0))
    adapter.update(X)
    assert adapter.stages() == () and runner.step == 0


def test_collapse_resets_the_stage(toy_bundle, monkeypatch):
    """A stage that makes the model call everything class 0 is undone and recorded."""
    X, _ = balanced(10)
    runner = load(toy_bundle)
    adapter = UnlabeledAdapter(runner, UnlabeledSettings(**{**OFF, "prototype_mix": 0.5}))
    head_before = runner._backend.get_tensor("head.weight"), runner._backend.get_tensor("head.bias")

    def collapse(X):
        runner._backend.set_tensor("head.weight", np.zeros((N_CLASSES, N_CLASSES), np.float32))
        runner._backend.set_tensor("head.bias", np.array([10.0, 0.0, 0.0], np.float32))

    monkeypatch.setattr(adapter, "_prototypes", collapse)
    adapter.update(X)
    assert len(adapter._resets) == 1 and adapter._resets[0].startswith("prototypes")
    np.testing.assert_array_equal(runner._backend.get_tensor("head.weight"), head_before[0])
    np.testing.assert_array_equal(runner._backend.get_tensor("head.bias"), head_before[1])


def test_gate_returns_to_source_when_adaptation_breaks_the_model(toy_bundle):
    """Windows of one class only with statistics fully the target's (N0 = 0): the BatchNorm
    removes the class signal and the predictions follow the noise, which the views do not share:
    the gate refuses and the runner holds the source model again, bit for bit."""
    X = windows(np.tile(AMPLITUDE * np.eye(N_CLASSES)[1], (40, 1)), seed=2)
    runner = load(toy_bundle)
    source = {n: runner._backend.get_tensor(n) for n in runner._backend.parameter_names()}
    result = runner.adapt_unlabeled(X, UnlabeledSettings(stats_prior_windows=0.0, stats_weighting="count",
                                                         prototype_mix=0.0,
                                                         gate_fraction=0.5))
    assert not result.kept and result.gate is not None and not result.gate.kept
    assert result.gate.reasons
    assert result.gate.adapted.view_agreement < result.gate.source.view_agreement
    for n, v in source.items():
        np.testing.assert_array_equal(runner._backend.get_tensor(n), v, err_msg=n)


def test_gate_keeps_a_helpful_adaptation(toy_bundle):
    X, y = balanced(30)
    X[:, 2] += 1.5 * AMPLITUDE
    runner = load(toy_bundle)
    # the source model calls every window class 2: two thirds change class, allowed here; and
    # windows all called one class cannot be told from one activity's (refused by default, see
    # test_the_gate_refuses_an_adaptation_on_windows_of_one_class): that check is off here
    gate = GateSettings(max_changed_fraction=0.8, label_shift_share=1.0)
    result = runner.adapt_unlabeled(X, UnlabeledSettings(stats_prior_windows=1.0, prototype_mix=0.0,
                                                         gate_settings=gate))
    assert result.kept and result.gate.kept and result.stages == ("stats",)
    assert result.n_gate_windows == result.n_adapt_windows == len(X)  # cross-fitted: every window, both roles
    assert accuracy(runner, X, y) > 0.95


def evidence_of(agreement: float, entropy: float, classes: list[int], views: int = 2) -> ModelEvidence:
    """Evidence whose first round(agreement x pairs) (window, view) pairs agree."""
    share = np.bincount(classes).max() / len(classes)
    pairs = views * len(classes)
    agrees = tuple(i < round(agreement * pairs) for i in range(pairs))
    return ModelEvidence(agreement, entropy, float(share), tuple(classes), agrees)


@pytest.mark.parametrize("lost, won, margin_sd, kept", [
    (1, 0, 1.0, True),    # one flip among 40 pairs: 1 > 1 x sqrt(1) is false
    (2, 0, 1.0, False),   # 2 > sqrt(2)
    (3, 1, 1.0, True),    # net 2, noise sqrt(4) = 2
    (5, 1, 1.0, False),   # net 4 > sqrt(6)
    (1, 0, 0.0, False),   # margin 0: any net loss refuses
    (0, 3, 1.0, True),    # only gains
])
def test_gate_agreement_is_a_paired_comparison(lost, won, margin_sd, kept):
    classes = [0, 1, 2, 0] * 5
    base = [True] * 30 + [False] * 10
    adapted_agrees = list(base)
    for i in range(lost):          # pairs the source gets and the adapted model loses
        adapted_agrees[i] = False
    for i in range(won):           # pairs only the adapted model gets
        adapted_agrees[30 + i] = True
    source = ModelEvidence(0.75, 0.3, 0.5, tuple(classes), tuple(base))
    adapted = ModelEvidence(float(np.mean(adapted_agrees)), 0.3, 0.5, tuple(classes), tuple(adapted_agrees))
    assert agreement_changes(source, adapted) == (lost, won)
    decision = decide(source, adapted, GateSettings(agreement_margin_sd=margin_sd))
    assert decision.kept == kept
    assert kept or "view agreement" in decision.reasons[0]


def test_gate_agreement_counts_windows_not_views():
    """Two views lost on one window (it sits at a class boundary: its views flip together) are one
    piece of evidence: net 2, standard deviation sqrt(2^2) = 2, kept; the same two views lost on
    two windows: net 2 > sqrt(1 + 1), refused."""
    classes = (0, 1, 2, 0, 1, 2, 0, 1)
    source = ModelEvidence(1.0, 0.3, 0.375, classes, (True,) * 16)
    one_window = tuple(i not in (0, 8) for i in range(16))   # window 0 in views 0 and 1
    two_windows = tuple(i not in (0, 1) for i in range(16))  # windows 0 and 1 in view 0
    assert agreement_loss(source, ModelEvidence(0.875, 0.3, 0.375, classes, one_window)) == (2, 2.0)
    assert agreement_loss(source, ModelEvidence(0.875, 0.3, 0.375, classes, two_windows)) == (2, pytest.approx(2**0.5))
    assert decide(source, ModelEvidence(0.875, 0.3, 0.375, classes, one_window), GateSettings()).kept
    assert not decide(source, ModelEvidence(0.875, 0.3, 0.375, classes, two_windows), GateSettings()).kept


@pytest.mark.parametrize("adapted, reason", [
    (evidence_of(0.99, 0.3, [0] * 20), "collapse"),
    (evidence_of(0.99, 0.001, [0, 1, 2, 1] * 5), "collapse"),
    (evidence_of(0.80, 0.3, [0, 1, 2, 0] * 5), "view agreement"),
    (evidence_of(0.99, 0.3, [1, 2, 0, 0] * 5), "changed class"),
])
def test_gate_criteria(adapted, reason):
    source = evidence_of(0.9, 0.3, [0, 1, 2, 0] * 5)
    decision = decide(source, adapted, GateSettings(max_changed_fraction=0.5))
    assert not decision.kept and any(reason in r for r in decision.reasons)
    assert decide(source, source, GateSettings()).kept


@pytest.mark.parametrize("counts, share, kept", [
    ([19, 1, 0], 0.95, False),   # nearly one class: refused
    ([18, 2, 0], 0.9, True),     # at the limit (0.9): kept
    ([7, 7, 6], 0.35, True),
    ([0, 0, 0], None, True),     # nothing adapted on: no evidence either way
])
def test_gate_refuses_adaptation_on_nearly_one_class(counts, share, kept):
    source = evidence_of(0.9, 0.3, [0, 1, 2, 0] * 5)
    decision = decide(source, source, GateSettings(), np.array(counts))
    assert decision.kept == kept and decision.adapt_max_class_share == share
    assert decision.only_label_shift == (not kept)  # the one objection (views, classes unchanged)
    assert kept or "predicted as one class" in decision.reasons[0]
    assert decide(source, source, GateSettings(label_shift_share=1.0), np.array([20, 0, 0])).kept
    both = decide(source, evidence_of(0.80, 0.3, [0, 1, 2, 0] * 5), GateSettings(), np.array([20, 0, 0]))
    assert len(both.reasons) == 2 and not both.only_label_shift  # views lost too: not label shift alone


def test_evidence_and_views():
    X = np.random.default_rng(0).standard_normal((10, 3, 20)).astype(np.float32)
    views = augmented_views(X, seed=0, n_views=3)
    assert len(views) == 3 and all(v.shape == X.shape and v.dtype == np.float32 for v in views)
    assert not np.array_equal(views[0], X)
    np.testing.assert_array_equal(augmented_views(X, seed=0, n_views=3)[1], views[1])  # seeded
    logits = np.eye(3)[[0, 1, 2, 0, 1, 2, 0, 1, 2, 0]] * 5
    e = evidence(logits, [logits, logits[::-1]])
    assert e.max_class_share == pytest.approx(0.4)
    assert e.view_agreement == pytest.approx((1.0 + np.mean(logits.argmax(1) == logits[::-1].argmax(1))) / 2)


def test_pooled_evidence_is_the_evidence_of_all_the_windows():
    """Evidence pooled over disjoint parts equals the evidence computed on all their windows at
    once (views view-major), on random logits of random part sizes."""
    rng = np.random.default_rng(3)
    for _ in range(50):
        sizes = rng.integers(1, 12, size=rng.integers(1, 5))
        n_views, n = int(rng.integers(0, 4)), int(sizes.sum())
        logits = rng.standard_normal((n, 4)) * 3
        views = [logits + rng.standard_normal((n, 4)) * 2 for _ in range(n_views)]
        cuts = np.cumsum(sizes)[:-1]
        parts = [evidence(c, [v[a:b] for v in views]) for c, (a, b) in
                 zip(np.split(logits, cuts), zip([0, *cuts], [*cuts, n]))]
        whole, pooled = evidence(logits, views), pool_evidence(parts)
        assert pooled.classes == whole.classes and pooled.view_agrees == whole.view_agrees
        assert pooled.view_agreement == pytest.approx(whole.view_agreement)
        assert pooled.mean_entropy == pytest.approx(whole.mean_entropy)
        assert pooled.max_class_share == pytest.approx(whole.max_class_share)
    with pytest.raises(ValueError, match="different numbers of views"):
        pool_evidence([evidence(logits[:2], [logits[:2]]), evidence(logits[2:4], [])])


def test_the_cross_fitted_gate_sees_every_window_once_with_the_source_model_on_it(toy_bundle):
    """Folds of the seeded permutation: the pooled source evidence is the source model's classes
    on every window in that order; the adaptation kept is the one made from every window (the
    statistics of all the windows, as a call without a gate makes them)."""
    X, _ = balanced(20)
    X[:, 2] += 1.5 * AMPLITUDE
    settings = UnlabeledSettings(stats_prior_windows=1.0, stats_weighting="count", prototype_mix=0.0,
                                 gate_settings=GateSettings(max_changed_fraction=1.0, label_shift_share=1.0))
    runner = load(toy_bundle)
    source_classes = runner.predict(X).argmax(axis=1)
    result = runner.adapt_unlabeled(X, settings)
    order = np.random.default_rng(settings.seed).permutation(len(X))
    assert result.cross_fitted and result.gate.n_windows == len(X)
    assert result.gate.source.classes == tuple(int(c) for c in source_classes[order])
    assert len(result.gate.adapted.view_agrees) == settings.gate_views * len(X)
    assert result.kept
    ungated = load(toy_bundle)
    ungated.adapt_unlabeled(X, UnlabeledSettings(**{**settings.to_dict(), "gate": False}))
    for name in runner._backend.parameter_names():
        if name.endswith(("running_mean", "running_var")):
            np.testing.assert_array_equal(runner._backend.get_tensor(name), ungated._backend.get_tensor(name))


def test_held_back_rows_of_a_view_are_the_rows_of_an_array(toy_bundle):
    """``hold_back`` takes a :class:`Rows` view (copied once, into the gate's buffer) and keeps
    what it keeps from the array of the same rows; what is left stays a view."""
    from edgeadapt.runtime.arrays import Rows

    X, _ = balanced(10)
    rows = np.random.default_rng(3).permutation(len(X))[:12]
    runner = load(toy_bundle)
    by_array = UnlabeledAdapter(runner, UnlabeledSettings(gate_windows=8), gate_rows=8)
    rest_array = by_array.hold_back(X[rows])
    by_view = UnlabeledAdapter(runner, UnlabeledSettings(gate_windows=8), gate_rows=8)
    rest_view = by_view.hold_back(Rows(X, rows))
    np.testing.assert_array_equal(by_view._gate_X, by_array._gate_X)
    np.testing.assert_array_equal(by_view._gate_X, X[rows[:8]])
    assert by_view._gate_source == by_array._gate_source
    assert isinstance(rest_view, Rows) and len(rest_view) == 4
    np.testing.assert_array_equal(np.asarray(rest_view), rest_array)


def test_one_held_back_fold_without_cross_fitting(toy_bundle):
    X, _ = balanced(20)
    result = load(toy_bundle).adapt_unlabeled(X, UnlabeledSettings(prototype_mix=0.0, cross_fit=False))
    assert not result.cross_fitted and result.n_gate_windows == 15 and result.n_adapt_windows == 45


@pytest.mark.parametrize("engine", ["ort-training", "portable"])
def test_the_eval_graph_returns_the_head_features(engine, toy_bundle, portable_toy):
    """Every engine's eval graph also returns the head's input: here the per-channel time means of
    the BatchNorm output, computed in float64 from the bundle's own statistics. No second session."""
    from edgeadapt.runtime.unlabeled import _EvalFeatures

    runner = load(toy_bundle if engine == "ort-training" else portable_toy)
    assert runner.manifest.head == {"weight": "head.weight", "bias": "head.bias", "transposed": True}
    adapter = UnlabeledAdapter(runner, UnlabeledSettings(**{**OFF, "prototype_mix": 0.3}))
    assert isinstance(adapter._head, _EvalFeatures)
    X = windows(np.random.default_rng(1).normal(0, 3, (9, N_CLASSES)))
    bn = {k: runner._backend.get_tensor(f"bn.{k}").astype(np.float64)
          for k in ("weight", "bias", "running_mean", "running_var")}
    want = ((X.astype(np.float64).mean(-1) - bn["running_mean"]) / np.sqrt(bn["running_var"] + 1e-5)
            * bn["weight"] + bn["bias"])
    feats, logits = adapter._head.run(X, batch_windows=4)
    # float32 normalisation and a mean over 8 steps: a few ulps of the largest value
    np.testing.assert_allclose(feats, want, rtol=0, atol=8 * np.finfo(np.float32).eps * np.abs(want).max())
    np.testing.assert_array_equal(logits, runner.predict(X))


@pytest.mark.parametrize("chunk", [1, 3, 4, 64])
def test_views_built_in_chunks_are_the_same_views(chunk):
    rng = np.random.default_rng(chunk)
    X = (rng.standard_normal((11, 3, 20)) * rng.uniform(0.1, 10, (11, 3, 1))).astype(np.float32)
    whole = augmented_views(X, seed=5, n_views=2)
    np.testing.assert_array_equal(np.stack(view_logits(X, 5, 2, lambda v: v, chunk)), np.stack(whole))
    sums = view_logits(X, 5, 2, lambda v: v.sum(axis=(1, 2))[:, None], chunk)  # a pass sees only its chunk
    np.testing.assert_array_equal(sums[1], whole[1].sum(axis=(1, 2))[:, None])


def held_arrays_bytes(adapter: UnlabeledAdapter) -> int:
    total = 0
    for value in vars(adapter).values():
        items = value.values() if isinstance(value, dict) else [value]
        total += sum(v.nbytes for v in items if isinstance(v, np.ndarray))
    return total


def test_stream_memory_does_not_grow(toy_bundle, caplog):
    """Many batches: what the adapter holds is the same after 300 and after 800 batches, and the
    Python/numpy heap does not grow with the batches. A leak grows the heap in every stretch of
    batches; the heap also grows once in a while by itself (numpy's cache of small buffers and
    onnxruntime's per-shape state: +2.5 KB by batch 100 measured alone; in the whole suite, jumps
    of 3-14 KB in one or two stretches of 100 batches after batch 100). So the first 300 batches
    are left out and the heap is read every 100 batches after them: the median of the five
    stretches' growth must stay under 5 batches (a leak of one batch per 10 batches grows every
    stretch by 10), which jumps in two stretches cannot move. The adapter's record of its last
    resets (at most MAX_RESETS_KEPT notes) fills as resets happen and is not growth, and the
    resets' warnings are not kept by the test's log capture (their level raised)."""
    caplog.set_level(logging.ERROR, logger="edgeadapt.runtime.unlabeled")
    runner = load(toy_bundle)
    adapter = UnlabeledAdapter(runner, UnlabeledSettings(stats_prior_windows=16.0, prototype_mix=0.3,
                                                         gate_windows=12, entropy_steps=1, lr=1e-3))
    batch_bytes = balanced(2)[0].nbytes
    batches, warm, stretch = 800, 300, 100
    traced: list[int] = []

    def notes_bytes() -> int:
        return sum(sys.getsizeof(n) for n in adapter._resets)

    tracemalloc.start()
    try:
        for i in range(batches):
            adapter.update(balanced(2, seed=i)[0])
            adapter.check_gate()
            if i >= warm - 1 and (i + 1 - warm) % stretch == 0:
                gc.collect()  # cyclic garbage waiting for the collector is no growth
                traced.append(tracemalloc.get_traced_memory()[0] - notes_bytes())
                if i == warm - 1:
                    held = held_arrays_bytes(adapter)
        assert held_arrays_bytes(adapter) == held
        assert len(adapter._resets) <= MAX_RESETS_KEPT
        growth = sorted(b - a for a, b in zip(traced, traced[1:]))
        assert len(growth) == 5 and growth[2] < 5 * batch_bytes, growth
    finally:
        tracemalloc.stop()
    result = adapter.finish()
    assert result.n_gate_windows == 12 and result.updates == batches - 2  # the first 12 windows were held back
    assert result.n_adapt_windows == batches * 6 - 12


def test_adapt_stream_matches_its_batches(toy_bundle):
    X, y = balanced(30)
    X[:, 2] += 0.9 * AMPLITUDE  # a shift the source model still gets right, which the statistics follow
    runner = load(toy_bundle)
    order = np.random.default_rng(0).permutation(len(X))
    result = runner.adapt_stream((X[order[i:i + 10]] for i in range(0, len(X), 10)),
                                 UnlabeledSettings(stats_prior_windows=1.0, prototype_mix=0.0, gate_windows=10,
                                                   gate_settings=GateSettings(max_changed_fraction=0.8)))
    assert result.kept and result.n_gate_windows == 10 and result.n_adapt_windows == 80
    assert accuracy(runner, X, y) > 0.95


def test_a_stream_of_bouts_holds_the_source_until_it_shows_several_classes(toy_bundle):
    """A stream whose batches are bouts of one activity each: after the first bout the gate
    objects only that the windows show one class, so the runner holds the source model and keeps
    the sums; once the next bouts show other classes the statistics are those of every window
    seen (count weighting, N0 = 1: w = 30 / 31 of the 30 windows' mean), with no reset."""
    shift = np.array([0.0, 0.0, 0.9 * AMPLITUDE], np.float32)[None, :, None]
    mixed, _ = balanced(4, seed=6)
    bouts = [windows(np.tile(AMPLITUDE * np.eye(N_CLASSES)[c], (10, 1)), seed=7 + c) + shift
             for c in range(N_CLASSES)]
    runner = load(toy_bundle)
    source_mean = runner._backend.get_tensor("bn.running_mean").copy()
    adapter = UnlabeledAdapter(runner, UnlabeledSettings(stats_prior_windows=1.0, stats_weighting="count",
                                                         prototype_mix=0.0, gate_windows=12))
    adapter.update(mixed + shift)  # held back for the gate
    adapter.update(bouts[0])
    assert not adapter.check_gate()
    np.testing.assert_array_equal(runner._backend.get_tensor("bn.running_mean"), source_mean)
    for bout in bouts[1:]:
        adapter.update(bout)
        assert adapter.check_gate()
    result = adapter.finish()
    assert result.kept and result.n_resets == 0 and result.n_adapt_windows == 30
    assert result.gate.adapt_max_class_share == pytest.approx(1 / 3)
    seen = np.concatenate(bouts)
    np.testing.assert_allclose(runner._backend.get_tensor("bn.running_mean"),
                               30 / 31 * seen.mean(axis=(0, 2)), atol=1e-4)


def test_settings_are_checked_and_round_trip():
    s = UnlabeledSettings(stats_prior_windows=32.0, prototype_mix=0.2)
    assert UnlabeledSettings.from_dict(s.to_dict()) == s
    with pytest.raises(ValueError, match="unknown label-free settings"):
        UnlabeledSettings.from_dict({"stats_prior": 3})
    with pytest.raises(ValueError, match="prototype_mix"):
        UnlabeledSettings(prototype_mix=2.0)
    with pytest.raises(ValueError, match="gate_fraction"):
        UnlabeledSettings(gate_fraction=1.0)


# ---- edgeadapt adapt --unlabeled ---------------------------------------------------------------
def _data_file(tmp_path, X, y):
    from edgeadapt.datasets import WindowDataset

    ds = WindowDataset(X, y.astype(np.int64), np.zeros(len(y), np.int64), tuple(f"c{k}" for k in range(N_CLASSES)),
                       tuple(f"ch{k}" for k in range(N_CLASSES)), None)
    return ds.save_npz(tmp_path / "data.npz")


@pytest.mark.parametrize("stream", [None, "8"])
def test_cli_adapt_unlabeled(tmp_path, toy_bundle, capsys, stream):
    import json

    from edgeadapt.cli import main

    X, y = balanced(40)
    X[:, 2] += 1.5 * AMPLITUDE
    data = _data_file(tmp_path, X, y)
    args = ["adapt", str(toy_bundle), "--data", str(data), "--out", str(tmp_path / "out"), "--unlabeled", "--json",
            "--device", "cpu"] + (["--stream-batch", stream] if stream else [])
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    gate_windows = UnlabeledSettings().gate_windows  # a stream's first ones are held back
    if stream is None:  # cross-fitted: every window adapted on, and held back once
        assert report["cross_fitted"] and report["n_gate_windows"] == report["n_adapt_windows"] == len(X)
    else:
        assert not report["cross_fitted"] and report["n_gate_windows"] == gate_windows
        assert report["n_gate_windows"] + report["n_adapt_windows"] == len(X)
    assert report["gate"] is not None and set(report["gate"]) >= {"kept", "reasons", "source", "adapted"}
    assert report["updates"] == (1 if stream is None else (len(X) - gate_windows) // 8)
    assert (tmp_path / "out" / "manifest.json").is_file()
    # what was saved is what the runner held after the gate
    runner = load(tmp_path / "out")
    assert (accuracy(runner, X, y) > 0.95) == report["kept"]
    if report["kept"]:  # the shift is far beyond the noise: the statistics are the target's
        assert report["stats_layer_weights"]["bn.running_mean"] > 0.9


def test_cli_puts_a_shuffled_file_back_in_recording_order_for_label_free_adaptation(tmp_path, toy_bundle):
    """The statistics' noise is measured on groups of neighbouring windows: a file that stores its
    windows shuffled but says where each came from is read in recording order (by recording, then
    start time); a file that does not say is read as stored."""
    import argparse

    from edgeadapt.bundle import read_manifest
    from edgeadapt.cli.common import load_data
    from edgeadapt.datasets import WindowDataset

    X, y = balanced(8)
    recording = np.repeat(np.arange(N_CLASSES), 8).astype(np.int64)  # one recording per activity
    start = (np.tile(np.arange(8), N_CLASSES) * TIME_STEPS).astype(np.int64)
    shuffle = np.random.default_rng(1).permutation(len(X))
    names = tuple(f"c{k}" for k in range(N_CLASSES)), tuple(f"ch{k}" for k in range(N_CLASSES))
    stored = WindowDataset(X[shuffle], y[shuffle].astype(np.int64), np.zeros(len(y), np.int64), *names, None,
                           recording=recording[shuffle], start_sample=start[shuffle])
    manifest = read_manifest(toy_bundle, verify=False)
    args = argparse.Namespace(data=str(stored.save_npz(tmp_path / "shuffled.npz")), sample_rate_hz=None)
    read, _ = load_data(args, manifest, labels=False)
    np.testing.assert_array_equal(read, X)  # back in recording order
    labelled, _ = load_data(args, manifest, labels=True, accuracy=True)
    np.testing.assert_array_equal(labelled, X[shuffle])  # labelled adaptation shuffles anyway: as stored
    unknown = WindowDataset(X[shuffle], y[shuffle].astype(np.int64), np.zeros(len(y), np.int64), *names, None)
    args.data = str(unknown.save_npz(tmp_path / "no_recordings.npz"))
    np.testing.assert_array_equal(load_data(args, manifest, labels=False)[0], X[shuffle])


def test_cli_adapt_unlabeled_reads_a_file_without_labels_or_subjects(tmp_path, toy_bundle, capsys):
    import json

    from edgeadapt.cli import main

    X, _ = balanced(20)
    X[:, 2] += 1.5 * AMPLITUDE
    np.savez(tmp_path / "unlabeled.npz", X=X.transpose(0, 2, 1))  # (windows, time, channels), nothing else
    out = tmp_path / "out"
    args = ["adapt", str(toy_bundle), "--data", str(tmp_path / "unlabeled.npz"), "--out", str(out), "--device", "cpu"]
    assert main(args) == 2  # labelled adaptation needs labels: named in the error
    assert "missing key 'y'" in capsys.readouterr().err
    assert main([*args, "--unlabeled", "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["n_gate_windows"] == report["n_adapt_windows"] == len(X)


@pytest.mark.parametrize("backend", ["ort-training", "portable"])
def test_cli_adapt_unlabeled_runs_on_a_labelled_loss_bundle_and_ignores_the_labels(tmp_path, capsys, backend):
    import json

    from edgeadapt.cli import main

    bundle = export_toy(tmp_path / "ce", backend, loss="cross_entropy")  # the export's default loss
    X, y = balanced(20)
    X[:, 2] += 1.5 * AMPLITUDE
    np.savez(tmp_path / "unlabeled.npz", X=X.transpose(0, 2, 1))
    for data in (tmp_path / "unlabeled.npz", _data_file(tmp_path, X, y)):
        out = tmp_path / f"out-{data.stem}"
        assert main(["adapt", str(bundle), "--data", str(data), "--out", str(out), "--unlabeled", "--json",
                     "--device", "cpu"]) == 0, capsys.readouterr().err
        report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert report["n_gate_windows"] == report["n_adapt_windows"] == len(X)


def test_cli_prints_the_statistics_weight(tmp_path, toy_bundle, capsys):
    from edgeadapt.cli import main

    X, y = balanced(40)
    X[:, 2] += 0.9 * AMPLITUDE
    args = ["adapt", str(toy_bundle), "--data", str(_data_file(tmp_path, X, y)), "--out", str(tmp_path / "out"),
            "--unlabeled", "--device", "cpu"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "statistics: target weight" in out and "over 1 BatchNorm layer (" in out


@pytest.mark.parametrize("extra, message", [(["--stream-batch", "4"], "add --unlabeled"),
                                            (["--unlabeled", "--stream-batch", "0"], "--stream-batch must be >= 1")])
def test_cli_unlabeled_bad_options(tmp_path, toy_bundle, capsys, extra, message):
    from edgeadapt.cli import main

    X, y = balanced(4)
    data = _data_file(tmp_path, X, y)
    assert main(["adapt", str(toy_bundle), "--data", str(data), "--out", str(tmp_path / "out"), *extra]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_add_head_output_only_for_a_linear_head():
    import onnx
    from onnx import TensorProto, helper

    from edgeadapt.runtime.head_features import HEAD_FEATURES_OUTPUT, add_head_output

    def model(ends_linear: bool, alias: bool = False):
        """Relu -> Gemm head (-> Relu when not ``ends_linear``; -> Identity with ``alias``, as the
        torch exporter writes a graph whose output is the head's), the weight and bias as inputs."""
        x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])
        w = helper.make_tensor_value_info("w", TensorProto.FLOAT, [3, 4])
        b = helper.make_tensor_value_info("b", TensorProto.FLOAT, [3])
        y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])
        nodes = [helper.make_node("Relu", ["x"], ["f"]),
                 helper.make_node("Gemm", ["f", "w", "b"], ["y" if ends_linear else "g"], transB=1)]
        if not ends_linear:
            nodes.append(helper.make_node("Relu", ["g"], ["y"]))
        if alias:
            nodes[-1].output[0] = "h"
            nodes.append(helper.make_node("Identity", ["h"], ["y"]))
        return helper.make_model(helper.make_graph(nodes, "m", [x, w, b], [y]))

    m = model(True)
    head = add_head_output(m, {"w", "b"}, "y")
    assert (head.weight, head.bias, head.transposed) == ("w", "b", True)
    assert [o.name for o in m.graph.output] == ["y", HEAD_FEATURES_OUTPUT]
    onnx.checker.check_model(m)
    assert add_head_output(m, {"w", "b"}, "y") is None  # already there: unchanged
    other = model(False)
    assert add_head_output(other, {"w", "b"}, "y") is None and len(other.graph.output) == 1
    assert add_head_output(model(True), {"b"}, "y") is None  # the weight is not a parameter
    aliased = model(True, alias=True)
    head = add_head_output(aliased, {"w", "b"}, "y")
    assert head is not None and (head.weight, head.bias) == ("w", "b")
    out = {o.output[0]: o for o in aliased.graph.node}[HEAD_FEATURES_OUTPUT]
    assert list(out.input) == ["f"], "the features are the Gemm's input, not the alias's"
    assert add_head_output(model(False, alias=True), {"w", "b"}, "y") is None
    for axis, found in ((-1, True), (0, False)):  # a log-softmax over the classes, then over the batch
        m = model(True)
        m.graph.node[-1].output[0] = "z"
        m.graph.node.append(helper.make_node("LogSoftmax", ["z"], ["y"], axis=axis))
        assert (add_head_output(m, {"w", "b"}, "y") is not None) == found


# ---- models the recipe meets in users' hands: no BatchNorm, no linear head, a log-softmax end ----
def _export_user_net(out, end: str, backend: str, norm: str = "group"):
    """Conv -> GroupNorm (no running statistics; ``norm="batch"``: BatchNorm) -> mean over time,
    then a linear head (``end="linear"``), a linear head and a log-softmax (``"log_softmax"``) or
    no head at all, the channels being the class scores (``"pooled"``); exported for label-free
    adaptation."""
    import torch
    from torch import nn

    from edgeadapt.export import UpdatePolicy, export_bundle

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv1d(N_CLASSES, 6 if end != "pooled" else N_CLASSES, 3, padding=1)
            channels = self.conv.out_channels
            self.norm = nn.GroupNorm(1, channels) if norm == "group" else nn.BatchNorm1d(channels)
            self.head = nn.Linear(6, N_CLASSES) if end != "pooled" else None

        def forward(self, x):
            f = torch.relu(self.norm(self.conv(x))).mean(-1)
            if self.head is None:
                return f
            z = self.head(f)
            return torch.log_softmax(z, -1) if end == "log_softmax" else z

    torch.manual_seed(0)
    example = torch.from_numpy(balanced(2)[0])
    export_bundle(Net().eval(), example, out, policy=UpdatePolicy.parse("bias-norm"), loss="entropy",
                  batchnorm="batch", backend=backend)
    return out


@pytest.mark.parametrize("backend", ["ort-training", "portable"])
def test_a_model_without_batchnorm_exports_and_adapts_label_free(tmp_path, backend):
    from edgeadapt.runtime import Runner

    bundle = _export_user_net(tmp_path / "b", "linear", backend)
    runner = Runner.load(bundle, device="cpu")
    result = runner.adapt_unlabeled(balanced(8)[0])
    assert "stats: the model has no BatchNorm running statistics to re-estimate" in result.skipped
    assert result.gate is not None and result.gate.n_windows > 0  # the prototype stage ran, gated
    assert runner.manifest.head is not None


@pytest.mark.parametrize("end", ["log_softmax", "pooled"])
def test_the_gate_runs_with_or_without_a_linear_head(tmp_path, end):
    """With BatchNorm the statistics stage runs; the gate judges it on the outputs alone."""
    from edgeadapt.runtime import Runner

    bundle = _export_user_net(tmp_path / "b", end, "ort-training", norm="batch")
    runner = Runner.load(bundle, device="cpu")
    assert (runner.manifest.head is not None) == (end == "log_softmax")
    result = runner.adapt_unlabeled(balanced(8)[0])  # the recommended defaults: statistics, prototypes
    assert result.gate is not None and result.gate.n_windows > 0, "the gate needs logits only"
    skipped_prototypes = any(s.startswith("prototypes:") for s in result.skipped)
    assert skipped_prototypes == (end == "pooled")


def test_a_label_free_bundle_is_evaluated_with_labels_for_the_accuracy(tmp_path, toy_bundle, capsys):
    import json

    from edgeadapt.cli import main
    from edgeadapt.runtime.errors import InputError

    runner = load(toy_bundle)
    X, y = balanced(6)
    y_wrong = (y + 1) % N_CLASSES
    loss_only = runner.evaluate(X)
    assert loss_only.accuracy is None
    with_labels = runner.evaluate(X, y)
    assert with_labels.accuracy == accuracy(runner, X, y) == 1.0
    assert runner.evaluate(X, y_wrong).accuracy == 0.0
    assert with_labels.loss == loss_only.loss  # the entropy: the labels change nothing but the accuracy
    with pytest.raises(InputError, match=r"labels in \[0, 3\] but the model has 3 classes"):
        runner.evaluate(X, np.arange(len(X)) % 4)
    with pytest.raises(InputError, match="integer class indices for the accuracy"):
        runner.evaluate(X, y.astype(np.float32))
    data = _data_file(tmp_path, X, y)
    assert main(["evaluate", str(toy_bundle), "--data", str(data), "--json", "--device", "cpu"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["accuracy"] == 1.0


def test_a_call_with_nothing_to_run_holds_nothing_back(tmp_path):
    from edgeadapt.runtime import Runner

    bundle = _export_user_net(tmp_path / "b", "pooled", "ort-training")  # no BatchNorm, no linear head
    result = Runner.load(bundle, device="cpu").adapt_unlabeled(balanced(8)[0])
    assert not result.kept and result.gate is None and result.n_gate_windows == 0
    assert {s.split(":")[0] for s in result.skipped} == {"stats", "prototypes"}
