"""Execution device choice for the training session: ``auto``, ``cuda`` or ``cpu``.

``auto`` tries CUDA when ONNX Runtime lists the CUDA provider and falls back to the CPU with one
logged warning if the session cannot be created there; ``cuda`` fails with
:class:`DeviceUnavailableError`; ``cpu`` always uses the CPU.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

from onnxruntime.capi import _pybind_state as C

from .errors import DeviceUnavailableError

__all__ = ["DEVICES", "cuda_listed", "open_on_device"]

log = logging.getLogger(__name__)

DEVICES = ("auto", "cuda", "cpu")
T = TypeVar("T")


def cuda_listed() -> bool:
    """Whether the installed ONNX Runtime build lists the CUDA execution provider."""
    return "CUDAExecutionProvider" in C.get_available_providers()


def open_on_device(device: str, create: Callable[[str], T]) -> tuple[T, str]:
    """Call ``create(kind)`` on the device that ``device`` selects.

    Args:
        device: ``auto``, ``cuda`` or ``cpu``.
        create: builds the session for ``"cuda"`` or ``"cpu"``; raises on failure.

    Returns:
        What ``create`` returned and the device kind actually used.

    Raises:
        DeviceUnavailableError: ``device="cuda"`` and CUDA could not create the session.
        ValueError: unknown ``device``.
    """
    if device not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES}, got {device!r}")
    if device == "cpu":
        return create("cpu"), "cpu"
    if device == "cuda" or cuda_listed():
        try:
            return create("cuda"), "cuda"
        except Exception as e:  # ORT raises RuntimeError/Fail subclasses for missing CUDA libraries
            reason = str(e).strip().splitlines()[-1][:300] if str(e).strip() else type(e).__name__
            if device == "cuda":
                raise DeviceUnavailableError(
                    f"CUDA cannot run the training session ({reason}). Install the CUDA build "
                    "(the device-cuda extra: pip install \".[device-cuda]\" in an edgeadapt checkout, with the CUDA "
                    "and cuDNN libraries onnxruntime-gpu needs), or use --device cpu / device='cpu'"
                ) from None
            log.warning("CUDA could not create the training session (%s); falling back to the CPU", reason)
    else:
        log.info("this ONNX Runtime build has no CUDA provider; using the CPU")
    return create("cpu"), "cpu"
