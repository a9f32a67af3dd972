"""The manifest's vocabulary is spelled once (edgeadapt.bundle) and used from there."""

from __future__ import annotations

from edgeadapt import bundle
from edgeadapt.cli import build_parser
from edgeadapt.sched.policy import Mode


def _choices(command: str, option: str) -> tuple:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    return tuple(next(a for a in sub._actions if option in a.option_strings).choices)


def test_parameter_modes_are_the_policy_modes():
    assert bundle.PARAMETER_MODES == tuple(m.value for m in Mode)


def test_exporter_and_cli_take_the_bundle_vocabulary():
    from edgeadapt.export import objectives, prepare

    assert objectives.LOSSES is bundle.LOSSES and objectives.OPTIMIZERS is bundle.OPTIMIZERS
    assert prepare.BATCHNORM_MODES is bundle.BATCHNORM_MODES
    assert _choices("export", "--loss") == bundle.LOSSES
    assert _choices("export", "--optimizer") == bundle.OPTIMIZERS
    assert _choices("export", "--batchnorm") == bundle.BATCHNORM_MODES
