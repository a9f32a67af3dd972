"""Tests for edgeadapt.models.gpt: shapes, causality, attention parity with a plain masked softmax, layout."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from edgeadapt.models import GPT_PRESETS, GPTConfig, GPTDecoder, build_gpt, token_cross_entropy

TINY = dict(vocab_size=37, context_len=16, d_model=32, n_layers=3, n_heads=4)


def _tiny(seed: int = 0, **overrides) -> GPTDecoder:
    torch.manual_seed(seed)
    return GPTDecoder(GPTConfig(**{**TINY, **overrides}))


def _tokens(batch: int, n_tokens: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, TINY["vocab_size"], (batch, n_tokens), generator=torch.Generator().manual_seed(seed))


def _reference_forward(model: GPTDecoder, idx: torch.Tensor) -> torch.Tensor:
    """The same model computed with an explicit triangular mask and softmax (no fused kernel)."""
    cfg = model.config
    b, t = idx.shape
    x = model.embed.tok(idx) + model.embed.pos(torch.arange(t))
    mask = torch.ones(t, t, dtype=torch.bool).tril()
    for block in model.blocks:
        h = block.ln1(x)
        q, k, v = block.attn.qkv(h).split(cfg.d_model, dim=2)
        q, k, v = (z.view(b, t, cfg.n_heads, -1).transpose(1, 2) for z in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(cfg.d_model // cfg.n_heads)
        att = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
        x = x + block.attn.proj((att @ v).transpose(1, 2).reshape(b, t, cfg.d_model))
        x = x + block.mlp(block.ln2(x))
    return model.head(model.norm(x))


def test_logits_have_batch_token_vocab_shape():
    model = _tiny()
    assert model(_tokens(3, 11)).shape == (3, 11, TINY["vocab_size"])


def test_forward_and_gradients_match_an_explicitly_masked_attention():
    model = _tiny()
    idx, targets = _tokens(2, 16), _tokens(2, 16, seed=2)
    fused = token_cross_entropy(model(idx), targets)
    fused_grads = torch.autograd.grad(fused, list(model.parameters()))
    plain = token_cross_entropy(_reference_forward(model, idx), targets)
    plain_grads = torch.autograd.grad(plain, list(model.parameters()))
    # float32; the fused kernel sums in another order: agreement to ~1e-6 relative
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-6)
    for (name, _), a, b in zip(model.named_parameters(), fused_grads, plain_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_a_token_never_sees_later_tokens():
    model = _tiny().eval()
    idx = _tokens(1, 12)
    changed = idx.clone()
    changed[0, 7:] = (changed[0, 7:] + 1) % TINY["vocab_size"]
    with torch.no_grad():
        a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, :7], b[:, :7], rtol=0, atol=0)
    assert not torch.allclose(a[:, 7:], b[:, 7:])


def test_blocks_are_a_module_list_and_every_parameter_has_one_streamed_owner():
    model = _tiny()
    assert isinstance(model.blocks, nn.ModuleList) and len(model.blocks) == TINY["n_layers"]
    assert [name for name, _ in model.named_children()] == ["embed", "blocks", "norm", "head"]
    owners = [name.split(".")[0] if not name.startswith("blocks.") else ".".join(name.split(".")[:2])
              for name, _ in model.named_parameters()]
    assert set(owners) == {"embed", "norm", "head"} | {f"blocks.{i}" for i in range(TINY["n_layers"])}
    # no weight tying: parameters are distinct tensors
    assert len({id(p) for p in model.parameters()}) == len(list(model.parameters()))


@pytest.mark.parametrize("name", ["gpt-nano", "gpt-mini"])
def test_presets_build_and_count_their_parameters(name):
    model = build_gpt(name)
    assert sum(p.numel() for p in model.parameters()) == GPT_PRESETS[name].n_params


def test_counted_parameters_of_the_gpt2_small_shape():
    # 12 blocks of 7,087,872 + token/position embeddings + final norm + untied head
    assert GPT_PRESETS["gpt-small"].n_params == 163_159_680


def test_overrides_and_errors():
    assert build_gpt("gpt-nano", n_layers=5).config.n_layers == 5
    with pytest.raises(ValueError, match="unknown GPT preset"):
        build_gpt("gpt-huge")
    with pytest.raises(ValueError, match="unknown GPTConfig fields"):
        build_gpt("gpt-nano", layers=3)
    with pytest.raises(ValueError, match="must divide d_model"):
        GPTConfig(d_model=30, n_heads=4)
    with pytest.raises(ValueError, match="exceeds the context of 16"):
        _tiny()(_tokens(1, 17))


def test_a_few_adamw_steps_lower_the_loss_on_a_repeating_sequence():
    model = _tiny()
    idx = torch.arange(17).remainder(5).repeat(4, 1)
    x, y = idx[:, :-1], idx[:, 1:]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    first = None
    for _ in range(30):
        loss = token_cross_entropy(model(x), y)
        first = float(loss.detach()) if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert float(loss.detach()) < 0.5 * first
