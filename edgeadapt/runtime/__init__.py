"""The torch-free on-device runner: numpy + onnxruntime-training only.

Importing this package never imports torch, even where torch is installed (onnxruntime's own
package ``__init__`` would; see :mod:`edgeadapt.runtime.ort_import`).
"""

# First: every onnxruntime import below finds the package already imported without torch.
from . import ort_import  # noqa: F401
# isort: split
from ..bundle import BundleError, Manifest, read_manifest
from .device import DEVICES
from .errors import (AdaptInterrupted, DeviceUnavailableError, InputError, NonFiniteLossError, NonFiniteStateError,
                     NonFiniteUpdateError)
from .runner import SCHEDULES, AdaptResult, EvalResult, Runner

__all__ = [
    "Runner",
    "AdaptResult",
    "EvalResult",
    "Manifest",
    "read_manifest",
    "BundleError",
    "InputError",
    "DeviceUnavailableError",
    "NonFiniteLossError",
    "NonFiniteUpdateError",
    "NonFiniteStateError",
    "AdaptInterrupted",
    "DEVICES",
    "SCHEDULES",
]
