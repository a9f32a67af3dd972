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
        restored_step: the step whose state the runner now holds (``Runner.adapt`` rolls back to
            the start of the failing epoch; ``Runner.train_step`` just skips the update).
    """

    def __init__(self, step: int, loss: float, restored_step: int | None = None):
        self.step, self.loss = step, loss
        self.restored_step = step if restored_step is None else restored_step
        kept = ("the update of that step was not applied" if restored_step is None else
                f"the runner rolled back to step {restored_step}, the start of that epoch, with "
                "its parameters and optimizer state")
        super().__init__(
            f"loss became {loss} at step {step}; {kept}. Lower the learning rate or check the "
            "data for extreme values (normalise it as the source model was trained)"
        )
