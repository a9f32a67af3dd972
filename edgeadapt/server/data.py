"""Training data sources for the server trainer: biosignal windows and a synthetic token stream.

A source is addressed by step, not iterated: ``source.batch(step)`` returns this rank's shard
of global batch ``step``, a pure function of ``(seed, step)``. A resumed run therefore
continues with exactly the batches an uninterrupted run would have seen (the data position is
the step number), and ``world_size`` ranks together see exactly the global batch one process
sees — the rows are split in rank order.

* :class:`WindowSource` — windows of an :mod:`edgeadapt.datasets` dataset (synthetic, watch,
  ``.npz``, ``.csv``): each epoch is a seeded permutation; an epoch drops its last incomplete
  global batch.
* :class:`TokenArray` — next-token prediction on the user's token ids (a ``.npy`` of ints):
  every global batch is drawn at seeded random offsets.
* :class:`TokenStream` — next-token prediction on an endless synthetic stream: sequences are
  walks of a seeded sparse Markov chain over the vocabulary (each token has a few likely
  successors), so a language model's loss falls from ``log(vocab)`` towards the chain's
  entropy. Nothing is downloaded.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from ..datasets import WindowDataset, load_dataset

__all__ = ["TokenArray", "TokenStream", "WindowSource", "load_windows", "shard_rows"]

logger = logging.getLogger(__name__)


def shard_rows(global_batch_size: int, rank: int, world_size: int) -> slice:
    """The rows of a global batch that ``rank`` trains on (contiguous, equal shares).

    Raises:
        ValueError: If the global batch does not split evenly over the ranks.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of {world_size} processes")
    if global_batch_size % world_size:
        raise ValueError(f"the global batch size {global_batch_size} does not split evenly over {world_size} "
                         f"processes; choose a batch size that is a multiple of {world_size}")
    per_rank = global_batch_size // world_size
    return slice(rank * per_rank, (rank + 1) * per_rank)


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


@dataclass(frozen=True)
class WindowSource:
    """Seeded, shuffled mini-batches of labelled biosignal windows.

    Attributes:
        X: Windows ``(n_windows, channels, time_steps)`` float32.
        y: Integer labels ``(n_windows,)``.
        global_batch_size: Windows per optimizer step over all ranks.
        seed: Seeds every epoch's permutation.
        rank: This process's rank.
        world_size: Number of data-parallel processes.
    """

    X: np.ndarray
    y: np.ndarray
    global_batch_size: int
    seed: int = 0
    rank: int = 0
    world_size: int = 1
    unit: str = field(default="windows", init=False)

    def __post_init__(self) -> None:
        _check_positive(global_batch_size=self.global_batch_size)
        if self.X.ndim != 3 or self.y.shape != (self.X.shape[0],):
            raise ValueError(f"expected X (windows, channels, time_steps) and y (windows,), "
                             f"got {self.X.shape} and {self.y.shape}")
        if self.X.shape[0] < self.global_batch_size:
            raise ValueError(f"{self.X.shape[0]} windows are fewer than one batch of {self.global_batch_size}; "
                             f"lower --batch-size")
        shard_rows(self.global_batch_size, self.rank, self.world_size)
        object.__setattr__(self, "X", np.ascontiguousarray(self.X, dtype=np.float32))
        object.__setattr__(self, "y", np.ascontiguousarray(self.y, dtype=np.int64))

    @property
    def steps_per_epoch(self) -> int:
        """Full global batches per pass over the windows."""
        return self.X.shape[0] // self.global_batch_size

    @property
    def items_per_step(self) -> int:
        """Windows this rank processes per step."""
        return self.global_batch_size // self.world_size

    def global_indices(self, step: int) -> np.ndarray:
        """Window indices of global batch ``step`` (all ranks)."""
        epoch, within = divmod(int(step), self.steps_per_epoch)
        order = np.random.default_rng([self.seed, epoch]).permutation(self.X.shape[0])
        return order[within * self.global_batch_size:(within + 1) * self.global_batch_size]

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's windows and labels of global batch ``step``."""
        idx = self.global_indices(step)[shard_rows(self.global_batch_size, self.rank, self.world_size)]
        return torch.from_numpy(self.X[idx]), torch.from_numpy(self.y[idx])

    def describe(self) -> dict:
        """What a checkpoint records to recognise the same data stream."""
        return {"kind": "windows", "n_windows": int(self.X.shape[0]), "window_shape": list(self.X.shape[1:]),
                "global_batch_size": self.global_batch_size, "seed": self.seed}


@dataclass(frozen=True)
class TokenStream:
    """An endless, seeded synthetic token stream for next-token prediction.

    Attributes:
        vocab_size: Token ids are in ``[0, vocab_size)``.
        context_len: Tokens per training sequence (inputs; targets are shifted by one).
        global_batch_size: Sequences per optimizer step over all ranks.
        seed: Seeds the chain and every sequence.
        rank: This process's rank.
        world_size: Number of data-parallel processes.
        branching: Likely successors per token (the chain's entropy is at most ``log(branching)``).
    """

    vocab_size: int
    context_len: int
    global_batch_size: int
    seed: int = 0
    rank: int = 0
    world_size: int = 1
    branching: int = 4
    unit: str = field(default="tokens", init=False)
    _successors: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_positive(vocab_size=self.vocab_size, context_len=self.context_len,
                        global_batch_size=self.global_batch_size, branching=self.branching)
        shard_rows(self.global_batch_size, self.rank, self.world_size)
        rng = np.random.default_rng([self.seed, 0x70CE5])
        successors = rng.integers(0, self.vocab_size, size=(self.vocab_size, self.branching))
        object.__setattr__(self, "_successors", successors)

    @property
    def items_per_step(self) -> int:
        """Target tokens this rank predicts per step."""
        return self.global_batch_size // self.world_size * self.context_len

    def sequences(self, rows: np.ndarray) -> np.ndarray:
        """Token sequences ``(len(rows), context_len + 1)`` of the given global row numbers."""
        n = len(rows)
        draws = [np.random.default_rng([self.seed, int(r)]) for r in rows]
        tokens = np.empty((n, self.context_len + 1), dtype=np.int64)
        tokens[:, 0] = [g.integers(self.vocab_size) for g in draws]
        choices = np.stack([g.integers(self.branching, size=self.context_len) for g in draws]) if n else \
            np.empty((0, self.context_len), dtype=np.int64)
        for t in range(self.context_len):
            tokens[:, t + 1] = self._successors[tokens[:, t], choices[:, t]]
        return tokens

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's inputs and next-token targets of global batch ``step``, each ``(rows, context_len)``."""
        rows = np.arange(self.global_batch_size)[shard_rows(self.global_batch_size, self.rank, self.world_size)]
        seq = torch.from_numpy(self.sequences(int(step) * self.global_batch_size + rows))
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()

    def describe(self) -> dict:
        """What a checkpoint records to recognise the same data stream."""
        return {"kind": "tokens", "vocab_size": self.vocab_size, "context_len": self.context_len,
                "global_batch_size": self.global_batch_size, "seed": self.seed, "branching": self.branching}


@dataclass(frozen=True)
class TokenArray:
    """Sequences cut at seeded random offsets from one long array of token ids.

    Attributes:
        tokens: int64 token ids ``(n_tokens,)``.
        context_len: Tokens per training sequence (inputs; targets are shifted by one).
        global_batch_size: Sequences per optimizer step over all ranks.
        seed: Seeds the offsets of every batch.
        rank: This process's rank.
        world_size: Number of data-parallel processes.
    """

    tokens: np.ndarray
    context_len: int
    global_batch_size: int
    seed: int = 0
    rank: int = 0
    world_size: int = 1
    unit: str = field(default="tokens", init=False)

    def __post_init__(self) -> None:
        _check_positive(context_len=self.context_len, global_batch_size=self.global_batch_size)
        shard_rows(self.global_batch_size, self.rank, self.world_size)
        if self.tokens.ndim != 1 or not np.issubdtype(self.tokens.dtype, np.integer):
            raise ValueError(f"token ids must be a 1-D integer array, got {self.tokens.dtype} {self.tokens.shape}")
        if self.tokens.size <= self.context_len + 1:
            raise ValueError(f"{self.tokens.size} tokens are too few for sequences of {self.context_len} "
                             f"(+1 target); give more data or a smaller --context-len")
        object.__setattr__(self, "tokens", np.ascontiguousarray(self.tokens, dtype=np.int64))

    @classmethod
    def load(cls, path: str, context_len: int, global_batch_size: int, *, vocab_size: int, **kwargs) -> TokenArray:
        """Reads a ``.npy`` of integer token ids (no pickle) and checks them against ``vocab_size``."""
        if not str(path).endswith(".npy"):
            raise ValueError(f"token data must be 'synthetic' or a .npy of integer ids, got {path!r}")
        tokens = np.load(path, allow_pickle=False)
        if tokens.size and tokens.min() < 0:
            raise ValueError(f"{path}: token ids must be >= 0, found {int(tokens.min())}")
        if tokens.size and tokens.max() >= vocab_size:
            raise ValueError(f"{path}: token ids span [{tokens.min()}, {tokens.max()}] but the model's vocabulary "
                             f"is {vocab_size}; pass --vocab-size {int(tokens.max()) + 1} or more")
        return cls(tokens.reshape(-1), context_len, global_batch_size, **kwargs)

    @property
    def items_per_step(self) -> int:
        """Target tokens this rank predicts per step."""
        return self.global_batch_size // self.world_size * self.context_len

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's inputs and next-token targets of global batch ``step``, each ``(rows, context_len)``."""
        starts = np.random.default_rng([self.seed, int(step)]).integers(
            0, self.tokens.size - self.context_len, size=self.global_batch_size)
        starts = starts[shard_rows(self.global_batch_size, self.rank, self.world_size)]
        seq = torch.from_numpy(self.tokens[starts[:, None] + np.arange(self.context_len + 1)])
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()

    def describe(self) -> dict:
        """What a checkpoint records to recognise the same data stream."""
        return {"kind": "token_array", "n_tokens": int(self.tokens.size), "context_len": self.context_len,
                "global_batch_size": self.global_batch_size, "seed": self.seed}


def load_windows(dataset: str, *, hold_out_subject: int | None = None,
                 sample_rate_hz: float | None = None) -> tuple[WindowDataset, WindowDataset | None]:
    """Loads a biosignal dataset for training, optionally keeping one subject out.

    Args:
        dataset: ``"synthetic"``, ``"watch"`` or a ``.npz``/``.csv`` path (see
            :func:`edgeadapt.datasets.load_dataset`).
        hold_out_subject: A subject id to exclude from training (returned separately, e.g.
            as the "new person" to adapt to on the device).
        sample_rate_hz: Sampling rate for files that do not store it.

    Returns:
        ``(training windows, held-out subject's windows or None)``.

    Raises:
        ValueError: If the held-out subject is not in the dataset or no training windows remain.
    """
    kwargs = {"sample_rate_hz": sample_rate_hz} if sample_rate_hz else {}
    ds = load_dataset(dataset, **kwargs)
    if hold_out_subject is None:
        return ds, None
    subjects = [int(s) for s in ds.subjects]
    if hold_out_subject not in subjects:
        raise ValueError(f"subject {hold_out_subject} is not in {dataset!r} (subjects: {subjects})")
    keep = ds.subject != hold_out_subject
    if not keep.any():
        raise ValueError(f"holding out subject {hold_out_subject} leaves no training windows")
    return ds.subset(np.flatnonzero(keep)), ds.subset(np.flatnonzero(~keep))
