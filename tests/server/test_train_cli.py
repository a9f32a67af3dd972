"""``edgeadapt train``: resumable runs, refused checkpoints, bad input, torchrun, train -> export -> adapt."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from server_helpers import assert_same_gpt_parameters

from edgeadapt.cli import main

REPO = Path(__file__).resolve().parents[2]
# a 2-block GPT small enough for seconds per run: 64 tokens of vocabulary, context 16, width 32
TINY_GPT = ["--model", "gpt-nano", "--vocab-size", "64", "--context-len", "16", "--d-model", "32",
            "--n-layers", "2", "--batch-size", "4", "--lr", "1e-2", "--no-progress"]


def _train(run_dir: Path, *extra: str) -> int:
    return main(["train", *TINY_GPT, "--checkpoint-dir", str(run_dir), *extra])


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "weights.pt", map_location="cpu", weights_only=True)


@pytest.mark.parametrize("offload", ["disk", "host"])
def test_a_run_stopped_and_resumed_ends_where_an_uninterrupted_run_ends(tmp_path, offload, capsys):
    budget = ["--memory-budget", "1MiB", "--offload", offload]
    assert _train(tmp_path / "straight", "--steps", "4", *budget) == 0
    assert _train(tmp_path / "resumed", "--steps", "2", *budget) == 0
    assert _train(tmp_path / "resumed", "--steps", "4", "--resume", *budget) == 0
    out = capsys.readouterr().out
    assert "resuming" in out and "at step 2" in out
    assert "tokens/s" in out and f"{offload} " in out        # progress: throughput and bytes per tier
    a, b = _weights(tmp_path / "straight"), _weights(tmp_path / "resumed")
    assert a.keys() == b.keys()
    for name in a:                                             # same arithmetic: bit-identical
        assert torch.equal(a[name], b[name]), name
    spec = json.loads((tmp_path / "straight" / "model.json").read_text())
    assert spec["factory"] == "edgeadapt.models:build_gpt" and spec["kwargs"]["n_layers"] == 2


def test_the_weights_file_holds_trained_weights_of_the_named_model(tmp_path):
    from edgeadapt.models import build_gpt
    from edgeadapt.server.train_cli import load_trained

    assert _train(tmp_path / "run", "--steps", "2", "--offload", "none") == 0
    model = load_trained(tmp_path / "run")
    torch.manual_seed(0)
    initial = build_gpt("gpt-nano", vocab_size=64, context_len=16, d_model=32, n_layers=2)
    assert type(model) is type(initial)
    assert not torch.equal(model.head.weight, initial.head.weight)
    # the checkpoint's latest step is the final step
    latest = json.loads((tmp_path / "run" / "checkpoints" / "latest.json").read_text())
    assert latest["step"] == 2


def test_resuming_with_other_options_is_refused_with_the_difference_named(tmp_path, capsys):
    assert _train(tmp_path / "run", "--steps", "1", "--offload", "host") == 0
    capsys.readouterr()
    assert _train(tmp_path / "run", "--steps", "2", "--offload", "host", "--resume", "--seed", "9") == 2
    err = capsys.readouterr().err
    assert "another run" in err and "seed" in err


def test_an_existing_checkpoint_needs_resume_and_resume_needs_a_checkpoint(tmp_path, capsys):
    assert _train(tmp_path / "run", "--steps", "1", "--offload", "host") == 0
    assert _train(tmp_path / "run", "--steps", "2", "--offload", "host") == 2
    assert "pass --resume" in capsys.readouterr().err
    assert _train(tmp_path / "empty", "--steps", "2", "--resume") == 2
    assert "no checkpoint" in capsys.readouterr().err


def test_resuming_a_run_already_at_its_steps_is_refused_and_leaves_its_weights(tmp_path, capsys):
    assert _train(tmp_path / "run", "--steps", "2", "--offload", "host") == 0
    before = (tmp_path / "run" / "weights.pt").read_bytes()
    capsys.readouterr()
    for steps in ("2", "1"):
        assert _train(tmp_path / "run", "--steps", steps, "--offload", "host", "--resume") == 2
        assert "is at step 2 already; give --steps above it" in capsys.readouterr().err
    assert (tmp_path / "run" / "weights.pt").read_bytes() == before


@pytest.mark.parametrize("option, value, message", [("--batch-size", "0", "--batch-size must be >= 1"),
                                                    ("--checkpoint-every", "-1", "--checkpoint-every must be >= 0")])
def test_bad_counts_are_refused(tmp_path, capsys, option, value, message):
    assert _train(tmp_path / "run", "--steps", "1", option, value) == 2
    assert message in capsys.readouterr().err and not (tmp_path / "run").exists()


@pytest.mark.parametrize("extra, message", [
    (["--lr", "0"], "--lr must be a finite number > 0"),
    (["--weight-decay", "-1"], "--weight-decay must be a finite number >= 0"),
    (["--shard-optimizer-state", "--offload", "none"], "--shard-optimizer-state (ZeRO-1) shards"),
    (["--context-len", "0"], "--context-len must be >= 1"),
    (["--data", "missing.npy"], "--data missing.npy: no such file"),
    (["--data", "watch"], "--model gpt-nano trains on tokens: give --data synthetic or a .npy"),
])
def test_bad_options_are_refused_before_anything_is_built_or_written(tmp_path, capsys, monkeypatch, extra, message):
    monkeypatch.chdir(tmp_path)
    assert _train(tmp_path / "run", "--steps", "1", *extra) == 2
    assert message in capsys.readouterr().err and not (tmp_path / "run").exists()


def test_hold_out_subject_is_refused_for_gpt_models_naming_the_models_it_applies_to(tmp_path, capsys):
    for extra in ([], ["--plan-only"]):
        assert _train(tmp_path / "run", "--steps", "1", "--hold-out-subject", "3", *extra) == 2
        err = capsys.readouterr().err
        assert "--hold-out-subject applies to the biosignal models (cnn, mobilenet, transformer)" in err
        assert "drop --hold-out-subject" in err and not (tmp_path / "run").exists()


def test_gpt_size_options_are_refused_for_biosignal_models(tmp_path, capsys):
    assert main(["train", "--model", "cnn", "--steps", "1", "--context-len", "32", "--n-layers", "2",
                 "--checkpoint-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "--context-len and --n-layers shape a GPT model (gpt-nano" in err and "--model cnn" in err
    assert not (tmp_path / "run").exists()


def test_a_checkpoint_dir_that_is_a_file_is_named_as_such(tmp_path, capsys):
    a_file = tmp_path / "a_file"
    a_file.write_text("not a run")
    assert _train(a_file, "--steps", "1") == 2
    err = capsys.readouterr().err
    assert f"--checkpoint-dir {a_file} is a file, not a directory" in err and "Errno" not in err
    assert _train(a_file / "run", "--steps", "1") == 2
    err = capsys.readouterr().err
    assert f"{a_file} is a file, not a directory" in err and "Errno" not in err
    assert a_file.read_text() == "not a run"


def test_a_batch_that_does_not_split_over_the_ranks_is_refused_before_the_run_directory(tmp_path, capsys,
                                                                                         monkeypatch):
    import edgeadapt.server.train_cli as train_cli

    monkeypatch.setattr(train_cli, "init_from_env", lambda device_type: train_cli.DistContext(world_size=3))
    assert _train(tmp_path / "run", "--steps", "1") == 2  # --batch-size 4 over 3 ranks
    assert "does not split evenly over 3" in capsys.readouterr().err and not (tmp_path / "run").exists()


def test_negative_token_ids_are_named(tmp_path, capsys):
    np.save(tmp_path / "tokens.npy", np.array([3, -1, 5] * 40))
    assert _train(tmp_path / "run", "--steps", "1", "--data", str(tmp_path / "tokens.npy")) == 2
    assert "token ids must be >= 0, found -1" in capsys.readouterr().err


def test_a_budget_below_the_largest_block_is_refused_naming_the_block(tmp_path, capsys):
    assert _train(tmp_path / "run", "--steps", "1", "--offload", "host", "--memory-budget", "8KiB") == 2
    err = capsys.readouterr().err
    assert "block" in err and "8.00 KiB" in err


def test_cuda_without_cuda_gives_the_runner_s_device_error(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _train(tmp_path / "run", "--steps", "1", "--device", "cuda") == 2
    assert "sees no CUDA device" in capsys.readouterr().err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_torchrun_two_ranks_train_like_one_process(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    args = [*TINY_GPT, "--steps", "3", "--offload", "disk", "--memory-budget", "1MiB"]
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                          "--master-addr=127.0.0.1", f"--master-port={_free_port()}", "-m", "edgeadapt", "train",
                          *args, "--checkpoint-dir", str(tmp_path / "two")],
                         capture_output=True, text=True, env=env, timeout=600)
    assert two.returncode == 0, two.stdout[-2000:] + two.stderr[-3000:]
    assert "x 2 process(es)" in two.stdout
    assert main(["train", *args, "--checkpoint-dir", str(tmp_path / "one")]) == 0
    a, b = _weights(tmp_path / "two"), _weights(tmp_path / "one")
    assert_same_gpt_parameters(a, b)  # tolerance and the key bias: see server_helpers


@pytest.mark.slow
def test_train_then_export_then_adapt_on_the_held_out_subject(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "--model", "cnn", "--dataset", "synthetic", "--hold-out-subject", "7", "--steps", "30",
                 "--batch-size", "64", "--lr", "3e-3", "--memory-budget", "8MiB", "--offload", "disk",
                 "--checkpoint-dir", str(run), "--no-progress"]) == 0
    out = capsys.readouterr().out
    export_cmd = next(line for line in out.splitlines() if line.startswith("export it for the device: "))
    argv = export_cmd.removeprefix("export it for the device: edgeadapt ")
    factory_kwargs = argv.split("'")[1]
    parts = argv.split("'")[0].split() + [factory_kwargs] + argv.split("'")[2].split()
    assert main(parts) == 0
    assert main(["adapt", str(run / "bundle"), "--data", str(run / "held_out_adapt.npz"), "--epochs", "2",
                 "--out", str(run / "adapted"), "--no-progress", "--device", "cpu"]) == 0
    capsys.readouterr()
    assert main(["evaluate", str(run / "adapted"), "--data", str(run / "held_out_eval.npz"), "--json",
                 "--device", "cpu"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # subject 7 has 240 windows: 5 per class (6 classes) adapt, the other 210 evaluate
    from edgeadapt.datasets import WindowDataset
    from edgeadapt.runtime import Runner

    held_out = WindowDataset.load_npz(run / "held_out_eval.npz")
    assert report["n_windows"] == len(held_out.y) == 210
    logits = Runner.load(run / "adapted", device="cpu").predict(held_out.X)  # the accuracy, computed again
    assert report["accuracy"] == pytest.approx(float((logits.argmax(1) == held_out.y).mean()))


def test_a_second_run_on_a_directory_in_use_is_refused_in_one_line(tmp_path, capsys):
    """Two runs on one --checkpoint-dir would overwrite each other's disk-tier state: while one
    holds the directory (here a process holding its lock file), another refuses before any work."""
    from edgeadapt.server.train_cli import run_lock_path

    run = tmp_path / "run"
    run.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, os, sys, time\n"
         "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)\nfcntl.flock(fd, fcntl.LOCK_EX)\n"
         "print('HELD', flush=True)\ntime.sleep(120)", str(run_lock_path(run, 0))],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "HELD"
        assert _train(run, "--steps", "1", "--offload", "disk") == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "is in use by another edgeadapt train" in err, err
        assert not (run / "state").exists() and not (run / "checkpoints").exists()  # nothing touched
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()
    assert _train(run, "--steps", "1", "--offload", "disk") == 0  # the lock died with its holder
