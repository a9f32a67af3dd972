"""Which training engines ``export_bundle(backend=...)`` writes (the product's resolution, not
the test suite's ort-training default, see tests/conftest.py)."""

from __future__ import annotations

import importlib.util

import pytest

from edgeadapt.export import exporter


def resolve(backend: str) -> tuple[str, ...]:
    chosen = exporter.resolve_backends
    return getattr(chosen, "__wrapped__", chosen)(backend)


def _without_onnxruntime_training(monkeypatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "onnxruntime.training" else real(name, *a))


def test_auto_writes_both_where_onnxruntime_training_is_installed():
    if importlib.util.find_spec("onnxruntime.training") is None:
        pytest.skip("onnxruntime-training is not installed here")
    assert resolve("auto") == ("ort-training", "portable")
    assert resolve("both") == ("ort-training", "portable")
    assert resolve("portable") == ("portable",)


def test_auto_writes_portable_alone_where_it_is_not(monkeypatch):
    _without_onnxruntime_training(monkeypatch)
    assert resolve("auto") == ("portable",)
    assert resolve("portable") == ("portable",)
    for wanted in ("ort-training", "both"):
        with pytest.raises(ValueError, match="export with backend='portable'"):
            resolve(wanted)


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="backend must be one of"):
        resolve("tensorrt")
