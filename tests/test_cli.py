"""The command line: help everywhere, and export -> inspect -> adapt -> evaluate ->
export-inference end to end, the device-side commands in a process where torch cannot load."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import onnxruntime as ort
import pytest
import torch
from helpers import run_python

from edgeadapt.cli import build_parser, main
from edgeadapt.datasets import WindowDataset

SUBCOMMANDS = ("export", "inspect", "adapt", "evaluate", "export-inference", "quickstart", "train", "plan")


def cli(*args: str, block_torch: bool = False):
    return run_python(f"import sys\nfrom edgeadapt.cli import main\nsys.exit(main({list(args)!r}))",
                      block_torch=block_torch)


@pytest.mark.parametrize("command", ("", *SUBCOMMANDS))
def test_help(command):
    args = [command, "--help"] if command else ["--help"]
    proc = subprocess.run([sys.executable, "-m", "edgeadapt", *args], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "usage: edgeadapt" in proc.stdout


def test_parser_knows_every_subcommand():
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    assert set(sub.choices) == set(SUBCOMMANDS)


def _user_npz(path, rng, n=24):
    """A user's file in the documented layout: X as (windows, time steps, channels)."""
    X = rng.standard_normal((n, 64, 4)).astype(np.float32)
    y = np.arange(n) % 3
    np.savez(path, X=X, y=y, subject=np.zeros(n, dtype=np.int64), sample_rate_hz=50.0)
    return X.transpose(0, 2, 1), y


def test_end_to_end(tmp_path, rng):
    factory_kwargs = json.dumps({"name": "cnn", "n_channels": 4, "n_classes": 3, "n_time_steps": 64})
    from edgeadapt.models import build_model

    weights = tmp_path / "weights.pt"
    torch.save(build_model("cnn", 4, 3, 64).state_dict(), weights)
    bundle = tmp_path / "bundle"
    proc = cli("export", "edgeadapt.models:build_model", "--factory-kwargs", factory_kwargs,
               "--input-shape", "4,64", "--weights", str(weights), "--out", str(bundle),
               "--policy", "head=full,blocks.3.conv=channels:0.25")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "parameter elements train" in proc.stdout

    proc = cli("inspect", str(bundle), "--json", block_torch=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    assert summary["checksums"] == "ok"
    trained = {p["name"] for p in summary["parameters"] if p["trainable_numel"]}
    assert trained == {"head.weight", "head.bias", "blocks.3.conv.weight"}
    assert summary["optimizer_state_bytes"] == 2 * summary["trainable_bytes"]
    human = cli("inspect", str(bundle), block_torch=True)
    assert "trains" in human.stdout and "sha256" in human.stdout

    X, y = _user_npz(tmp_path / "new_subject.npz", rng)
    adapted = tmp_path / "adapted"
    proc = cli("adapt", str(bundle), "--data", str(tmp_path / "new_subject.npz"), "--epochs", "2",
               "--batch-size", "8", "--device", "auto", "--out", str(adapted), "--no-progress", block_torch=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "done: 6 steps" in proc.stdout

    proc = cli("evaluate", str(adapted), "--data", str(tmp_path / "new_subject.npz"), "--json", block_torch=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["n_windows"] == 24  # its accuracy is checked against the exported model's below

    proc = cli("export-inference", str(adapted), str(tmp_path / "model.onnx"), block_torch=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    logits = ort.InferenceSession(str(tmp_path / "model.onnx")).run(None, {"input": X})[0]
    assert float((logits.argmax(1) == y).mean()) == pytest.approx(result["accuracy"])


def test_errors_are_one_clear_line(tmp_path, cnn_bundle, rng):
    proc = cli("inspect", str(tmp_path))
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: ") and "manifest.json is missing" in proc.stderr
    assert "Traceback" not in proc.stderr

    ds = WindowDataset(rng.standard_normal((6, 5, 16)).astype(np.float32), np.zeros(6, dtype=np.int64),
                       np.zeros(6, dtype=np.int64), ("a",), tuple("abcde"), 100.0)
    ds.save_npz(tmp_path / "five_channels.npz")
    proc = cli("adapt", str(cnn_bundle), "--data", str(tmp_path / "five_channels.npz"), "--out", str(tmp_path / "o"))
    assert proc.returncode == 2 and "the bundle expects ['batch', 4, 16]" in proc.stderr
    assert not (tmp_path / "o").exists()

    proc = cli("export", "no_such_module_xyz:f", "--input-shape", "4,16", "--out", str(tmp_path / "b"))
    assert proc.returncode != 0 and "no_such_module_xyz" in proc.stderr


def test_export_of_a_two_input_model_is_one_clear_line(tmp_path, capsys):
    code = main(["export", "helpers:make_two_input_model", "--input-shape", "4,16", "--out", str(tmp_path / "b"),
                 "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and err.count("\n") == 1, err
    assert err.startswith("error: TwoInputs.forward takes 2 inputs (x, offset); the exporter supports models "
                          "with one input: a float32 tensor of shape (batch, ...)")
    assert not (tmp_path / "b").exists()


def test_adapt_json_prints_the_labelled_result_alone_on_stdout(tmp_path, cnn_bundle, rng, capsys):
    X = rng.standard_normal((12, 16, 4)).astype(np.float32)
    np.savez(tmp_path / "d.npz", X=X, y=np.arange(12) % 3, subject=np.zeros(12, dtype=np.int64))
    out = tmp_path / "o"
    assert main(["adapt", str(cnn_bundle), "--data", str(tmp_path / "d.npz"), "--out", str(out), "--epochs", "2",
                 "--batch-size", "4", "--no-progress", "--json", "--device", "cpu"]) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)  # the JSON alone: the progress line went to stderr
    assert result["epochs"] == 2 and result["steps"] == 6 and len(result["epoch_losses"]) == 2
    assert result["saved_to"] == str(out) and (out / "manifest.json").is_file()
    assert "adapting on cpu: 12 windows" in captured.err


def test_adapt_with_diverging_loss_saves_last_good_state_and_exits_3(tmp_path, cnn_bundle, rng):
    X = rng.standard_normal((12, 16, 4)).astype(np.float32)
    np.savez(tmp_path / "d.npz", X=X, y=np.arange(12) % 3, subject=np.zeros(12, dtype=np.int64), sample_rate_hz=50.0)
    proc = cli("adapt", str(cnn_bundle), "--data", str(tmp_path / "d.npz"), "--out", str(tmp_path / "o"),
               "--lr", "1e38", "--epochs", "2", "--batch-size", "4", "--no-progress", block_torch=True)
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert "rolled back to step 0" in proc.stderr and "saved to" in proc.stderr
    assert json.loads((tmp_path / "o" / "manifest.json").read_text())["state"]["step"] == 0


def test_export_validates_the_update_on_labelled_subjects(tmp_path, capsys):
    """--validate-on: what trains under the budget is chosen on the data file's subjects."""
    from edgeadapt.datasets import SyntheticConfig, make_synthetic

    ds = make_synthetic(SyntheticConfig(n_subjects=3, windows_per_subject=40, n_time_steps=64))
    data = tmp_path / "source.npz"
    np.savez(data, X=ds.X.transpose(0, 2, 1), y=ds.y, subject=ds.subject)  # files hold (windows, time, channels)
    c = ds.X.shape[1]
    factory_kwargs = json.dumps({"name": "cnn", "n_channels": c, "n_classes": int(ds.n_classes), "n_time_steps": 64})
    args = ["export", "edgeadapt.models:build_model", "--factory-kwargs", factory_kwargs, "--input-shape", f"{c},64",
            "--memory-budget", "3MiB", "--n-windows", "16", "--batch-windows", "8", "--no-progress",
            "--validate-on", str(data), "--validate-subjects", "1", "--validate-k-per-class", "2",
            "--validate-epochs", "1", "--validate-pretrain-epochs", "1"]
    assert main([*args, "--out", str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    assert "validated on subjects" in out and "chosen " in out
    policy = json.loads(out.split("  policy: ", 1)[1].splitlines()[0])
    manifest = json.loads((tmp_path / "b" / "manifest.json").read_text())
    plan = manifest["plan"]
    assert plan["budget_bytes"] == 3 * 2 ** 20 and plan["predicted_peak_bytes"] <= 3 * 2 ** 20
    assert manifest["policy"] == policy  # the bundle trains the chosen update
    # a data file of other classes than the model's: one clear line before any work
    bad = tmp_path / "bad.npz"
    np.savez(bad, X=ds.X.transpose(0, 2, 1), y=ds.y + int(ds.n_classes), subject=ds.subject)
    assert main([*[a if a != str(data) else str(bad) for a in args], "--out", str(tmp_path / "d")]) == 2
    assert "outputs" in capsys.readouterr().err and not (tmp_path / "d").exists()
    # a policy and a validated choice exclude each other: one clear line, nothing exported
    assert main([*args, "--policy", "head=full", "--out", str(tmp_path / "c")]) == 2
    assert "--validate-on" in capsys.readouterr().err and not (tmp_path / "c").exists()
