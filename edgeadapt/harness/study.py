"""Building blocks of the adaptation experiments: split, pretrain, methods, run one method.

Shared by ``edgeadapt quickstart`` and ``benchmarks/loso.py`` (server side: uses torch to
pretrain and export; every adaptation itself runs in a torch-free job process).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .adapt_job import AdaptJobSpec, run_job_in_subprocess
from ..datasets import ChannelNormalizer, WindowDataset, few_shot_split

__all__ = ["METHODS", "LABEL_FREE", "SplitData", "make_split", "sparse_policy", "method_recipe",
           "pretrain_source", "per_subject_accuracy", "save_target_data", "run_method"]

log = logging.getLogger(__name__)

# Methods compared side by side. "source-only" adapts nothing.
METHODS = ("source-only", "last-layer", "bias-norm", "bn-stats", "entropy", "sparse", "full")
LABEL_FREE = ("bn-stats", "entropy")


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
               val_fraction: float = 0.2) -> SplitData:
    """Split ``ds`` for one target subject; normalisation is fitted on source training windows."""
    rng = np.random.default_rng(seed)
    source = np.flatnonzero(ds.subject != target_subject)
    if ds.recording is None:
        is_val = rng.random(source.size) < val_fraction
        train_idx, val_idx = source[~is_val], source[is_val]
    else:
        train_idx, val_idx = _split_recordings_in_time(ds, source, val_fraction)
    norm = ChannelNormalizer.fit(ds, train_idx)
    ds_n = norm.apply(ds)
    shot = few_shot_split(ds_n, target_subject, k_per_class, seed)
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
    """Export arguments (policy spec, loss, batchnorm) and the adaptation learning-rate factor.

    bn-stats re-estimates BatchNorm statistics on the target's windows, label-free: a bundle
    that normalises with batch statistics (updating the running ones), run at learning rate 0.
    entropy minimises prediction entropy (Tent): norm affine + biases, batch statistics.
    """
    recipes = {
        "last-layer": dict(policy="last-layer", loss="cross_entropy", batchnorm="frozen", lr_scale=1.0),
        # 582 elements: a 10x learning rate is best (LOSO sweep: synthetic 0.79 -> 0.85, watch 0.91 -> 0.94)
        "bias-norm": dict(policy="bias-norm", loss="cross_entropy", batchnorm="frozen", lr_scale=10.0),
        "bn-stats": dict(policy="last-layer", loss="entropy", batchnorm="batch", lr_scale=0.0),
        "entropy": dict(policy="bias-norm", loss="entropy", batchnorm="batch", lr_scale=0.1),
        "sparse": dict(policy=sparse_policy(model_name), loss="cross_entropy", batchnorm="frozen", lr_scale=1.0),
        "full": dict(policy="full", loss="cross_entropy", batchnorm="frozen", lr_scale=0.3),
    }
    if method not in recipes:
        raise ValueError(f"method must be one of {METHODS[1:]}, got {method!r}")
    return recipes[method]


def pretrain_source(model_name: str, split: SplitData, *, epochs: int, seed: int, lr: float = 3e-3,
                    batch_size: int = 64, progress: bool = False):
    """Build a reference model and pretrain it on the source subjects (plain torch loop).

    Deterministic in ``seed``: the initialisation is seeded as well as the training loop.
    """
    import torch

    from ..models import build_model
    from ..export.pretrain import pretrain

    tr = split.source_train
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


def run_method(method: str, model, model_name: str, split: SplitData, target_data: tuple[Path, Path],
               workdir: Path, *, epochs: int, lr: float, batch_size: int = 16, seed: int = 0,
               threads: int | None = None, policy: str | None = None) -> dict:
    """Export ``model`` for ``method`` and adapt it to the target in a torch-free process.

    ``target_data`` are the files :func:`save_target_data` wrote for ``split``. ``policy`` (an
    ``UpdatePolicy.parse`` spec) replaces the method's own policy.
    Returns the job report (accuracy before/after, peak step memory, trainable elements, times).
    """
    import torch

    from ..export import OptimizerConfig, UpdatePolicy, export_bundle

    recipe = method_recipe(method, model_name)
    if policy is not None:
        recipe["policy"] = policy
    workdir.mkdir(parents=True, exist_ok=True)
    bundle = workdir / "bundle"
    example = torch.from_numpy(split.target_adapt.X[:2])
    export_bundle(model, example, bundle, policy=UpdatePolicy.parse(recipe["policy"]), loss=recipe["loss"],
                  optimizer=OptimizerConfig("adamw", lr=lr, weight_decay=0.01), batchnorm=recipe["batchnorm"])
    spec = AdaptJobSpec(bundle=str(bundle), adapt_data=str(target_data[0]),
                        eval_data=str(target_data[1]), out_dir=str(workdir / "adapted"),
                        epochs=epochs, batch_size=batch_size, lr=lr * recipe["lr_scale"], seed=seed,
                        device="cpu", threads=threads)
    report = run_job_in_subprocess(spec, workdir)
    report.update(method=method, policy=recipe["policy"], loss=recipe["loss"], batchnorm=recipe["batchnorm"])
    log.info("%s: accuracy %.3f, peak step %.1f MB", method, report["accuracy_after"],
             report["peak_step_delta_bytes"] / 2**20)
    return report
