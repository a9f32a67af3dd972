"""Ctrl-C during ``edgeadapt train``: a checkpoint at a step boundary, one line, exit 130; it resumes exactly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from edgeadapt.cli import main

# a 2-block GPT small enough for many steps per second (as in test_train_cli)
TINY_GPT = ["--model", "gpt-nano", "--vocab-size", "64", "--context-len", "16", "--d-model", "32",
            "--n-layers", "2", "--batch-size", "4", "--lr", "1e-2", "--no-progress", "--offload", "disk"]


def _latest_step(run_dir: Path) -> int | None:
    try:
        return json.loads((run_dir / "checkpoints" / "latest.json").read_text())["step"]
    except (OSError, ValueError):
        return None


def test_ctrl_c_writes_a_checkpoint_prints_one_line_and_exits_130(tmp_path, capsys):
    run = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "edgeadapt", "train", *TINY_GPT, "--steps", "100000",
                             "--checkpoint-every", "5", "--checkpoint-dir", str(run)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 240
        while _latest_step(run) is None:  # the loop runs (its first checkpoint is written)
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    lines = [line for line in (out + err).splitlines() if "interrupted" in line]
    assert len(lines) == 1 and "--resume" in lines[0], out + err
    stopped = _latest_step(run)
    assert f"after step {stopped} of 100000" in lines[0]
    assert not (run / "weights.pt").exists()  # the run is not finished

    # the checkpoint is a step boundary: resuming to two steps later ends bit-identical to a
    # run that was never interrupted
    capsys.readouterr()
    assert main(["train", *TINY_GPT, "--steps", str(stopped + 2), "--checkpoint-dir", str(run), "--resume"]) == 0
    assert main(["train", *TINY_GPT, "--steps", str(stopped + 2), "--checkpoint-dir", str(tmp_path / "straight")]) == 0
    a = torch.load(run / "weights.pt", map_location="cpu", weights_only=True)
    b = torch.load(tmp_path / "straight" / "weights.pt", map_location="cpu", weights_only=True)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
