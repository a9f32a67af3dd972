"""Progress of an export: its stages on stderr when asked (the CLI asks), nothing otherwise."""

from __future__ import annotations

import torch
from helpers import run_python
from torch import nn

from edgeadapt.cli import main
from edgeadapt.export import export_bundle
from edgeadapt.export.exporter import EXPORT_STAGES


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv1d(4, 8, 5), nn.ReLU(), nn.AdaptiveAvgPool1d(1), nn.Flatten(), nn.Linear(8, 3))


def test_export_shows_each_stage_in_order_only_when_asked(tmp_path, capfd):
    export_bundle(_net(), torch.randn(2, 4, 32), tmp_path / "quiet")
    out, err = capfd.readouterr()
    assert out == "" and err == ""                     # library code prints nothing by default
    export_bundle(_net(), torch.randn(2, 4, 32), tmp_path / "shown", progress=True)
    out, err = capfd.readouterr()
    assert out == ""
    positions = [err.find(f"export: {stage}") for stage in EXPORT_STAGES]
    assert -1 not in positions and positions == sorted(positions), err


def test_the_cli_shows_export_progress_and_no_progress_turns_it_off(tmp_path, monkeypatch, capfd):
    (tmp_path / "progress_test_nets.py").write_text(
        "from torch import nn\n\ndef make():\n    return nn.Sequential(nn.Conv1d(4, 8, 5), nn.ReLU(), "
        "nn.AdaptiveAvgPool1d(1), nn.Flatten(), nn.Linear(8, 3))\n")
    monkeypatch.chdir(tmp_path)
    args = ["export", "progress_test_nets:make", "--input-shape", "4,32", "--out"]
    assert main([*args, "a"]) == 0
    err = capfd.readouterr().err
    assert all(f"export: {stage}" in err for stage in EXPORT_STAGES), err
    assert main([*args, "b", "--no-progress"]) == 0
    assert capfd.readouterr().err == ""


def test_a_disabled_progress_builds_nothing_of_tqdm():
    """A disabled tqdm bar still creates tqdm's (multiprocessing) write lock; Stages builds no bar."""
    proc = run_python("""
        from edgeadapt.progress import Stages
        with Stages("export", 2) as stages:
            stages.start("a")
            stages.start("b")
        import sys
        std = sys.modules.get("tqdm.std")
        print(std is None or "_lock" not in vars(std.tqdm))
    """)
    assert proc.returncode == 0 and proc.stdout.strip() == "True", proc.stderr
