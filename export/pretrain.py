"""Pretraining of the source models through the server trainer, plus inference helpers.

:func:`pretrain` runs AdamW on cross-entropy over numpy arrays held in memory with
:class:`edgeadapt.server.Trainer` (everything resident: ``offload=None``), the same trainer
that ``edgeadapt train`` streams through a memory budget. It produces the pretrained models
that are exported and then adapted on the device.
"""

from __future__ import annotations

import logging
import math
import numbers
import time
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

__all__ = ["PretrainResult", "accuracy", "predict_logits", "pretrain"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PretrainResult:
    """What one :func:`pretrain` run did.

    Attributes:
        train_losses: Mean cross-entropy over the training samples of each epoch, in order
            (one entry per epoch, measured in training mode while the weights were changing).
        train_accuracy: Accuracy on the whole training set after the last epoch, in eval mode.
        time_s: Wall-clock seconds spent in the training loop (the final accuracy pass
            excluded).
    """

    train_losses: tuple[float, ...]
    train_accuracy: float
    time_s: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "train_losses", tuple(float(v) for v in self.train_losses))
        if not self.train_losses:
            raise ValueError("train_losses must hold at least one epoch")
        if not 0.0 <= self.train_accuracy <= 1.0:
            raise ValueError(f"train_accuracy must be in [0, 1], got {self.train_accuracy}")
        if self.time_s < 0:
            raise ValueError(f"time_s must be >= 0, got {self.time_s}")

    @property
    def n_epochs(self) -> int:
        """Number of epochs run."""
        return len(self.train_losses)


def _check_positive_int(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _as_windows(X: np.ndarray) -> np.ndarray:
    """Validates X as (N, C, T) real floats and returns it as float32."""
    if not isinstance(X, np.ndarray):
        raise TypeError(f"X must be a numpy array, got {type(X).__name__}")
    if X.ndim != 3:
        raise ValueError(f"X must have shape (n_samples, n_channels, n_time_steps), "
                         f"got shape {X.shape}")
    if not np.issubdtype(X.dtype, np.floating):
        raise TypeError(f"X must hold floats (float32), got dtype {X.dtype}")
    if X.shape[0] == 0:
        raise ValueError("X holds no samples")
    X = np.ascontiguousarray(X, dtype=np.float32)
    if not np.isfinite(X).all():
        raise ValueError(f"X holds {int((~np.isfinite(X)).sum())} non-finite values")
    return X


def _as_labels(y: np.ndarray, n_samples: int) -> np.ndarray:
    """Validates y as (N,) non-negative integer class labels and returns it as int64."""
    if not isinstance(y, np.ndarray):
        raise TypeError(f"y must be a numpy array, got {type(y).__name__}")
    if y.ndim != 1:
        raise ValueError(f"y must have shape (n_samples,), got shape {y.shape}")
    if not np.issubdtype(y.dtype, np.integer):
        raise TypeError(f"y must hold integer class labels (int64), got dtype {y.dtype}")
    if y.shape[0] != n_samples:
        raise ValueError(f"X has {n_samples} samples but y has {y.shape[0]} labels")
    return np.ascontiguousarray(y, dtype=np.int64)


def _model_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    for b in model.buffers():
        return b.device
    return torch.device("cpu")


def _probe_n_outputs(model: nn.Module, X: np.ndarray) -> int:
    """Runs one sample through the model (eval mode) and returns its number of logits.

    This checks the window shape against the model before any training, with an error that
    names the shapes instead of a convolution's internal message.
    """
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            out = model(torch.from_numpy(X[:1]).to(_model_device(model)))
    except RuntimeError as exc:
        raise ValueError(f"the model rejects windows of shape (n_channels, n_time_steps) = "
                         f"{X.shape[1:]}: {exc}") from exc
    finally:
        model.train(was_training)
    if out.ndim != 2 or out.shape[0] != 1:
        raise ValueError(f"the model must return logits of shape (batch, n_classes), "
                         f"got {tuple(out.shape)} for a batch of 1")
    return int(out.shape[1])


def _check_labels_fit(y: np.ndarray, n_classes: int) -> None:
    low, high = int(y.min()), int(y.max())
    if low < 0 or high >= n_classes:
        raise ValueError(f"labels must lie in [0, {n_classes}) for a model with {n_classes} "
                         f"outputs, got labels in [{low}, {high}]")


def predict_logits(model: nn.Module, X: np.ndarray, batch_size: int = 256) -> np.ndarray:
    """Runs the model in eval mode without gradients over windows X.

    The model's train/eval mode is restored afterwards.

    Args:
        model: A model mapping ``(batch, C, T)`` to ``(batch, n_classes)``; its parameters'
            device is used for the computation.
        X: Windows of shape ``(n_samples, C, T)``, float (cast to float32).
        batch_size: Samples per forward pass.

    Returns:
        float32 logits of shape ``(n_samples, n_classes)``.

    Raises:
        ValueError, TypeError: If X is not a non-empty, finite 3-D float array or batch_size is
            not a positive int.
    """
    _check_positive_int("batch_size", batch_size)
    X = _as_windows(X)
    device = _model_device(model)
    was_training = model.training
    model.eval()
    outputs = []
    try:
        with torch.no_grad():
            for start in range(0, X.shape[0], batch_size):
                xb = torch.from_numpy(X[start:start + batch_size]).to(device)
                outputs.append(model(xb).float().cpu().numpy())
    finally:
        model.train(was_training)
    return np.concatenate(outputs, axis=0)


def accuracy(model: nn.Module, X: np.ndarray, y: np.ndarray, batch_size: int = 256) -> float:
    """Fraction of windows whose arg-max logit equals the label (eval mode, no gradients).

    Args:
        model: A classifier mapping ``(batch, C, T)`` to ``(batch, n_classes)``.
        X: Windows of shape ``(n_samples, C, T)``.
        y: Integer labels of shape ``(n_samples,)``.
        batch_size: Samples per forward pass.

    Returns:
        The accuracy in [0, 1].

    Raises:
        ValueError, TypeError: On malformed X or y, or mismatched sample counts.
    """
    X = _as_windows(X)
    y = _as_labels(y, X.shape[0])
    logits = predict_logits(model, X, batch_size)
    return float((logits.argmax(axis=1) == y).mean())


def _trainer_step(model: nn.Module, *, lr: float, weight_decay: float, device: torch.device):
    """``step(x, y) -> loss`` of an in-memory :class:`~edgeadapt.server.Trainer` on ``model``.

    The trainer trains the model's own parameters in place. A model whose parameters the
    trainer cannot assign to blocks (one tensor under two names: tied weights) trains with
    ``torch.optim.AdamW`` directly, with the same arithmetic (foreach AdamW) and a logged note.
    """
    from ..server import BlockError, Trainer
    from ..server.trace import find_blocks
    from .objectives import OptimizerConfig

    try:
        find_blocks(model)
    except BlockError as exc:
        logger.info("training %s with torch.optim.AdamW directly: %s", type(model).__name__, exc)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr,
                                      weight_decay=weight_decay, foreach=True)
        loss_fn = nn.CrossEntropyLoss()

        def plain_step(xb: torch.Tensor, yb: torch.Tensor) -> float:
            loss = loss_fn(model(xb.to(device)), yb.to(device))
            value = float(loss.detach())
            if not math.isfinite(value):
                raise FloatingPointError(f"loss became {value}; no update was applied")
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            return value
        return plain_step
    trainer = Trainer(model, loss="cross_entropy",
                      optimizer=OptimizerConfig("adamw", lr=lr, weight_decay=weight_decay),
                      memory_budget=None, offload=None, device=str(device))
    return trainer.step


def pretrain(
    model: nn.Module,
    X: np.ndarray,
    y: np.ndarray,
    *,
    epochs: int,
    batch_size: int,
    lr: float,
    weight_decay: float,
    seed: int,
    device: str | torch.device = "cpu",
    progress: bool = False,
) -> PretrainResult:
    """Trains every parameter of ``model`` with AdamW on cross-entropy, in place, through
    the in-memory server trainer.

    Each epoch visits every sample once in an order drawn from a ``torch.Generator`` seeded
    with ``seed``; the global torch RNG (dropout) is seeded with ``torch.manual_seed(seed)``
    at the start, so two runs from the same initial weights give the same loss curve on the
    same device and thread count. The last batch of an epoch may be smaller than
    ``batch_size``. The model is moved to ``device`` and left there, in eval mode.

    Args:
        model: A classifier mapping ``(batch, C, T)`` float32 to ``(batch, n_classes)``.
        X: Training windows, shape ``(n_samples, C, T)``, float (cast to float32).
        y: Labels, shape ``(n_samples,)``, integers in ``[0, n_classes)``.
        epochs: Number of passes over the data.
        batch_size: Samples per optimizer step.
        lr: AdamW learning rate.
        weight_decay: AdamW (decoupled) weight decay.
        seed: Seed for the shuffling order and the global torch RNG.
        device: Where to train (``"cpu"``, ``"cuda"``, ...).
        progress: Show a tqdm progress bar over epochs.

    Returns:
        The per-epoch losses, the final training accuracy and the loop's wall time.

    Raises:
        ValueError, TypeError: On malformed inputs, windows the model rejects, or labels
            outside the model's output range.
        FloatingPointError: If the loss becomes non-finite (with epoch and step).
    """
    _check_positive_int("epochs", epochs)
    _check_positive_int("batch_size", batch_size)
    if not (isinstance(lr, numbers.Real) and math.isfinite(lr) and lr > 0):
        raise ValueError(f"lr must be a positive finite number, got {lr!r}")
    if not (isinstance(weight_decay, numbers.Real) and math.isfinite(weight_decay)
            and weight_decay >= 0):
        raise ValueError(f"weight_decay must be a non-negative finite number, "
                         f"got {weight_decay!r}")
    X = _as_windows(X)
    y = _as_labels(y, X.shape[0])
    device = torch.device(device)
    model.to(device)
    n_classes = _probe_n_outputs(model, X)
    _check_labels_fit(y, n_classes)
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the model has no trainable parameters")

    torch.manual_seed(seed)
    order_rng = torch.Generator().manual_seed(seed)
    X_t = torch.from_numpy(X)
    y_t = torch.from_numpy(y)
    n_samples = X.shape[0]
    step_fn = _trainer_step(model, lr=lr, weight_decay=weight_decay, device=device)
    logger.info("pretraining %s: %d samples, %d epochs, batch %d, lr %g, weight_decay %g, "
                "on %s", type(model).__name__, n_samples, epochs, batch_size, lr, weight_decay,
                device)

    losses: list[float] = []
    start_s = time.perf_counter()
    model.train()
    bar = tqdm(range(epochs), desc="pretrain", unit="epoch", disable=not progress)
    for epoch in bar:
        order = torch.randperm(n_samples, generator=order_rng)
        loss_sum = 0.0
        for step, first in enumerate(range(0, n_samples, batch_size)):
            idx = order[first:first + batch_size]
            try:
                loss_value = step_fn(X_t[idx], y_t[idx])
            except FloatingPointError as exc:
                raise FloatingPointError(f"loss became non-finite at epoch {epoch}, step {step} "
                                         f"(lr={lr}): {exc}") from exc
            loss_sum += loss_value * len(idx)
        losses.append(loss_sum / n_samples)
        bar.set_postfix(loss=f"{losses[-1]:.4f}")
        logger.debug("epoch %d/%d: train loss %.6f", epoch + 1, epochs, losses[-1])
    bar.close()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    time_s = time.perf_counter() - start_s

    train_accuracy = accuracy(model, X, y, batch_size=max(batch_size, 256))
    model.eval()
    logger.info("pretraining done in %.2f s: final loss %.4f, train accuracy %.4f",
                time_s, losses[-1], train_accuracy)
    return PretrainResult(train_losses=tuple(losses), train_accuracy=train_accuracy,
                          time_s=time_s)
