"""Losses and optimizers of the training artifacts, as ONNX Runtime onnxblock graphs.

Losses (mean over the batch, as torch's defaults):
    cross_entropy    logits (N, C) and int64 labels (N,)
    mse              output and float labels of the same shape
    bce_with_logits  logits and float targets in [0, 1] of the same shape
    entropy          label-free: mean over the batch of H(softmax(logits)) (entropy minimisation)

Optimizers follow torch semantics: ``adamw`` is torch.optim.AdamW (decoupled decay applied
before the moment update); ``sgd`` is plain SGD without momentum.
"""

from __future__ import annotations

import functools

import onnx

from ..bundle import LOSSES, OPTIMIZERS  # the manifest's vocabulary, spelled once
from ..optimizer_config import OptimizerConfig

__all__ = ["LOSSES", "OPTIMIZERS", "OptimizerConfig", "entropy_loss_block", "loss_block", "optimizer_block",
           "use_torch_adamw", "torch_loss"]


@functools.cache
def _entropy_loss_class():
    # onnxruntime.training is imported only when ORT-training artifacts are built: a portable-only
    # export runs where it is not installed.
    from onnxruntime.training import onnxblock
    from onnxruntime.training.onnxblock import _graph_utils

    class EntropyLoss(onnxblock.Block):
        """Mean Shannon entropy of softmax(logits) over the last axis: a label-free objective."""

        def build(self, logits_name: str) -> str:
            g = self.base.graph
            p = _graph_utils.generate_graph_name("entropy.p")
            logp = _graph_utils.generate_graph_name("entropy.logp")
            plogp = _graph_utils.generate_graph_name("entropy.plogp")
            axes = _graph_utils.generate_graph_name("entropy.axes")
            per_sample = _graph_utils.generate_graph_name("entropy.per_sample")
            neg_mean = _graph_utils.generate_graph_name("entropy.neg_mean")
            out = _graph_utils.generate_graph_name("entropy.loss")
            g.initializer.append(onnx.helper.make_tensor(axes, onnx.TensorProto.INT64, [1], [-1]))
            g.node.extend([
                onnx.helper.make_node("Softmax", [logits_name], [p], axis=-1, name=p + "_node"),
                onnx.helper.make_node("LogSoftmax", [logits_name], [logp], axis=-1, name=logp + "_node"),
                onnx.helper.make_node("Mul", [p, logp], [plogp], name=plogp + "_node"),
                onnx.helper.make_node("ReduceSum", [plogp, axes], [per_sample], keepdims=0, name=per_sample + "_node"),
                onnx.helper.make_node("ReduceMean", [per_sample], [neg_mean], keepdims=0, name=neg_mean + "_node"),
                onnx.helper.make_node("Neg", [neg_mean], [out], name=out + "_node"),
            ])
            return out

    return EntropyLoss


def entropy_loss_block():
    """An onnxblock loss block: mean Shannon entropy of softmax(logits) over the last axis
    (a label-free objective)."""
    return _entropy_loss_class()()


def loss_block(loss: str):
    """The ``generate_artifacts`` loss argument for a loss name."""
    from onnxruntime.training import artifacts

    builtin = {
        "cross_entropy": artifacts.LossType.CrossEntropyLoss,
        "mse": artifacts.LossType.MSELoss,
        "bce_with_logits": artifacts.LossType.BCEWithLogitsLoss,
    }
    if loss == "entropy":
        return entropy_loss_block()
    if loss not in builtin:
        raise ValueError(f"loss must be one of {LOSSES}, got {loss!r}")
    return builtin[loss]


def optimizer_block(cfg: OptimizerConfig):
    """The ``generate_artifacts`` optimizer argument (an onnxblock block) for a configuration."""
    from onnxruntime.training import onnxblock

    if cfg.name == "sgd":
        return onnxblock.optim.SGD()
    return onnxblock.optim.AdamW(bias_correction=True, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)


def use_torch_adamw(optimizer_model: onnx.ModelProto) -> int:
    """Switch every AdamWOptimizer node to torch.optim.AdamW semantics (``adam_mode=0``).

    onnxblock builds the Hugging Face variant (``adam_mode=1``), which applies weight decay after
    the moment update; torch applies it before. Returns the number of nodes changed.
    """
    changed = 0
    for node in optimizer_model.graph.node:
        if node.op_type == "AdamWOptimizer":
            for attr in node.attribute:
                if attr.name == "adam_mode":
                    attr.i = 0
                    changed += 1
    return changed


def torch_loss(loss: str, output, labels):
    """The torch value of a loss, as the training graph computes it (mean over the batch)."""
    import torch

    if loss == "cross_entropy":
        return torch.nn.functional.cross_entropy(output, labels)
    if loss == "mse":
        return torch.nn.functional.mse_loss(output, labels)
    if loss == "bce_with_logits":
        return torch.nn.functional.binary_cross_entropy_with_logits(output, labels)
    if loss == "entropy":
        p = torch.softmax(output, -1)
        return -(p * torch.log_softmax(output, -1)).sum(-1).mean()
    raise ValueError(f"loss must be one of {LOSSES}, got {loss!r}")
