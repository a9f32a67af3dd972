"""Per-channel standardisation fitted on source data only.

In leave-one-subject-out evaluation the statistics must come from the source subjects: fitting
them on the held-out subject leaks its data into the model. :meth:`ChannelNormalizer.fit` reads
only the windows it is given (optionally only ``indices`` of a dataset); the result is a JSON-able
value that travels with a model to the device.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .window_dataset import WindowDataset

__all__ = ["ChannelNormalizer"]

logger = logging.getLogger(__name__)

# A channel whose standard deviation is below this is treated as constant (dead electrode):
# it is centred but not scaled, so that it cannot blow up on data where it is not constant.
_MIN_STD = 1e-6


@dataclass(frozen=True)
class ChannelNormalizer:
    """``x -> (x - mean[c]) / std[c]`` per channel ``c``.

    Attributes:
        channel_names: the channels, in order; :meth:`apply` refuses a dataset with others.
        mean: per-channel mean over windows and time steps.
        std: per-channel standard deviation (population), > 0; 1.0 for a constant channel.
    """

    channel_names: tuple[str, ...]
    mean: tuple[float, ...]
    std: tuple[float, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "channel_names", tuple(str(n) for n in self.channel_names))
        object.__setattr__(self, "mean", tuple(float(v) for v in self.mean))
        object.__setattr__(self, "std", tuple(float(v) for v in self.std))
        n = len(self.channel_names)
        if n == 0 or len(self.mean) != n or len(self.std) != n:
            raise ValueError(
                f"need one mean and one std per channel: {n} channel_names, {len(self.mean)} means, "
                f"{len(self.std)} stds"
            )
        if not all(math.isfinite(v) for v in self.mean):
            raise ValueError(f"mean must be finite, got {self.mean}")
        if not all(math.isfinite(v) and v > 0 for v in self.std):
            raise ValueError(f"std must be finite and > 0, got {self.std}")

    @classmethod
    def fit(cls, dataset: WindowDataset, indices: np.ndarray | Sequence[int] | None = None) -> ChannelNormalizer:
        """Statistics of ``dataset`` (or of its windows ``indices`` only), per channel.

        Args:
            dataset: the data to fit on.
            indices: optional window indices (e.g. ``source_idx`` of a split); only these
                windows are read.

        Raises:
            ValueError: no windows to fit on.
        """
        X = dataset.X if indices is None else dataset.X[np.asarray(indices, dtype=np.int64)]
        if X.shape[0] == 0:
            raise ValueError("cannot fit a ChannelNormalizer on zero windows")
        mean = X.mean(axis=(0, 2), dtype=np.float64)
        std = X.std(axis=(0, 2), dtype=np.float64)
        constant = std < _MIN_STD
        if constant.any():
            names = [dataset.channel_names[i] for i in np.flatnonzero(constant)]
            logger.warning("channels %s are constant in the fitting data; they are centred, not scaled", names)
            std[constant] = 1.0
        return cls(channel_names=dataset.channel_names, mean=tuple(mean), std=tuple(std))

    def apply(self, dataset: WindowDataset) -> WindowDataset:
        """A copy of ``dataset`` with every channel standardised (``float32``)."""
        if dataset.channel_names != self.channel_names:
            raise ValueError(
                f"normalizer was fitted on channels {list(self.channel_names)}, "
                f"dataset has {list(dataset.channel_names)}"
            )
        mean = np.asarray(self.mean)[None, :, None]
        std = np.asarray(self.std)[None, :, None]
        return dataclasses.replace(dataset, X=((dataset.X - mean) / std).astype(np.float32))

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict; :meth:`from_dict` restores it exactly."""
        return {"channel_names": list(self.channel_names), "mean": list(self.mean), "std": list(self.std)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ChannelNormalizer:
        """The normalizer described by :meth:`to_dict`'s output."""
        keys = {"channel_names", "mean", "std"}
        if set(data) != keys:
            raise ValueError(f"normalizer dict must have keys {sorted(keys)}, got {sorted(data)}")
        return cls(channel_names=tuple(data["channel_names"]), mean=tuple(data["mean"]), std=tuple(data["std"]))
