"""How far to trust a target's normalisation statistics: an empirical-Bayes weight per BatchNorm.

Label-free adaptation mixes each BatchNorm's statistics as ``(1 - w) * source + w * target``.
The target statistics are estimated from the windows seen so far; their sampling noise is what
makes re-estimating them hurt a subject whose data is close to the source. Treat the source
statistics as the prior and the target estimate as one noisy observation of the subject's true
statistics: with ``D`` the squared distance of the estimate from the source and ``N`` its
expected value when the subject equals the source (the sampling noise), the prior's spread is
about ``D - N`` and the posterior weight of the observation is ``(D - N) / D``: the
positive-part James-Stein weight ``w = max(0, 1 - N / D)``. Summed over a layer's channels,
``D`` and ``N`` are estimated with far less noise than per channel, so ``w`` is one per layer.

Per channel, the distance counts the mean in source standard deviations and the log-variance:
``(m_t - m_s)^2 / v_s + (log v_t - log v_s)^2``. The noise comes from the spread between
*groups* of windows (a cluster estimate: :class:`GroupedStatistics`), so that windows that are
alike (one activity, one stretch of time) count as one piece of evidence rather than many.

Fixed size: per layer, a handful of per-channel sums, however many groups arrive.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = ["GroupedStatistics", "shrinkage_weight"]

# Floor of variances before dividing or taking logs (float32 statistics; a dead channel has 0).
_VAR_FLOOR = 1e-8


def _log_var(var: np.ndarray) -> np.ndarray:
    return np.log(np.maximum(var, _VAR_FLOOR))


@dataclass
class _ClusterSums:
    """Per-channel sums over groups ``g`` of ``b_g`` windows with value ``x_g``: ``sum b x``,
    ``sum b^2 x`` and ``sum b^2 x^2`` (the window counts are :class:`GroupedStatistics`')."""

    s: np.ndarray
    bx2: np.ndarray = field(init=False)
    b2x2: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.bx2 = np.zeros_like(self.s)
        self.b2x2 = np.zeros_like(self.s)

    def add(self, x: np.ndarray, b: int) -> None:
        self.s += b * x
        self.bx2 += b * b * x
        self.b2x2 += b * b * x * x

    def noise(self, n: int, b2: int, groups: int) -> np.ndarray:
        """The cluster-robust variance of the window-weighted mean ``m = sum b x / n``:
        ``G / (G - 1) * sum b_g^2 (x_g - m)^2 / n^2`` (``n = sum b``, ``b2 = sum b^2``)."""
        mean = self.s / n
        spread = np.maximum(self.b2x2 - 2 * mean * self.bx2 + mean * mean * b2, 0.0)
        return groups / (groups - 1) * spread / (n * n)


class GroupedStatistics:
    """Per-group statistics of one BatchNorm's channels, reduced to the sums the noise needs."""

    def __init__(self, channels_shape: tuple[int, ...]):
        self._mean = _ClusterSums(np.zeros(channels_shape, dtype=np.float64))
        self._log_var = _ClusterSums(np.zeros(channels_shape, dtype=np.float64))
        self.n = self.b2 = self.groups = 0

    def add(self, mean: np.ndarray, var: np.ndarray, windows: int) -> None:
        """One group's per-channel mean and variance, estimated from ``windows`` windows."""
        self._mean.add(mean.astype(np.float64), windows)
        self._log_var.add(_log_var(var.astype(np.float64)), windows)
        self.n += windows
        self.b2 += windows * windows
        self.groups += 1

    def noise(self) -> tuple[np.ndarray, np.ndarray]:
        """Sampling variance of the target's per-channel mean and of its log-variance."""
        return (self._mean.noise(self.n, self.b2, self.groups),
                self._log_var.noise(self.n, self.b2, self.groups))


def shrinkage_weight(source_mean: np.ndarray, source_var: np.ndarray, target_mean: np.ndarray,
                     target_var: np.ndarray, groups: GroupedStatistics, min_groups: int) -> float:
    """The weight of the target statistics of one BatchNorm (module docstring), 0..1.

    ``target_mean`` / ``target_var`` are the pooled estimates over all windows; ``groups``
    holds the same windows' per-group statistics. With fewer than ``min_groups`` groups the
    noise cannot be measured and the source statistics stay (0).
    """
    if groups.groups < max(2, min_groups):
        return 0.0
    sv = np.maximum(source_var.astype(np.float64), _VAR_FLOOR)
    mean_noise, log_var_noise = groups.noise()
    distance = float(np.sum((target_mean - source_mean) ** 2 / sv + (_log_var(target_var) - np.log(sv)) ** 2))
    noise = float(np.sum(mean_noise / sv + log_var_noise))
    if distance <= 0.0:
        return 0.0
    return float(min(1.0, max(0.0, 1.0 - noise / distance)))
