"""Import ONNX Runtime without letting it import torch.

``import onnxruntime`` (and so any ``onnxruntime.capi...`` import, which runs the package's
``__init__`` first) validates the build by importing ``onnxruntime.training.ortmodule``; in the
training packages that reaches ``onnxruntime.training.optim`` / ``onnxruntime.training.ortmodule``,
which import torch whenever torch is installed. Measured with torch 2.x installed, a fresh
``import edgeadapt.runtime`` holds 349 MB resident (200 MB anonymous) that way, and 67 MB
(33 MB anonymous) through this module. The import is wrapped in a ``try`` by ONNX Runtime itself, because plain
``onnxruntime`` builds have no ``training`` package: an ``ImportError`` there is the expected,
handled path, and the package comes up complete (sessions, providers, the pybind training
classes in ``onnxruntime.capi._pybind_state``).

:func:`import_onnxruntime` takes exactly that path on purpose: while it imports the package, a
meta-path finder answers "not found" for ``torch`` and ``onnxruntime.training`` (both with their
submodules), for the importing thread only, and is removed afterwards. Nothing is left in
``sys.modules`` for those names, so a later ``import torch`` or ``from onnxruntime.training
import artifacts`` in the same process (the exporter) loads them normally; and an exporter that
imported onnxruntime first, with torch, is left as it is. What the skipped step decides is
informational only: ``onnxruntime.package_name`` / ``cuda_version`` stay empty, as they do
whenever ``onnxruntime.training.ortmodule`` fails to import (as it does with torch 2.x).

If ONNX Runtime is already imported, or torch is, nothing is blocked: the process already holds
what the block would have avoided.
"""

from __future__ import annotations

import importlib
import importlib.abc
import sys
import threading
from types import ModuleType

__all__ = ["import_onnxruntime", "pybind_state", "BLOCKED_PREFIXES"]

#: Module names (and their submodules) that are reported missing while ONNX Runtime is imported.
BLOCKED_PREFIXES = ("torch", "onnxruntime.training")


def _blocked(name: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in BLOCKED_PREFIXES)


class _SkipTorchPaths(importlib.abc.MetaPathFinder):
    """Reports :data:`BLOCKED_PREFIXES` as not installed, to one thread only."""

    def __init__(self) -> None:
        self._thread = threading.get_ident()

    def find_spec(self, name, path=None, target=None):
        if threading.get_ident() == self._thread and _blocked(name):
            raise ModuleNotFoundError(f"{name} is skipped while edgeadapt imports onnxruntime", name=name)
        return None


def import_onnxruntime() -> ModuleType:
    """Import (or return the already imported) ``onnxruntime`` package without importing torch.

    Returns:
        The ``onnxruntime`` module; ``onnxruntime.capi._pybind_state`` is loaded too.
    """
    if "onnxruntime" in sys.modules or "torch" in sys.modules:
        return _with_pybind(importlib.import_module("onnxruntime"))
    finder = _SkipTorchPaths()
    sys.meta_path.insert(0, finder)
    try:
        ort = importlib.import_module("onnxruntime")
    finally:
        sys.meta_path.remove(finder)
    return _with_pybind(ort)


def _with_pybind(ort: ModuleType) -> ModuleType:
    importlib.import_module("onnxruntime.capi._pybind_state")
    return ort


import_onnxruntime()
#: ``onnxruntime.capi._pybind_state`` (the pybind training and session classes), imported the
#: torch-free way: ``from edgeadapt.runtime.ort_import import pybind_state as C``.
pybind_state: ModuleType = sys.modules["onnxruntime.capi._pybind_state"]
