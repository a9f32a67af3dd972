"""Errors of the on-device runner; each message names the problem and the fix."""

from __future__ import annotations

from ..bundle import BundleError

__all__ = ["BundleError", "InputError", "DeviceUnavailableError", "NonFiniteLossError", "NonFiniteUpdateError",
           "NonFiniteStateError", "AdaptInterrupted"]


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
        super().__init__(f"loss became {loss} at step {step}; {self._kept(restored_step)}. {self._advice}")

    _advice = ("Lower the learning rate or check the data for extreme values (normalise it as the source "
               "model was trained)")

    @staticmethod
    def _kept(restored_step: int | None, applied: bool = False) -> str:
        if restored_step is not None:
            return (f"the runner rolled back to step {restored_step}, the start of that epoch, with its "
                    "parameters and optimizer state")
        if applied:
            return ("the update was applied, so this runner's state is unusable (save refuses it): load "
                    "the bundle again")
        return "the update of that step was not applied"

    def rolled_back(self, restored_step: int) -> NonFiniteLossError:
        """The same failure, reported after a rollback to ``restored_step``."""
        return NonFiniteLossError(self.step, self.loss, restored_step)


class NonFiniteUpdateError(NonFiniteLossError):
    """A training step's loss was finite but its update was not: a gradient too large for the
    optimizer's state (not applied), or a trained value that became non-finite or too large to
    save (applied; :meth:`Runner.adapt` then rolls back as for a non-finite loss).

    Attributes:
        reason: which tensor, and what it reached.
        applied: whether the update was applied (only a bare :meth:`Runner.train_step` leaves it so).
    """

    def __init__(self, step: int, loss: float, reason: str, applied: bool, restored_step: int | None = None):
        self.step, self.loss, self.reason, self.applied = step, loss, reason, applied
        self.restored_step = step if restored_step is None else restored_step
        FloatingPointError.__init__(
            self, f"the update of step {step} (loss {loss:.4g}) is not finite: {reason}; "
                  f"{self._kept(restored_step, applied)}. {self._advice}")

    def rolled_back(self, restored_step: int) -> NonFiniteUpdateError:
        return NonFiniteUpdateError(self.step, self.loss, self.reason, self.applied, restored_step)


class AdaptInterrupted(KeyboardInterrupt):
    """Ctrl-C stopped :meth:`Runner.adapt` at a step boundary; the runner was brought back to the
    end of the last completed epoch (parameters and optimizer state, as after a non-finite loss),
    so it can be saved and resumed.

    Attributes:
        step, epoch: the runner's step and epoch now (the end of the last completed epoch).
        epochs_done: epochs this call completed (0: the runner is as before the call).
    """

    def __init__(self, step: int, epoch: int, epochs_done: int):
        self.step, self.epoch, self.epochs_done = step, epoch, epochs_done
        super().__init__(f"interrupted; the runner holds the end of epoch {epoch} (step {step}), "
                         "the last completed one")


class NonFiniteStateError(ValueError):
    """The runner holds a trained value that is non-finite or too large to load again; nothing is
    saved from such a state."""
