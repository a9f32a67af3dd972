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


@pytest.mark.parametrize("backend", ["auto", "both"])
def test_auto_leaves_out_an_onnxruntime_training_engine_that_fails_its_self_check(tmp_path, monkeypatch, caplog,
                                                                                  backend):
    """``auto`` asks for what works: where ONNX Runtime's training step does not reproduce torch
    (its self-check refuses) but the portable graphs do, the bundle holds the portable engine
    alone, with a warning; ``both`` asked for both, so the refusal stands."""
    import logging

    import numpy as np
    import torch
    from torch import nn

    from edgeadapt.export import UpdatePolicy
    from edgeadapt.export.selfcheck import SelfCheckError
    from edgeadapt.runtime import Runner

    if importlib.util.find_spec("onnxruntime.training") is None:
        pytest.skip("onnxruntime-training is not installed here")
    real = getattr(exporter.resolve_backends, "__wrapped__", exporter.resolve_backends)
    monkeypatch.setattr(exporter, "resolve_backends", real)  # the product's auto: both engines here

    def refusing(*args):
        raise SelfCheckError("gradient of 0.weight differs (a planted refusal)")

    monkeypatch.setattr(exporter, "choose_session", refusing)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6, 2)).eval()
    out = tmp_path / "b"
    with caplog.at_level(logging.WARNING):
        if backend == "both":
            with pytest.raises(SelfCheckError, match="planted"):
                exporter.export_bundle(model, torch.randn(4, 3, 8), out, policy=UpdatePolicy.full(), backend=backend)
            assert not out.exists()
            return
        manifest = exporter.export_bundle(model, torch.randn(4, 3, 8), out, policy=UpdatePolicy.full(),
                                          backend=backend)
    assert manifest.backends == ("portable",) and "portable engine only" in caplog.text
    assert not any((out / f).exists() for f in exporter.ORT_TRAINING_FILES.values())
    rng = np.random.default_rng(0)
    runner = Runner.load(out, device="cpu")
    assert runner.backend == "portable"
    result = runner.adapt(rng.standard_normal((8, 3, 8)).astype(np.float32), rng.integers(0, 2, 8), epochs=1,
                          batch_size=4, progress=False)
    assert result.steps == 2 and np.isfinite(result.epoch_losses).all()
