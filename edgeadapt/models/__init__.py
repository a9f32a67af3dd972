"""Torch reference models, shared by the exporter, the server trainer and the benchmarks."""

from .gpt import GPT_PRESETS, GPTConfig, GPTDecoder, build_gpt, token_cross_entropy

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
    "GPT_PRESETS",
    "GPTConfig",
    "GPTDecoder",
    "build_gpt",
    "token_cross_entropy",
    "MODEL_NAMES",
    "CNN1d",
    "DecomposedLayerNorm",
    "MobileNet1d",
    "TinyTransformer1d",
    "build_model",
    "count_parameters",
]
