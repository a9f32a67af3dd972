"""Torch reference models, shared by the exporter, the server trainer and the benchmarks."""

from .reference import (
    MODEL_NAMES,
    CNN1d,
    DecomposedLayerNorm,
    MobileNet1d,
    TinyTransformer1d,
    build_model,
    count_parameters,
)

__all__ = [
    "MODEL_NAMES",
    "CNN1d",
    "DecomposedLayerNorm",
    "MobileNet1d",
    "TinyTransformer1d",
    "build_model",
    "count_parameters",
]
