"""Building blocks of the adaptation experiments: split, pretrain, methods, run one method.

Shared by ``edgeadapt quickstart`` and ``benchmarks/loso.py`` (server side: uses torch to
pretrain and export; every adaptation itself runs in a torch-free job process).
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .adapt_job import AdaptJobSpec, run_job_in_subprocess
from .label_free_settings import UNLABELED_METHOD_SETTINGS
from ..datasets import ChannelNormalizer, WindowDataset, few_shot_split, label_shift_split, unlabeled_split

__all__ = ["Method", "METHODS", "ALL_METHODS", "LABEL_FREE", "FIXED_LR", "LR_GRID", "PRETRAIN_THREADS",
           "SplitData", "make_split", "sparse_policy", "method_recipe", "pinned_torch", "pretrain_source",
           "per_subject_accuracy", "save_target_data", "export_method", "run_method", "LrSelection",
           "fold_rng", "pick_validation_subjects", "validation_folds", "select_learning_rates"]

log = logging.getLogger(__name__)

# Settings fixed before any evaluation (the quickstart runs with these; the LOSO study selects
# the learning rate per fold on source subjects instead, see select_learning_rates):
# AdamW at 3e-3, weight decay 0.01, for every method that trains.
FIXED_LR = 3e-3
# The learning rates select_learning_rates tries for every method (it also tries FIXED_LR's
# neighbours: the grid spans 1e-3 .. 3e-2 in half-decade steps).
LR_GRID = (1e-3, 3e-3, 1e-2, 3e-2)
# Intra-op threads of the pretraining loop: pinned, so that the source model (and every figure
# after it) does not depend on the machine's core count.
PRETRAIN_THREADS = 1


@dataclass(frozen=True)
class Method:
    """One adaptation method: what the exported bundle trains and how.

    Attributes:
        name: the method's name in tables and on the command line.
        policy: an ``UpdatePolicy.parse`` spec, or ``None`` for the model's default sparse
            policy (:func:`sparse_policy`).
        loss: the bundle's loss; ``entropy`` is label-free.
        batchnorm: ``frozen`` (running statistics) or ``batch`` (batch statistics, running ones
            updated).
        trains: ``False``: the method adapts at learning rate 0 (only BatchNorm running
            statistics move), so no learning rate is selected for it.
        channel_ratio: replaces the ratio of every ``channels`` rule of the policy.
        description: one line for tables.
        memory_budget: a memory budget for the whole device ``adapt`` call (bytes or a string
            such as ``"256KiB"``): the planner picks what trains within it and ``policy`` is
            not used (see :func:`budget_method`).
        unlabeled: settings of ``Runner.adapt_unlabeled`` (JSON form, see
            :mod:`.label_free`): the method adapts with them instead of ``Runner.adapt``, at its
            own settings (no learning rate is selected or fixed for it).
    """

    name: str
    policy: str | None
    loss: str = "cross_entropy"
    batchnorm: str = "frozen"
    trains: bool = True
    channel_ratio: float | None = None
    description: str = ""
    memory_budget: int | str | None = None
    unlabeled: dict | None = None

    @property
    def label_free(self) -> bool:
        return self.loss == "entropy"

    def policy_for(self, model_name: str) -> str:
        """The policy spec for a reference model (``UpdatePolicy.parse`` form)."""
        spec = self.policy if self.policy is not None else sparse_policy(model_name)
        if self.channel_ratio is None:
            return spec
        return ",".join(f"{item.split('=')[0]}=channels:{self.channel_ratio:g}" if "=channels:" in item else item
                        for item in spec.split(","))


def _registry(*methods: Method) -> dict[str, Method]:
    return {m.name: m for m in methods}


# The adapted methods, in table order: the one place that defines them (the quickstart and the
# LOSO benchmark take their names from here). "source-only" adapts nothing.
METHODS: dict[str, Method] = _registry(
    Method("last-layer", "last-layer", description="the classifier head"),
    Method("bias-norm", "bias-norm", description="every bias + norm affine"),
    Method("bn-stats", "last-layer", loss="entropy", batchnorm="batch", trains=False,
           description="BatchNorm statistics re-estimated on the target, label-free"),
    Method("entropy", "bias-norm", loss="entropy", batchnorm="batch",
           description="entropy minimisation (Tent): biases + norm affine, batch statistics, label-free"),
    Method("sparse", None, description="head + 25% of the last block's output channels + its norm"),
    Method("sparse-12", None, channel_ratio=0.125, description="as sparse, 12.5% of the channels"),
    Method("full", "full", description="every parameter"),
    *(Method(name, "bias-norm", loss="entropy", batchnorm="batch", trains=False, unlabeled=settings,
             description=description)
      for name, settings, description in (
          ("anchored-bn", UNLABELED_METHOD_SETTINGS["anchored-bn"],
           "BatchNorm statistics mixed with the source's, w = n/(n+N0), label-free"),
          ("reliable-entropy", UNLABELED_METHOD_SETTINGS["reliable-entropy"],
           "entropy steps on confident windows, pulled back to the source values, label-free"),
          ("prototypes", UNLABELED_METHOD_SETTINGS["prototypes"],
           "class prototypes of confident windows mixed into the head, backprop-free, label-free"),
          ("label-free", UNLABELED_METHOD_SETTINGS["label-free"],
           "recommended: anchored statistics + prototypes, resets, safety gate back to the source"))),
)
ALL_METHODS = ("source-only", *METHODS)


def budget_method(memory_budget: int | str) -> str:
    """Register (once) and name the method that exports under ``memory_budget``: the planner
    chooses what trains (``export_bundle(memory_budget=...)``), cross-entropy, frozen BatchNorm."""
    name = f"budget-{memory_budget}"
    METHODS.setdefault(name, Method(name, "last-layer", memory_budget=memory_budget,
                                    description=f"the planner's choice within {memory_budget} per adapt call"))
    return name
LABEL_FREE = tuple(name for name, m in METHODS.items() if m.label_free)
@dataclass(frozen=True)
class SplitData:
    """One target subject's experiment data, normalised with statistics of the source subjects.

    Attributes:
        source_train: source-subject windows to pretrain on.
        source_val: held-out windows of the same source subjects (in-distribution accuracy).
        target_adapt: k labelled windows per class of the target subject.
        target_eval: the target subject's other windows, disjoint from ``target_adapt``.
        normalizer: per-channel statistics fitted on ``source_train`` only.
    """

    target_subject: int
    source_train: WindowDataset
    source_val: WindowDataset
    target_adapt: WindowDataset
    target_eval: WindowDataset
    normalizer: ChannelNormalizer


def make_split(ds: WindowDataset, target_subject: int, k_per_class: int, seed: int,
               val_fraction: float = 0.2, adapt_classes: int | None = None,
               unlabeled_fraction: float | None = None) -> SplitData:
    """Split ``ds`` for one target subject; normalisation is fitted on source training windows.

    ``adapt_classes``: the target's adaptation windows (as many as ``k_per_class`` x its classes)
    show only this many of its classes, in recording order (label shift,
    :func:`~edgeadapt.datasets.label_shift_split`); ``unlabeled_fraction``: they are the first
    fraction of each of its recordings (label-free methods only,
    :func:`~edgeadapt.datasets.unlabeled_split`); neither: ``k_per_class`` of every class."""
    if adapt_classes is not None and unlabeled_fraction is not None:
        raise ValueError("adapt_classes and unlabeled_fraction pick the adaptation windows two ways; give one")
    rng = np.random.default_rng(seed)
    source = np.flatnonzero(ds.subject != target_subject)
    if ds.recording is None:
        is_val = rng.random(source.size) < val_fraction
        train_idx, val_idx = source[~is_val], source[is_val]
    else:
        train_idx, val_idx = _split_recordings_in_time(ds, source, val_fraction)
    norm = ChannelNormalizer.fit(ds, train_idx)
    ds_n = norm.apply(ds)
    if unlabeled_fraction is not None:
        shot = unlabeled_split(ds_n, target_subject, unlabeled_fraction)
    elif adapt_classes is None:
        shot = few_shot_split(ds_n, target_subject, k_per_class, seed)
    else:
        shot = label_shift_split(ds_n, target_subject, k_per_class * ds.n_classes, adapt_classes, seed)
    return SplitData(target_subject, ds_n.subset(train_idx), ds_n.subset(val_idx),
                     ds_n.subset(shot.adapt_idx), ds_n.subset(shot.eval_idx), norm)


def _split_recordings_in_time(ds: WindowDataset, idx: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """The last ``val_fraction`` of every recording validates, the rest trains.

    Windows cut with overlap from one recording share samples, so a random split would leak;
    here a training window must end before the validation part starts (windows straddling the
    cut are dropped). Every recording, hence every class, keeps windows on both sides.
    """
    train, val = [], []
    length = ds.X.shape[2]
    for rec in np.unique(ds.recording[idx]):
        members = idx[ds.recording[idx] == rec]
        starts = ds.start_sample[members]
        cut = starts.min() + (1.0 - val_fraction) * (starts.max() + length - starts.min())
        val.append(members[starts >= cut])
        train.append(members[starts + length <= cut])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(val))


def sparse_policy(model_name: str) -> str:
    """The default sparse-update policy of a reference model (``UpdatePolicy.parse`` form).

    The head trains fully; the last feature block trains a quarter of its output channels
    (picked by weight magnitude), so the backward pass stops one block below the head.
    """
    return {
        "cnn": "head=full,blocks.3.conv=channels:0.25,blocks.3.bn=full",
        "mobilenet": "head=full,last.conv=channels:0.25,last.bn=full",
        "transformer": "head=full,norm=full,layers.1.mlp.fc2=channels:0.25",
    }[model_name]


def method_recipe(method: str, model_name: str) -> dict[str, Any]:
    """Export arguments of a method for a reference model: ``policy`` (spec), ``loss``, ``batchnorm``,
    and ``trains`` (``False``: adapted at learning rate 0)."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {tuple(METHODS)}, got {method!r}")
    m = METHODS[method]
    return dict(policy=m.policy_for(model_name), loss=m.loss, batchnorm=m.batchnorm, trains=m.trains)


@contextlib.contextmanager
def pinned_torch(threads: int = PRETRAIN_THREADS) -> Iterator[dict[str, Any]]:
    """Pin torch's intra-op threads and ask for deterministic algorithms inside the block.

    Yields the settings (threads, deterministic flag, torch's CPU kernel level) for a report;
    the previous settings are restored afterwards. Deterministic algorithms are requested with
    ``warn_only=True``: an op without a deterministic CPU kernel warns instead of failing.
    """
    import torch

    old_threads, old_det = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    old_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield {"threads": threads, "deterministic_algorithms": True,
               "cpu_capability": torch.backends.cpu.get_cpu_capability()}
    finally:
        torch.set_num_threads(old_threads)
        torch.use_deterministic_algorithms(old_det, warn_only=old_warn)


def pretrain_source(model_name: str, split: SplitData, *, epochs: int, seed: int, lr: float = 3e-3,
                    batch_size: int = 64, threads: int = PRETRAIN_THREADS, progress: bool = False):
    """Build a reference model and pretrain it on the source subjects (plain torch loop).

    Deterministic in ``seed`` on one machine: the initialisation is seeded as well as the
    training loop, and the loop runs on ``threads`` intra-op threads with deterministic
    algorithms (:func:`pinned_torch`); other thread counts or CPU kernels give other weights.
    """
    import torch

    from ..models import build_model
    from ..export.pretrain import pretrain

    tr = split.source_train
    with pinned_torch(threads):
        torch.manual_seed(seed)
        model = build_model(model_name, tr.X.shape[1], tr.n_classes, tr.X.shape[2])
        pretrain(model, tr.X, tr.y, epochs=epochs, batch_size=batch_size, lr=lr, weight_decay=1e-2,
                 seed=seed, progress=progress)
    return model.eval()


def per_subject_accuracy(model, ds: WindowDataset) -> dict[int, float]:
    """Accuracy of a torch model on each subject's windows of ``ds``."""
    from ..export.pretrain import accuracy

    return {int(s): accuracy(model, ds.X[ds.subject == s], ds.y[ds.subject == s]) for s in ds.subjects}


def save_target_data(split: SplitData, directory: Path) -> tuple[Path, Path]:
    """Write the target's adaptation and evaluation windows once, for every method's job to read."""
    directory.mkdir(parents=True, exist_ok=True)
    return (split.target_adapt.save_npz(directory / "target_adapt.npz"),
            split.target_eval.save_npz(directory / "target_eval.npz"))


def export_method(method: str, model, model_name: str, example_X: np.ndarray, bundle: Path, *,
                  lr: float = FIXED_LR, policy=None, batch_windows: int = 16,
                  progress: bool = False) -> dict[str, Any]:
    """Export ``model`` as ``method``'s bundle at ``bundle``; returns the recipe used.

    ``policy`` (an ``UpdatePolicy`` or its ``UpdatePolicy.parse`` spec) replaces the method's own
    policy; ``lr`` is the bundle's default learning rate (the jobs pass their own). A method with
    a memory budget is planned for ``len(example_X)`` adaptation windows in steps of
    ``batch_windows``, the planner choosing what trains, or fitting ``policy`` (e.g. the
    validated choice, :mod:`.validated_selection`) to the budget. ``progress``: the export's
    stages as a progress bar.
    """
    import torch

    from ..export import OptimizerConfig, UpdatePolicy, export_bundle

    recipe = method_recipe(method, model_name)
    budget = METHODS[method].memory_budget
    # the recipe names a given policy by its spec, or by its JSON form
    named = policy if isinstance(policy, str) or policy is None else json.dumps(policy.to_dict(), sort_keys=True)
    if isinstance(policy, str):
        policy = UpdatePolicy.parse(policy)
    if budget is not None:
        export_bundle(model, torch.from_numpy(example_X[:2]), bundle, memory_budget=budget, policy=policy,
                      n_windows=len(example_X), batch_windows=batch_windows, loss=recipe["loss"],
                      optimizer=OptimizerConfig("adamw", lr=lr, weight_decay=0.01), batchnorm=recipe["batchnorm"],
                      progress=progress)
        recipe["policy"] = f"planned within {budget}" + ("" if named is None else f": {named}")
        return recipe
    if policy is not None:
        recipe["policy"] = named
    export_bundle(model, torch.from_numpy(example_X[:2]), bundle,
                  policy=policy if policy is not None else UpdatePolicy.parse(recipe["policy"]),
                  loss=recipe["loss"], optimizer=OptimizerConfig("adamw", lr=lr, weight_decay=0.01),
                  batchnorm=recipe["batchnorm"], progress=progress)
    return recipe


def run_method(method: str, model, model_name: str, split: SplitData, target_data: tuple[Path, Path],
               workdir: Path, *, epochs: int, lr: float, batch_size: int = 16, seed: int = 0,
               threads: int | None = None, policy=None, unlabeled: dict | None = None,
               progress: bool = False) -> dict:
    """Export ``model`` for ``method`` and adapt it to the target in a torch-free process.

    ``target_data`` are the files :func:`save_target_data` wrote for ``split``. ``lr`` is the
    adaptation learning rate (a method that does not train runs at 0; a label-free method with
    ``unlabeled`` settings adapts with those, or with ``unlabeled`` given here, chosen per fold). ``policy`` (an
    ``UpdatePolicy`` or its ``UpdatePolicy.parse`` spec) replaces the method's own policy (a budget
    method fits it to its budget). ``threads``: the runner's
    intra-op threads. ``progress``: the export's stages as a progress bar. Returns the job
    report (accuracy before/after, step and call peaks, trainable elements, times) with the
    method, policy, loss, batchnorm and lr added.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    bundle = workdir / "bundle"
    # The bundle's default rate must be > 0; a method at rate 0 gets it from the job spec.
    recipe = export_method(method, model, model_name, split.target_adapt.X, bundle, lr=lr if lr > 0 else FIXED_LR,
                           policy=policy, batch_windows=batch_size, progress=progress)
    job_lr = lr if recipe["trains"] else 0.0
    spec = AdaptJobSpec(bundle=str(bundle), adapt_data=str(target_data[0]),
                        eval_data=str(target_data[1]), out_dir=str(workdir / "adapted"),
                        epochs=epochs, batch_size=batch_size, lr=job_lr, seed=seed, device="cpu", threads=threads,
                        unlabeled=unlabeled if unlabeled is not None else METHODS[method].unlabeled)
    report = run_job_in_subprocess(spec, workdir)
    report.update(method=method, policy=recipe["policy"], loss=recipe["loss"], batchnorm=recipe["batchnorm"],
                  lr=job_lr)
    log.info("%s: accuracy %.3f, step peak %s bytes, adapt-call peak %s bytes", method, report["accuracy_after"],
             report["step_peak_bytes"], report["call_peak_bytes"])
    return report


@dataclass(frozen=True)
class LrSelection:
    """The learning rate chosen for one method on source subjects only.

    Attributes:
        method: the method's name.
        lr: the chosen learning rate (the best mean accuracy over the validation subjects; ties
            go to the smaller rate).
        grid: the rates tried.
        mean_accuracy: per rate, the mean accuracy over the validation subjects.
        validation_subjects: the source subjects that played the target in turn.
    """

    method: str
    lr: float
    grid: tuple[float, ...]
    mean_accuracy: tuple[float, ...]
    validation_subjects: tuple[int, ...]


def fold_rng(seed: int, target_subject: int | None) -> np.random.Generator:
    """The generator of a fold's seeded choices on source data (``target_subject``: the fold's
    held-out subject, ``None`` outside a fold), so that folds differ and each is reproducible."""
    return np.random.default_rng([seed, 0 if target_subject is None else target_subject])


def pick_validation_subjects(source: WindowDataset, n: int, seed: int, target_subject: int | None) -> list[int]:
    """The ``n`` source subjects (at most all but one) that play the new subject in turn when a
    setting is chosen on source subjects; a seeded choice that differs between folds
    (``target_subject``: the fold's held-out subject, ``None`` outside a fold)."""
    size = min(n, len(source.subjects) - 1)
    return sorted(int(s) for s in fold_rng(seed, target_subject).choice(source.subjects, size=size, replace=False))


def validation_folds(source: WindowDataset, target_subject: int | None, pretrain, *, n: int, k_per_class: int,
                     pretrain_epochs: int, seed: int,
                     unlabeled_fraction: float | None = None) -> Iterator[tuple[int, SplitData, Any]]:
    """Per validation subject (:func:`pick_validation_subjects`): the subject, its split of
    ``source`` (the subject plays the new one) and a model pretrained on the other source
    subjects, made one at a time.

    ``pretrain``: a reference model's name (:func:`pretrain_source` with ``pretrain_epochs``) or
    a function taking the split and returning the model trained on its ``source_train``.
    ``target_subject``: the fold's held-out subject (``None``: no fold), mixed into the pick.
    ``unlabeled_fraction``: the validation subject's adaptation windows are the first fraction of
    its recordings (:func:`make_split`).

    Raises:
        ValueError: ``source`` still holds ``target_subject``'s windows.
    """
    if target_subject is not None and np.any(source.subject == target_subject):
        raise ValueError(f"the source windows still hold subject {target_subject}, the fold's target; "
                         "remove it first (ds.subset(ds.subject != target))")
    for v in pick_validation_subjects(source, n, seed, target_subject):
        split = make_split(source, v, k_per_class, seed, unlabeled_fraction=unlabeled_fraction)
        model = (pretrain_source(pretrain, split, epochs=pretrain_epochs, seed=seed) if isinstance(pretrain, str)
                 else pretrain(split).eval())
        yield v, split, model


def select_learning_rates(ds: WindowDataset, target_subject: int, methods: list[str], model_name: str, *,
                          workdir: Path, validation_subjects: int = 2, grid: tuple[float, ...] = LR_GRID,
                          k_per_class: int, epochs: int, pretrain_epochs: int, batch_size: int = 16,
                          seed: int = 0, threads: int | None = None,
                          unlabeled_fraction: float | None = None) -> dict[str, LrSelection]:
    """Choose each method's learning rate by leave-one-source-subject-out, never on the target.

    The target subject's windows are dropped first. Then ``validation_subjects`` of the
    remaining (source) subjects, picked with ``seed``, each play the new subject once: a model
    is pretrained on the other source subjects, exported per method, and adapted from
    ``k_per_class`` of the validation subject's windows per class at every rate in ``grid``;
    accuracy on the validation subject's other windows decides. Adaptation runs in this process
    (accuracy does not depend on torch being importable; no memory is measured here).
    ``unlabeled_fraction``: the validation subjects adapt on the first fraction of their
    recordings instead, as the fold's target then does (label-free methods only).

    Returns:
        ``{method: LrSelection}`` for every method in ``methods`` that trains.
    """
    from ..runtime import Runner

    trained = [m for m in methods if METHODS[m].trains]
    source = ds.subset(ds.subject != target_subject)
    acc: dict[str, list[list[float]]] = {m: [[] for _ in grid] for m in trained}
    chosen = []
    for v, split, model in validation_folds(source, target_subject, model_name, n=validation_subjects,
                                            k_per_class=k_per_class, pretrain_epochs=pretrain_epochs, seed=seed,
                                            unlabeled_fraction=unlabeled_fraction):
        chosen.append(v)
        ad, ev = split.target_adapt, split.target_eval
        for m in trained:
            bundle = workdir / f"select-{target_subject}-{v}-{m}"
            export_method(m, model, model_name, ad.X, bundle)
            labels = None if METHODS[m].label_free else ad.y
            for i, lr in enumerate(grid):
                runner = Runner.load(bundle, device="cpu", threads=threads)
                runner.adapt(ad.X, labels, epochs=epochs, batch_size=batch_size, lr=lr, seed=seed, progress=False)
                logits = runner.predict(ev.X)
                acc[m][i].append(float((logits.argmax(1) == ev.y).mean()))
            log.info("fold %s, validation subject %s, %s: %s", target_subject, v, m,
                     ", ".join(f"{lr:g} -> {a[-1]:.3f}" for lr, a in zip(grid, acc[m])))
    out = {}
    for m in trained:
        means = tuple(float(np.mean(a)) for a in acc[m])
        best = max(range(len(grid)), key=lambda i: (round(means[i], 9), -grid[i]))
        out[m] = LrSelection(m, float(grid[best]), tuple(grid), means, tuple(chosen))
    return out
