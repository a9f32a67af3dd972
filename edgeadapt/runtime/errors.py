"""Errors of the on-device runner; each message names the problem and the fix."""

from __future__ import annotations

from ..bundle import BundleError

__all__ = ["BundleError", "InputError", "DeviceUnavailableError", "NonFiniteLossError"]


class InputError(ValueError):
    """Data given to the runner does not match the bundle's input or label specification."""


class DeviceUnavailableError(RuntimeError):
    """The requested device cannot create a training session."""


class NonFiniteLossError(FloatingPointError):
    """A training step produced a NaN or infinite loss; no update from that step was applied.

    Attributes:
        step: the global step at which it happened.
        loss: the offending loss value.
    """

    def __init__(self, step: int, loss: float):
        self.step, self.loss = step, loss
        super().__init__(
            f"loss became {loss} at step {step}; the update of that step was not applied and the "
            "runner keeps the last good parameters. Lower the learning rate or check the data "
            "for extreme values (normalise it as the source model was trained)"
        )
