"""What the loss holds in the compute tier: its saved tensors and its backward's transients.

The block graph (:func:`~edgeadapt.server.trace.trace_graph`) describes the model; the loss runs
after it, between the forward and the backward. A cross-entropy over a large vocabulary holds
several tensors of the logits' size at once (its log-probabilities, their gradient, the logits'
gradient): on a GPT with 8192 tokens per window and a vocabulary of 8192 that is 4 x 32 MiB per
window, more than a block's activations. :func:`loss_memory` measures it for any loss function
by running it, forward and backward, on the meta device (no memory, no arithmetic) under
:class:`LiveBytes`, which follows every tensor the ops create until it is freed.
"""

from __future__ import annotations

import warnings
import weakref
from dataclasses import dataclass
from typing import Callable, Literal

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["LiveBytes", "LossMemory", "TargetKind", "first_window", "loss_memory", "loss_memory_per_window",
           "meta_targets", "per_window_bytes"]


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages created by ops while the mode is active, live now and at most.

    A storage counts from the op that creates it until the last tensor on it is freed (weak
    references' finalizers); views, detached aliases and in-place results share a storage and
    do not count again, nor do storages that existed before (the inputs).
    """

    def __init__(self):
        super().__init__()
        self._live: dict[int, list[int]] = {}  # storage -> [bytes, tensors on it]
        self.now_bytes = 0
        self.peak_bytes = 0

    def _drop(self, key: int) -> None:
        entry = self._live[key]
        entry[1] -= 1
        if entry[1] == 0:
            del self._live[key]
            self.now_bytes -= entry[0]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {t.untyped_storage()._cdata for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            key = t.untyped_storage()._cdata
            if key not in self._live:
                if key in given:  # an alias of a tensor from before
                    continue
                self._live[key] = [t.untyped_storage().nbytes(), 0]
                self.now_bytes += self._live[key][0]
                self.peak_bytes = max(self.peak_bytes, self.now_bytes)
            self._live[key][1] += 1
            weakref.finalize(t, self._drop, key)
        return out


@dataclass(frozen=True)
class LossMemory:
    """The loss's bytes for one batch.

    Attributes:
        saved_bytes: held from the end of the forward until the backward frees it (what the
            loss saved for its backward, and its value).
        peak_bytes: the most held at once while the loss runs forward and backward (the
            saved bytes included, and the gradient it hands to the model's output).
        target_bytes: the targets' own bytes (held with the input batch for the whole step).
    """

    saved_bytes: int
    peak_bytes: int
    target_bytes: int


TargetKind = Literal["class", "like"]
"""How a loss's targets are shaped: ``"class"``, class ids (the output without its last
dimension, as cross-entropy takes them); ``"like"``, a tensor like the output (regression)."""


def meta_targets(output: torch.Tensor, kind: TargetKind | None = None) -> list[torch.Tensor]:
    """Meta targets of ``kind`` for ``output``; ``None``: both kinds, class ids first."""
    shaped = {"class": lambda: torch.zeros(output.shape[:-1], dtype=torch.long, device="meta"),
              "like": lambda: torch.empty_like(output, device="meta")}
    return [shaped[k]() for k in ((kind,) if kind else ("class", "like"))]


def loss_memory(loss_fn: Callable, output, target: torch.Tensor | TargetKind | None = None) -> LossMemory | None:
    """Run ``loss_fn(output, target)`` and its backward on the meta device and measure its bytes.

    Args:
        loss_fn: the training loss, called as ``loss_fn(output, target)``.
        output: the model's output, a tensor or a tuple/list/dict of them (any device; only
            shapes and dtypes are used; guessed targets follow the first tensor).
        target: the targets (shape and dtype used), or their kind (:data:`TargetKind`);
            ``None``: each kind is tried (:func:`meta_targets`).

    Returns:
        The loss's bytes, or ``None`` when the loss cannot run on the meta device with these
        targets (the trainer then measures it again with the first batch's targets).
    """
    def leaf(t):
        if not isinstance(t, torch.Tensor):
            return t
        return torch.empty(t.shape, dtype=t.dtype, device="meta", requires_grad=t.is_floating_point())

    out = tree_map(leaf, output)
    tensors = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    if not tensors:
        return None
    if isinstance(target, torch.Tensor):
        candidates = [torch.empty(target.shape, dtype=target.dtype, device="meta")]
    else:
        candidates = meta_targets(tensors[0], target)
    for y in candidates:
        mode = LiveBytes()
        try:
            with torch.enable_grad(), warnings.catch_warnings(), mode:
                warnings.simplefilter("ignore")  # a guessed target may broadcast
                loss = loss_fn(out, y)
                if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
                    continue
                saved = mode.now_bytes
                loss.backward()
                del loss
        except Exception:  # the loss refuses these targets (or the meta device): try the next
            continue
        return LossMemory(saved, mode.peak_bytes, y.untyped_storage().nbytes())
    return None


def loss_memory_per_window(loss_fn: Callable, output, target: torch.Tensor | TargetKind | None,
                           batch: int) -> LossMemory | None:
    """The loss's bytes per window, an upper bound for a micro-batch of any size.

    Measured on the whole batch (divided by ``batch``, rounded up) and on its first window alone,
    each figure the larger of the two: what does not grow with the batch (the loss value, a
    reduction's weight sum) is then counted once per window, never divided away.
    """
    whole = loss_memory(loss_fn, output, target)
    if whole is None:
        return None
    one = loss_memory(loss_fn, first_window(output, batch), first_window(target, batch)) if batch > 1 else None
    return LossMemory(*(per_window_bytes(getattr(whole, f), getattr(one, f) if one else None, batch)
                        for f in ("saved_bytes", "peak_bytes", "target_bytes")))


def first_window(value, batch: int):
    """``value`` (a tensor, or a tuple/list/dict of them) cut to its first window: each tensor
    whose first dimension is the batch's ``batch``; anything else as it is."""
    def cut(t):
        return t[:1] if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == batch else t

    return tree_map(cut, value)


def per_window_bytes(batch_bytes: int, window_bytes: int | None, batch: int) -> int:
    """Bytes per window from a batch's ``batch_bytes`` and its first window's alone
    (``window_bytes``; ``None``: not measured): the batch's share rounded up, or the first window's
    when larger, so that what does not grow with the batch counts once per window."""
    share = -(-batch_bytes // batch)
    return share if window_bytes is None else max(share, window_bytes)
