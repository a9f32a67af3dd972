"""Reference models for 1D biosignal windows.

Every model maps a float32 tensor of shape ``(batch, channels, time_steps)`` to class logits of
shape ``(batch, n_classes)`` and ends in a ``torch.nn.Linear`` named ``head``, so that an update
policy can name "the last layer" the same way for each of them. Submodules carry short, stable
names (``blocks.0.conv``, ``blocks.2.depthwise.bn``, ``layers.1.attn.q``, ``head``) because
sparse-update policies address parameters by these dotted names.

The models are written for the legacy ONNX exporter (``torch.onnx.export(..., dynamo=False)``)
and for ONNX Runtime's gradient builder: no ``scaled_dot_product_attention``, no
``nn.MultiheadAttention`` (its fused fast path does not export as plain ops), no in-place
operations, no data-dependent control flow, and reshapes that keep the batch axis symbolic so
that a dynamic batch axis survives export.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import torch
from torch import nn

__all__ = [
    "MODEL_NAMES",
    "CNN1d",
    "DecomposedLayerNorm",
    "MobileNet1d",
    "TinyTransformer1d",
    "build_model",
    "count_parameters",
]

logger = logging.getLogger(__name__)

MODEL_NAMES: tuple[str, ...] = ("cnn", "mobilenet", "transformer")
"""Names accepted by :func:`build_model`."""


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


def count_parameters(model: nn.Module, trainable_only: bool = False) -> int:
    """Counts the scalar parameters (elements) of a model.

    Args:
        model: Any module.
        trainable_only: Count only parameters with ``requires_grad``.

    Returns:
        The total number of parameter elements (buffers such as BatchNorm statistics excluded).
    """
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


# --------------------------------------------------------------------------------------------
# CNN1d
# --------------------------------------------------------------------------------------------


class ConvBlock(nn.Module):
    """Conv1d + BatchNorm1d + ReLU, with "same" padding and an optional stride.

    The convolution has no bias: the BatchNorm shift that follows plays that role.

    Args:
        in_channels: Input channels.
        out_channels: Output channels.
        kernel_size: Odd kernel size.
        stride: Temporal stride (2 halves the time axis).
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int = 1):
        super().__init__()
        self.conv = nn.Conv1d(
            in_channels, out_channels, kernel_size, stride=stride, padding=kernel_size // 2,
            bias=False,
        )
        self.bn = nn.BatchNorm1d(out_channels)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Applies conv, batch norm and ReLU."""
        return self.act(self.bn(self.conv(x)))


class CNN1d(nn.Module):
    """A plain 1D CNN: strided conv blocks, global average pooling, a linear head.

    Parameter names: ``blocks.{i}.conv.weight``, ``blocks.{i}.bn.weight``,
    ``blocks.{i}.bn.bias``, ``head.weight``, ``head.bias``. Each block halves the time axis
    (stride 2), so the receptive field grows geometrically; any input length >= 1 is accepted.

    Args:
        n_channels: Input channels of the signal.
        n_classes: Number of output logits.
        widths: Output channels of each conv block (one block per entry).
        kernel_size: Odd kernel size of every convolution.
        stride: Temporal stride of every block.
    """

    def __init__(
        self,
        n_channels: int,
        n_classes: int,
        widths: Sequence[int] = (32, 64, 64, 128),
        kernel_size: int = 7,
        stride: int = 2,
    ):
        super().__init__()
        _check_positive(n_channels=n_channels, n_classes=n_classes, kernel_size=kernel_size,
                        stride=stride)
        widths = tuple(widths)
        if not widths:
            raise ValueError("widths must name at least one block")
        _check_positive(**{f"widths[{i}]": w for i, w in enumerate(widths)})
        if kernel_size % 2 == 0:
            raise ValueError(f"kernel_size must be odd for 'same' padding, got {kernel_size}")
        self.n_channels = n_channels
        self.n_classes = n_classes
        in_widths = (n_channels,) + widths[:-1]
        self.blocks = nn.Sequential(
            *(ConvBlock(c_in, c_out, kernel_size, stride) for c_in, c_out in zip(in_widths, widths))
        )
        self.head = nn.Linear(widths[-1], n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Maps ``(batch, n_channels, time_steps)`` to logits ``(batch, n_classes)``."""
        x = self.blocks(x)
        return self.head(x.mean(dim=-1))


# --------------------------------------------------------------------------------------------
# MobileNet1d
# --------------------------------------------------------------------------------------------


class ConvBNAct(nn.Module):
    """Conv1d (no bias) + BatchNorm1d + optional ReLU6.

    Args:
        in_channels: Input channels.
        out_channels: Output channels.
        kernel_size: Odd kernel size ("same" padding).
        stride: Temporal stride.
        groups: Convolution groups (``groups == in_channels`` makes it depthwise).
        act: Whether to apply ReLU6 after the batch norm (False for a linear bottleneck).
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int = 1,
        stride: int = 1,
        groups: int = 1,
        act: bool = True,
    ):
        super().__init__()
        self.conv = nn.Conv1d(
            in_channels, out_channels, kernel_size, stride=stride, padding=kernel_size // 2,
            groups=groups, bias=False,
        )
        self.bn = nn.BatchNorm1d(out_channels)
        self.act = nn.ReLU6() if act else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Applies conv, batch norm and the activation."""
        return self.act(self.bn(self.conv(x)))


class InvertedResidual(nn.Module):
    """MobileNet-V2 inverted residual block in 1D.

    Pointwise expansion (``expand``), depthwise temporal convolution (``depthwise``) and a
    linear pointwise projection (``project``), each with its own BatchNorm; the input is added
    back when stride is 1 and the channel counts match.

    Args:
        in_channels: Input channels.
        out_channels: Output channels.
        stride: Temporal stride of the depthwise convolution.
        expand_ratio: Hidden channels = ``in_channels * expand_ratio``.
        kernel_size: Odd kernel size of the depthwise convolution.
    """

    def __init__(
        self, in_channels: int, out_channels: int, stride: int, expand_ratio: int, kernel_size: int
    ):
        super().__init__()
        hidden = in_channels * expand_ratio
        self.expand = ConvBNAct(in_channels, hidden, kernel_size=1)
        self.depthwise = ConvBNAct(hidden, hidden, kernel_size, stride=stride, groups=hidden)
        self.project = ConvBNAct(hidden, out_channels, kernel_size=1, act=False)
        self.use_residual = stride == 1 and in_channels == out_channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Applies the block; ``use_residual`` is fixed at construction, not data-dependent."""
        out = self.project(self.depthwise(self.expand(x)))
        return x + out if self.use_residual else out


class MobileNet1d(nn.Module):
    """A small MobileNet-V2-style 1D network.

    Layout: ``stem`` (ConvBNAct, stride 2) -> ``blocks`` (inverted residuals) -> ``last``
    (pointwise ConvBNAct to ``last_width``) -> global average pooling -> ``head``.

    Args:
        n_channels: Input channels of the signal.
        n_classes: Number of output logits.
        stem_width: Output channels of the stem convolution.
        block_config: One ``(expand_ratio, out_channels, stride)`` per inverted-residual block.
        last_width: Channels of the final pointwise convolution before pooling.
        kernel_size: Odd kernel size of the stem and depthwise convolutions.
    """

    DEFAULT_BLOCKS: tuple[tuple[int, int, int], ...] = (
        (2, 16, 1),
        (4, 24, 2),
        (4, 24, 1),
        (4, 32, 2),
        (4, 32, 1),
        (4, 64, 2),
    )

    def __init__(
        self,
        n_channels: int,
        n_classes: int,
        stem_width: int = 16,
        block_config: Sequence[tuple[int, int, int]] = DEFAULT_BLOCKS,
        last_width: int = 128,
        kernel_size: int = 5,
    ):
        super().__init__()
        _check_positive(n_channels=n_channels, n_classes=n_classes, stem_width=stem_width,
                        last_width=last_width, kernel_size=kernel_size)
        if kernel_size % 2 == 0:
            raise ValueError(f"kernel_size must be odd for 'same' padding, got {kernel_size}")
        block_config = tuple(tuple(b) for b in block_config)
        for i, b in enumerate(block_config):
            if len(b) != 3:
                raise ValueError(f"block_config[{i}] must be (expand_ratio, out_channels, "
                                 f"stride), got {b!r}")
            _check_positive(**{f"block_config[{i}][{j}]": v for j, v in enumerate(b)})
        self.n_channels = n_channels
        self.n_classes = n_classes
        self.stem = ConvBNAct(n_channels, stem_width, kernel_size, stride=2)
        blocks = []
        c_in = stem_width
        for expand_ratio, c_out, stride in block_config:
            blocks.append(InvertedResidual(c_in, c_out, stride, expand_ratio, kernel_size))
            c_in = c_out
        self.blocks = nn.Sequential(*blocks)
        self.last = ConvBNAct(c_in, last_width, kernel_size=1)
        self.head = nn.Linear(last_width, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Maps ``(batch, n_channels, time_steps)`` to logits ``(batch, n_classes)``."""
        x = self.last(self.blocks(self.stem(x)))
        return self.head(x.mean(dim=-1))


# --------------------------------------------------------------------------------------------
# TinyTransformer1d
# --------------------------------------------------------------------------------------------


class DecomposedLayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` over the last axis, computed from elementary ops.

    Same parameters, state-dict keys and (to float rounding) outputs as ``nn.LayerNorm``, but
    it exports as ReduceMean/Sub/Mul/Add/Sqrt/Div instead of one ``LayerNormalization`` node.
    The legacy exporter emits ``LayerNormalization`` with only its ``Y`` output, while ONNX
    Runtime 1.19.2's gradient builder reads the optional ``Mean`` and ``InvStdDev`` outputs, so
    ``generate_artifacts`` fails on it (``GradientBuilderBase::O(size_t) ...
    i < node_->OutputDefs().size() was false``). Appending those two outputs to the node also
    works, but needs graph surgery at export; the elementary form needs none.

    Only normalisation over the last axis (``normalized_shape`` of length 1) is supported.
    """

    def __init__(self, normalized_shape: int, eps: float = 1e-5):
        super().__init__(normalized_shape, eps=eps, elementwise_affine=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalises the last axis to zero mean and unit (biased) variance, then scales."""
        centered = x - x.mean(dim=-1, keepdim=True)
        var = (centered * centered).mean(dim=-1, keepdim=True)
        return centered / torch.sqrt(var + self.eps) * self.weight + self.bias


class SelfAttention(nn.Module):
    """Multi-head self-attention from plain Linear, MatMul and Softmax ops.

    The token count is fixed at construction so that head splitting exports as a single
    ``Reshape`` to the constant shape ``(-1, n_tokens, n_heads, head_dim)``: the batch axis stays
    dynamic and the graph needs no Shape/Slice/Concat arithmetic.

    Args:
        d_model: Token width.
        n_heads: Number of heads; must divide ``d_model``.
        n_tokens: Number of tokens of every input sequence.
        dropout_p: Dropout on the attention weights and on the output projection.
    """

    def __init__(self, d_model: int, n_heads: int, n_tokens: int, dropout_p: float):
        super().__init__()
        if d_model % n_heads != 0:
            raise ValueError(f"n_heads={n_heads} must divide d_model={d_model}")
        self.d_model = d_model
        self.n_tokens = n_tokens
        self.n_heads = n_heads
        self.head_dim = d_model // n_heads
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self.q = nn.Linear(d_model, d_model)
        self.k = nn.Linear(d_model, d_model)
        self.v = nn.Linear(d_model, d_model)
        self.attn_drop = nn.Dropout(dropout_p)
        self.out = nn.Linear(d_model, d_model)
        self.out_drop = nn.Dropout(dropout_p)

    def _split_heads(self, x: torch.Tensor) -> torch.Tensor:
        # (batch, tokens, d_model) -> (batch, heads, tokens, head_dim); -1 keeps batch dynamic.
        return x.reshape(-1, self.n_tokens, self.n_heads, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Attends over the token axis of ``(batch, tokens, d_model)``."""
        q = self._split_heads(self.q(x))
        k = self._split_heads(self.k(x))
        v = self._split_heads(self.v(x))
        scores = torch.matmul(q, k.transpose(-2, -1)) * self.scale
        weights = self.attn_drop(torch.softmax(scores, dim=-1))
        ctx = torch.matmul(weights, v).transpose(1, 2).reshape(-1, self.n_tokens, self.d_model)
        return self.out_drop(self.out(ctx))


class MLP(nn.Module):
    """Token-wise MLP: ``fc1`` -> GELU -> dropout -> ``fc2`` -> dropout.

    Args:
        d_model: Token width.
        hidden: Hidden width.
        dropout_p: Dropout probability.
    """

    def __init__(self, d_model: int, hidden: int, dropout_p: float):
        super().__init__()
        self.fc1 = nn.Linear(d_model, hidden)
        self.act = nn.GELU()
        self.drop1 = nn.Dropout(dropout_p)
        self.fc2 = nn.Linear(hidden, d_model)
        self.drop2 = nn.Dropout(dropout_p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Applies the MLP to every token."""
        return self.drop2(self.fc2(self.drop1(self.act(self.fc1(x)))))


class EncoderLayer(nn.Module):
    """Pre-norm transformer encoder layer written from basic modules.

    ``x + attn(norm1(x))`` then ``x + mlp(norm2(x))``; the norms are
    :class:`DecomposedLayerNorm` so that ORT's gradient builder accepts the exported graph.

    Args:
        d_model: Token width.
        n_heads: Attention heads.
        n_tokens: Tokens per sequence.
        mlp_ratio: MLP hidden width as a multiple of ``d_model``.
        dropout_p: Dropout probability used throughout the layer.
    """

    def __init__(
        self, d_model: int, n_heads: int, n_tokens: int, mlp_ratio: int, dropout_p: float
    ):
        super().__init__()
        self.norm1 = DecomposedLayerNorm(d_model)
        self.attn = SelfAttention(d_model, n_heads, n_tokens, dropout_p)
        self.norm2 = DecomposedLayerNorm(d_model)
        self.mlp = MLP(d_model, d_model * mlp_ratio, dropout_p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Applies attention and MLP sub-layers with residual adds."""
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyTransformer1d(nn.Module):
    """A tiny transformer encoder for multichannel time series.

    The signal is cut into non-overlapping patches of ``patch_size`` steps by a strided Conv1d
    (``patch_embed``); trailing steps that do not fill a patch are dropped. A learned positional
    embedding (``pos_embed``, one row per patch) is added, ``n_layers`` pre-norm encoder layers
    follow (``layers.{i}``), then mean pooling over tokens, ``norm`` and ``head``.

    The positional embedding fixes the number of tokens, so inputs must have the
    ``n_time_steps`` given at construction (more precisely, the same number of whole patches).

    Args:
        n_channels: Input channels of the signal.
        n_classes: Number of output logits.
        n_time_steps: Window length the model is built for.
        patch_size: Steps per token.
        d_model: Token width.
        n_heads: Attention heads; must divide ``d_model``.
        n_layers: Encoder layers.
        mlp_ratio: MLP hidden width as a multiple of ``d_model``.
        dropout_p: Dropout probability (attention weights, projections, MLP, embeddings).
    """

    def __init__(
        self,
        n_channels: int,
        n_classes: int,
        n_time_steps: int,
        patch_size: int = 16,
        d_model: int = 64,
        n_heads: int = 4,
        n_layers: int = 2,
        mlp_ratio: int = 2,
        dropout_p: float = 0.1,
    ):
        super().__init__()
        _check_positive(n_channels=n_channels, n_classes=n_classes, n_time_steps=n_time_steps,
                        patch_size=patch_size, d_model=d_model, n_heads=n_heads,
                        n_layers=n_layers, mlp_ratio=mlp_ratio)
        if not 0.0 <= dropout_p < 1.0:
            raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p!r}")
        if n_time_steps < patch_size:
            raise ValueError(f"n_time_steps={n_time_steps} is shorter than one patch "
                             f"(patch_size={patch_size})")
        self.n_channels = n_channels
        self.n_classes = n_classes
        self.n_time_steps = n_time_steps
        self.patch_size = patch_size
        self.n_tokens = n_time_steps // patch_size
        if n_time_steps % patch_size:
            logger.debug("n_time_steps=%d is not a multiple of patch_size=%d; the last %d steps "
                         "are ignored", n_time_steps, patch_size, n_time_steps % patch_size)
        self.patch_embed = nn.Conv1d(n_channels, d_model, patch_size, stride=patch_size)
        self.pos_embed = nn.Parameter(torch.zeros(1, self.n_tokens, d_model))
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        self.embed_drop = nn.Dropout(dropout_p)
        self.layers = nn.Sequential(
            *(EncoderLayer(d_model, n_heads, self.n_tokens, mlp_ratio, dropout_p)
              for _ in range(n_layers))
        )
        self.norm = DecomposedLayerNorm(d_model)
        self.head = nn.Linear(d_model, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Maps ``(batch, n_channels, n_time_steps)`` to logits ``(batch, n_classes)``."""
        # A shape check for eager callers; skipped while tracing for export, where the shape
        # would be a traced value (a wrong length still fails there, at the positional add).
        if not torch.jit.is_tracing() and x.shape[-1] // self.patch_size != self.n_tokens:
            raise ValueError(f"expected {self.n_time_steps} time steps ({self.n_tokens} patches "
                             f"of {self.patch_size}), got input of shape {tuple(x.shape)}")
        tokens = self.patch_embed(x).transpose(1, 2)  # (batch, tokens, d_model)
        tokens = self.embed_drop(tokens + self.pos_embed)
        tokens = self.layers(tokens)
        return self.head(self.norm(tokens.mean(dim=1)))


# --------------------------------------------------------------------------------------------
# Factory
# --------------------------------------------------------------------------------------------


def build_model(
    name: str, n_channels: int, n_classes: int, n_time_steps: int, **kwargs
) -> nn.Module:
    """Builds a reference model by name.

    Args:
        name: One of :data:`MODEL_NAMES` (``"cnn"``, ``"mobilenet"``, ``"transformer"``).
        n_channels: Input channels of the signal.
        n_classes: Number of output logits.
        n_time_steps: Window length. The transformer needs it (positional embedding); the
            convolutional models accept any length and only validate it.
        **kwargs: Passed to the model's constructor (e.g. ``widths=`` for ``"cnn"``,
            ``dropout_p=`` for ``"transformer"``).

    Returns:
        A freshly initialised model in training mode; initialisation draws from torch's global
        RNG, so seed it (``torch.manual_seed``) for a reproducible model.

    Raises:
        ValueError: If ``name`` is unknown or a size is not a positive int.
    """
    _check_positive(n_time_steps=n_time_steps)
    if name == "cnn":
        model: nn.Module = CNN1d(n_channels, n_classes, **kwargs)
    elif name == "mobilenet":
        model = MobileNet1d(n_channels, n_classes, **kwargs)
    elif name == "transformer":
        model = TinyTransformer1d(n_channels, n_classes, n_time_steps, **kwargs)
    else:
        raise ValueError(f"unknown model name {name!r}; expected one of {MODEL_NAMES}")
    logger.debug("built %s: %d parameters", name, count_parameters(model))
    return model
