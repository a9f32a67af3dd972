"""The torch-free on-device runner: numpy + onnxruntime-training only."""

from ..bundle import BundleError, Manifest, read_manifest
from .device import DEVICES
from .errors import DeviceUnavailableError, InputError, NonFiniteLossError
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
    "DEVICES",
    "SCHEDULES",
]
