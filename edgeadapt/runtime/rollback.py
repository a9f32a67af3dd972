"""The values a rollback restores: a copy of the tensors training changes, taken at an epoch's start.

ONNX Runtime 1.19.2's Python binding reads and writes parameters (``CheckpointState.get_parameter``)
but exposes no optimizer state, which only a checkpoint file carries. So the runner keeps this
copy (the trained tensors and any running statistics: small next to a whole checkpoint, which
holds every frozen tensor too) and restores optimizer state by replaying the call's completed
epochs from the checkpoint the call started from; the copy then proves the replay bit-exact
(see ``Runner.adapt``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .backend import TrainingBackend

__all__ = ["EpochValues"]


@dataclass(frozen=True)
class EpochValues:
    """Copies of named graph tensors."""

    values: dict[str, np.ndarray]

    @classmethod
    def take(cls, backend: TrainingBackend, names: list[str]) -> EpochValues:
        return cls({n: backend.get_tensor(n) for n in names})

    @property
    def nbytes(self) -> int:
        """Bytes held by the copies."""
        return sum(v.nbytes for v in self.values.values())

    def differing(self, backend: TrainingBackend) -> list[str]:
        """Names whose current value is not bit-identical to the copy."""
        return [n for n, v in self.values.items() if not np.array_equal(backend.get_tensor(n), v)]

    def restore(self, backend: TrainingBackend) -> None:
        """Write the copies back."""
        for n, v in self.values.items():
            backend.set_tensor(n, v)
