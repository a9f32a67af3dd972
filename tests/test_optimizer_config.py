"""``OptimizerConfig``: one definition for exporter, runner manifest and server trainer."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from edgeadapt.optimizer_config import OptimizerConfig


@pytest.mark.parametrize("lr", [0.0, -1e-3, math.nan, math.inf])
def test_a_learning_rate_that_is_not_finite_and_positive_is_refused(lr):
    with pytest.raises(ValueError, match="lr must be a finite number > 0"):
        OptimizerConfig("adamw", lr=lr)


def test_bad_names_and_decays_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="optimizer must be one of"):
        OptimizerConfig("adam")
    with pytest.raises(ValueError, match="weight_decay must be"):
        OptimizerConfig("adamw", weight_decay=-0.1)
    with pytest.raises(ValueError, match="use weight_decay=0"):
        OptimizerConfig("sgd", weight_decay=0.01)


def test_coerce_round_trips_the_manifest_entry_and_names():
    cfg = OptimizerConfig("adamw", lr=3e-3, weight_decay=0.02, betas=(0.8, 0.99), eps=1e-7)
    assert OptimizerConfig.coerce(cfg.to_dict()) == cfg  # betas come back from JSON as a list
    assert OptimizerConfig.coerce(cfg) is cfg
    assert OptimizerConfig.coerce("sgd") == OptimizerConfig("sgd", weight_decay=0.0)
    assert OptimizerConfig.coerce("adamw").state_kinds == ("exp_avg", "exp_avg_sq")
    assert OptimizerConfig.coerce("sgd").state_kinds == ()
    with pytest.raises(TypeError, match="optimizer must be"):
        OptimizerConfig.coerce(3)


def test_server_and_exporter_share_the_class_and_it_imports_no_torch():
    from edgeadapt.export import OptimizerConfig as exported
    from edgeadapt.server import OptimizerConfig as served

    assert exported is served is OptimizerConfig
    code = "import sys, edgeadapt.optimizer_config; assert 'torch' not in sys.modules and 'onnx' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
