"""Give a fresh model's norm layers the distinct values a trained model has (tests, benchmarks)."""

from __future__ import annotations

__all__ = ["as_if_pretrained"]


def as_if_pretrained(model, generator=None):
    """Draw every BatchNorm's running statistics and every BatchNorm/LayerNorm's affine values.

    A fresh BatchNorm has ``weight == running_var == 1`` and ``bias == running_mean == 0``;
    besides being unlike a trained model, the legacy ONNX exporter in eval mode merges
    initializers with identical values, so such parameters would vanish from the graph.

    Per BatchNorm (in module order): ``running_mean ~ U(-0.5, 0.5)``, ``running_var ~ U(0.5, 2)``,
    ``weight ~ U(0.5, 1.5)``, ``bias ~ U(-0.2, 0.2)``; per LayerNorm ``weight``, then ``bias``,
    the same ranges. Drawn from ``generator`` (a ``torch.Generator``), or torch's global one.

    Returns:
        ``model`` (changed in place).
    """
    import torch
    from torch import nn

    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats:
                m.running_mean.uniform_(-0.5, 0.5, generator=generator)
                m.running_var.uniform_(0.5, 2.0, generator=generator)
            if isinstance(m, (nn.modules.batchnorm._BatchNorm, nn.LayerNorm)) and m.weight is not None:
                m.weight.uniform_(0.5, 1.5, generator=generator)
                if m.bias is not None:
                    m.bias.uniform_(-0.2, 0.2, generator=generator)
    return model
