"""Which training engine runs a bundle: what the bundle holds (``manifest.backends``), what is
installed, and what the caller asks for (``auto``, ``portable``, ``ort-training``).

``auto`` takes the portable step graphs when the bundle holds them (they run on any onnxruntime)
and the onnxruntime-training graphs otherwise - except for a bundle exported under a memory
budget that also holds onnxruntime-training graphs, where that engine is installed: the plan
fits every engine the bundle holds (it is made with constants bounding each one's,
docs/cost_model.md), but onnxruntime-training holds about half the memory per trained byte, and
bundles exported before the portable engine's constants were measured were verified on it alone.
A bundle whose engines are not installed is refused in one line naming the extra to install.
"""

from __future__ import annotations

import importlib.util

from ..bundle import BACKEND_FILE_ROLES, BACKENDS, PORTABLE_STATS_ROLE, BundleError, Manifest
from .ort_import import import_onnxruntime, pybind_state

__all__ = ["BACKEND_CHOICES", "BackendUnavailableError", "STATE_ROLES", "backend_installed", "choose_backend",
           "dropped_roles", "kept_roles"]

#: What ``Runner.load(backend=...)`` and ``--backend`` accept.
BACKEND_CHOICES = ("auto", *BACKENDS)
#: The manifest file role holding each backend's parameters and optimizer state.
STATE_ROLES = {"ort-training": "checkpoint", "portable": "portable_state"}
#: The extra that installs each backend's engine.
_EXTRAS = {"ort-training": "device-ort-training", "portable": "device"}
_ENGINES = {"ort-training": "onnxruntime-training", "portable": "onnxruntime"}


class BackendUnavailableError(RuntimeError):
    """The bundle's training engine is not installed here (the message names the extra)."""


def backend_installed(backend: str) -> bool:
    """Whether this installation can run ``backend``'s graphs."""
    if backend == "ort-training":  # the training build's pybind layer carries the training API
        return hasattr(pybind_state, "Module") and hasattr(pybind_state, "load_checkpoint")
    return importlib.util.find_spec("onnx") is not None


def choose_backend(manifest: Manifest, requested: str = "auto", where: str = "the bundle") -> str:
    """The backend to open ``manifest``'s bundle with.

    Raises:
        ValueError: ``requested`` is not one of :data:`BACKEND_CHOICES`.
        BundleError: ``requested`` names a backend the bundle does not hold.
        BackendUnavailableError: the chosen backend (for ``auto``: every one the bundle holds)
            is not installed.
    """
    if requested not in BACKEND_CHOICES:
        raise ValueError(f"backend must be one of {BACKEND_CHOICES}, got {requested!r}")
    held = [b for b in ("portable", "ort-training") if manifest.has_backend(b)]
    if requested != "auto" and requested not in held:
        raise BundleError(f"{where} holds no {requested} graphs (it holds {held}); use backend 'auto' or re-export it "
                          f"with `edgeadapt export --backend {requested}`")
    candidates = held if requested == "auto" else [requested]
    if requested == "auto" and (manifest.plan or {}).get("budget_bytes") is not None and "ort-training" in held:
        candidates = ["ort-training", *(b for b in held if b != "ort-training")]  # the budget's engine first
    for b in candidates:
        if backend_installed(b):
            return b
    b = candidates[0]
    version = import_onnxruntime().__version__
    raise BackendUnavailableError(
        f"{where} trains with {b} ({_ENGINES[b]}), which this installation (onnxruntime {version}) cannot run: "
        f"pip install \".[{_EXTRAS[b]}]\" in an edgeadapt checkout (or the wheel with [{_EXTRAS[b]}])")


def dropped_roles(backend: str) -> set[str]:
    """File roles a bundle saved by ``backend`` leaves out: the other backends' files."""
    other = {r for b in BACKENDS if b != backend for r in BACKEND_FILE_ROLES[b]}
    return other | ({PORTABLE_STATS_ROLE} if backend != "portable" else set())


def kept_roles(manifest: Manifest, backend: str) -> set[str]:
    """File roles of ``manifest`` that a save by ``backend`` keeps (its graphs, state, shared files)."""
    return set(manifest.files) - dropped_roles(backend)
