"""Make ``import torch`` fail in this process: proof that the device side runs without it."""

from __future__ import annotations

import importlib.abc
import sys

__all__ = ["forbid_torch", "TorchForbidden"]


class TorchForbidden(importlib.abc.MetaPathFinder):
    """A meta-path finder that raises ``ModuleNotFoundError`` (an ``ImportError``, named like a
    missing package's) for ``torch`` and its submodules, as on a machine without torch."""

    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError(f"torch is blocked in this process: {name}", name=name)
        return None


def forbid_torch() -> None:
    """Install :class:`TorchForbidden` first on ``sys.meta_path`` (idempotent).

    Raises:
        RuntimeError: torch was already imported in this process.
    """
    if "torch" in sys.modules:
        raise RuntimeError("torch is already imported in this process; forbid it before any import")
    if not any(isinstance(f, TorchForbidden) for f in sys.meta_path):
        sys.meta_path.insert(0, TorchForbidden())
