"""A GPT-style decoder-only language model, laid out for block-by-block streaming.

The model is a stack of pre-LayerNorm transformer blocks with causal self-attention between
a token + position embedding and a final norm + linear ``head``. Its top-level children are
the units the server trainer streams, in execution order::

    embed       GPTEmbedding   token and learned position embeddings (+ dropout)
    blocks.{i}  DecoderBlock   x + attn(ln1(x)), then x + mlp(ln2(x))   (an nn.ModuleList)
    norm        nn.LayerNorm   final normalisation
    head        nn.Linear      logits over the vocabulary (no weight tying, so every
                               parameter belongs to exactly one streamed unit)

Input: int64 token ids ``(batch, tokens)`` with ``tokens <= context_len``; output: float
logits ``(batch, tokens, vocab_size)``. :func:`token_cross_entropy` is the matching loss.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "GPT_PRESETS",
    "DecoderBlock",
    "GPTConfig",
    "GPTDecoder",
    "GPTEmbedding",
    "build_gpt",
    "token_cross_entropy",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a :class:`GPTDecoder`.

    Attributes:
        vocab_size: Number of token ids (embedding rows and logits).
        context_len: Longest sequence the position embedding covers.
        d_model: Token width.
        n_layers: Decoder blocks.
        n_heads: Attention heads; must divide ``d_model``.
        mlp_ratio: MLP hidden width as a multiple of ``d_model``.
        dropout_p: Dropout on embeddings, attention weights and residual branches.
    """

    vocab_size: int = 512
    context_len: int = 128
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    mlp_ratio: int = 4
    dropout_p: float = 0.0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "context_len", "d_model", "n_layers", "n_heads", "mlp_ratio"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive int, got {value!r}")
        if self.d_model % self.n_heads:
            raise ValueError(f"GPTConfig.n_heads={self.n_heads} must divide d_model={self.d_model}")
        if not 0.0 <= self.dropout_p < 1.0:
            raise ValueError(f"GPTConfig.dropout_p must be in [0, 1), got {self.dropout_p!r}")

    def to_dict(self) -> dict:
        """The fields as a JSON-able dict (``GPTConfig(**d)`` rebuilds it)."""
        return asdict(self)

    @property
    def n_params(self) -> int:
        """Parameter elements of the model this config builds."""
        d, h = self.d_model, self.d_model * self.mlp_ratio
        block = 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (d * h + h) + (h * d + d)
        return (self.vocab_size * d + self.context_len * d + self.n_layers * block
                + 2 * d + d * self.vocab_size + self.vocab_size)


GPT_PRESETS: dict[str, GPTConfig] = {
    # tests and smoke runs (0.14 M parameters)
    "gpt-nano": GPTConfig(vocab_size=256, context_len=64, d_model=64, n_layers=2, n_heads=4),
    # a few minutes on a 2-core CPU (6.9 M parameters)
    "gpt-mini": GPTConfig(vocab_size=4096, context_len=256, d_model=256, n_layers=6, n_heads=8),
    # the GPT-2 small shape, untied head (163 M parameters; vocabulary rounded up to 50304)
    "gpt-small": GPTConfig(vocab_size=50304, context_len=1024, d_model=768, n_layers=12, n_heads=12),
}
"""Named shapes accepted by :func:`build_gpt`."""


class GPTEmbedding(nn.Module):
    """Token embedding plus a learned position embedding, then dropout."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.context_len = config.context_len
        self.tok = nn.Embedding(config.vocab_size, config.d_model)
        self.pos = nn.Embedding(config.context_len, config.d_model)
        self.drop = nn.Dropout(config.dropout_p)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Maps token ids ``(batch, tokens)`` to ``(batch, tokens, d_model)``."""
        if idx.ndim != 2:
            raise ValueError(f"expected token ids of shape (batch, tokens), got {tuple(idx.shape)}")
        n_tokens = idx.shape[1]
        if n_tokens > self.context_len:
            raise ValueError(f"a sequence of {n_tokens} tokens exceeds the context of {self.context_len}; "
                             f"pass shorter sequences or build the model with a larger context_len")
        positions = torch.arange(n_tokens, device=idx.device)
        return self.drop(self.tok(idx) + self.pos(positions))


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where token ``t`` attends to tokens ``<= t``.

    One fused ``qkv`` projection, ``torch.nn.functional.scaled_dot_product_attention`` with
    ``is_causal=True``, and an output projection ``proj``.
    """

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_heads = config.n_heads
        self.head_dim = config.d_model // config.n_heads
        self.dropout_p = config.dropout_p
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)
        self.drop = nn.Dropout(config.dropout_p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Attends causally over the token axis of ``(batch, tokens, d_model)``."""
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, self.head_dim).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout_p if self.training else 0.0)
        return self.drop(self.proj(y.transpose(1, 2).reshape(b, t, d)))


class DecoderBlock(nn.Module):
    """Pre-LN decoder block: ``x + attn(ln1(x))`` then ``x + mlp(ln2(x))``."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        hidden = config.d_model * config.mlp_ratio
        self.ln1 = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.d_model)
        self.mlp = nn.Sequential(nn.Linear(config.d_model, hidden), nn.GELU(),
                                 nn.Linear(hidden, config.d_model), nn.Dropout(config.dropout_p))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Applies the attention and MLP sub-layers with residual adds."""
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPTDecoder(nn.Module):
    """Decoder-only transformer language model (see the module docstring for the layout).

    Weights are initialised GPT-2 style: normal(0, 0.02), residual output projections scaled
    by ``1/sqrt(2 * n_layers)``, zero biases. Initialisation draws from torch's global RNG,
    so seed it (``torch.manual_seed``) for a reproducible model.

    Args:
        config: The model's shape.
    """

    def __init__(self, config: GPTConfig | None = None):
        super().__init__()
        self.config = config or GPTConfig()
        self.embed = GPTEmbedding(self.config)
        self.blocks = nn.ModuleList(DecoderBlock(self.config) for _ in range(self.config.n_layers))
        self.norm = nn.LayerNorm(self.config.d_model)
        self.head = nn.Linear(self.config.d_model, self.config.vocab_size)
        self.apply(self._init_weights)
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layers)
        for block in self.blocks:
            nn.init.normal_(block.attn.proj.weight, mean=0.0, std=residual_std)
            nn.init.normal_(block.mlp[2].weight, mean=0.0, std=residual_std)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Maps token ids ``(batch, tokens)`` to next-token logits ``(batch, tokens, vocab_size)``."""
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of logits ``(batch, tokens, vocab)`` against ids ``(batch, tokens)``."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def build_gpt(name: str = "gpt-nano", **overrides) -> GPTDecoder:
    """Builds a :class:`GPTDecoder` from a preset, with fields overridden.

    Args:
        name: A key of :data:`GPT_PRESETS` (``"gpt-nano"``, ``"gpt-mini"``, ``"gpt-small"``).
        **overrides: :class:`GPTConfig` fields to change, e.g. ``n_layers=48``.

    Returns:
        A freshly initialised model in training mode.

    Raises:
        ValueError: If ``name`` is unknown, a field does not exist or a value is invalid.
    """
    if name not in GPT_PRESETS:
        raise ValueError(f"unknown GPT preset {name!r}; expected one of {sorted(GPT_PRESETS)}")
    unknown = set(overrides) - set(GPTConfig.__dataclass_fields__)
    if unknown:
        raise ValueError(f"unknown GPTConfig fields {sorted(unknown)}; "
                         f"valid fields: {sorted(GPTConfig.__dataclass_fields__)}")
    config = replace(GPT_PRESETS[name], **overrides)
    model = GPTDecoder(config)
    logger.debug("built %s: %s, %d parameters", name, config, config.n_params)
    return model
