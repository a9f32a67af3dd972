"""``adapt --out`` refuses a target it cannot write before any training: an existing file, a folder
that is not a bundle, or a bundle of other graphs."""

from __future__ import annotations

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


@pytest.mark.parametrize("target", ["file", "folder", "other bundle"])
def test_adapt_refuses_an_unwritable_target_before_training(cnn_bundle, other_bundle, tmp_path, capsys, monkeypatch,
                                                             target):
    out = {"file": _file, "folder": _folder, "other bundle": lambda _: other_bundle}[target](tmp_path)
    before = sorted((p.name, p.read_bytes()) for p in ([out] if out.is_file() else out.iterdir()))
    X, y = make_data(np.random.default_rng(0), n=12)
    np.savez(tmp_path / "d.npz", X=X.transpose(0, 2, 1), y=y, subject=np.ones(12, np.int64))
    trained = []
    monkeypatch.setattr(Runner, "adapt", lambda *a, **k: trained.append(1))
    code = main(["adapt", str(cnn_bundle), "--data", str(tmp_path / "d.npz"), "--out", str(out), "--no-progress",
                 "--device", "cpu"])
    err = capsys.readouterr().err
    assert code == 2 and not trained, err
    assert err.startswith(f"error: {out} exists and is not a") and err.count("\n") == 1
    assert sorted((p.name, p.read_bytes()) for p in ([out] if out.is_file() else out.iterdir())) == before
