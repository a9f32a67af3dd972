"""``adapt --out`` refuses a target it cannot write before any training: an existing file, a folder
that is not a bundle, a bundle of other graphs, a new directory under a file or in a folder that
is not writable."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
from helpers import make_data

from edgeadapt.cli import main
from edgeadapt.runtime import Runner


@pytest.fixture
def other_bundle(cnn_bundle, tmp_path):
    """A bundle of other graphs: the same files with another eval model checksum in its manifest."""
    import json

    dst = tmp_path / "other"
    shutil.copytree(cnn_bundle, dst)
    m = json.loads((dst / "manifest.json").read_text())
    m["sha256"][m["files"]["eval_model"]] = "0" * 64
    (dst / "manifest.json").write_text(json.dumps(m))
    return dst


def _file(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    return tmp_path / "notes.txt"


def _folder(tmp_path):
    (tmp_path / "photos").mkdir()
    (tmp_path / "photos" / "a.jpg").write_bytes(b"x")
    return tmp_path / "photos"


def _adapt_refused(bundle, out, tmp_path, capsys, monkeypatch) -> str:
    """Run ``edgeadapt adapt --out out`` with training stubbed out; assert it exits 2 without
    training and return its stderr."""
    X, y = make_data(np.random.default_rng(0), n=12)
    np.savez(tmp_path / "d.npz", X=X.transpose(0, 2, 1), y=y, subject=np.ones(12, np.int64))
    trained = []
    monkeypatch.setattr(Runner, "adapt", lambda *a, **k: trained.append(1))
    code = main(["adapt", str(bundle), "--data", str(tmp_path / "d.npz"), "--out", str(out), "--no-progress",
                 "--device", "cpu"])
    err = capsys.readouterr().err
    assert code == 2 and not trained, err
    return err


@pytest.mark.parametrize("target", ["file", "folder", "other bundle"])
def test_adapt_refuses_an_unwritable_target_before_training(cnn_bundle, other_bundle, tmp_path, capsys, monkeypatch,
                                                             target):
    out = {"file": _file, "folder": _folder, "other bundle": lambda _: other_bundle}[target](tmp_path)
    before = sorted((p.name, p.read_bytes()) for p in ([out] if out.is_file() else out.iterdir()))
    err = _adapt_refused(cnn_bundle, out, tmp_path, capsys, monkeypatch)
    assert err.startswith(f"error: {out} exists and is not a") and err.count("\n") == 1
    assert sorted((p.name, p.read_bytes()) for p in ([out] if out.is_file() else out.iterdir())) == before


def test_adapt_refuses_an_out_under_a_file_before_training(cnn_bundle, tmp_path, capsys, monkeypatch):
    notes = _file(tmp_path)
    out = notes / "runs" / "adapted"  # its folders cannot be made: notes.txt is a file
    err = _adapt_refused(cnn_bundle, out, tmp_path, capsys, monkeypatch)
    assert err == (f"error: cannot create {out}: {notes} exists and is not a directory; "
                   "choose an output directory elsewhere\n")
    assert notes.read_text() == "mine"


def test_save_target_must_be_writable(cnn_bundle, tmp_path, monkeypatch):
    bundle = tmp_path / "bundle"
    shutil.copytree(cnn_bundle, bundle)
    runner = Runner.load(bundle, device="cpu")
    locked, real = {os.fspath(tmp_path), os.fspath(bundle)}, os.access
    # as if this user could not write in tmp_path and the bundle (a real chmod does not stop root)
    monkeypatch.setattr(os, "access", lambda path, mode: os.fspath(path) not in locked and real(path, mode))
    with pytest.raises(PermissionError, match=f"cannot write {tmp_path}/new/adapted: {tmp_path} is not writable"):
        runner.check_save_target(tmp_path / "new" / "adapted")
    with pytest.raises(PermissionError, match=f"cannot write {bundle}: {bundle} is not writable"):
        runner.save()  # in place
    assert runner.check_save_target(tmp_path.parent / "elsewhere") == tmp_path.parent / "elsewhere"
