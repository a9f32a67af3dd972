"""Every class of bad input fails with a clear error before any work, on the command line and
from Python; CSV files and minimal ``.npz`` files (X, y, subject only) work from the CLI."""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import onnx
import pytest

from edgeadapt.bundle import MANIFEST_DIGEST_KEY, BundleError, manifest_digest, sha256_file
from edgeadapt.cli import main
from edgeadapt.datasets import load_dataset
from edgeadapt.runtime import InputError, Runner

N_CHANNELS, TIME_STEPS, N_CLASSES = 4, 16, 3


@pytest.fixture
def bundle(cnn_bundle, tmp_path):
    dst = tmp_path / "bundle"
    shutil.copytree(cnn_bundle, dst)
    return dst


def _windows(n=12, time=TIME_STEPS, channels=N_CHANNELS):
    rng = np.random.default_rng(0)
    return {"X": rng.standard_normal((n, time, channels)).astype(np.float32),  # (windows, time, channels)
            "y": (np.arange(n) % N_CLASSES).astype(np.int64), "subject": np.repeat([1, 2], n // 2)}


# ---- data files: (name, how to write the file, expected message fragment) -----------------------
def _npz(edit):
    def write(path):
        arrays = _windows()
        edit(arrays)
        np.savez(path, **arrays)
        return path
    return write


def _raw(content: bytes):
    def write(path):
        path.write_bytes(content)
        return path
    return write


def _directory(path):
    path.mkdir()
    return path


DATA_CASES = [
    ("shape", _npz(lambda a: a.update(X=np.zeros((12, TIME_STEPS, 5), np.float32))),
     r"\(X\) has shape \[12, 5, 16\], the bundle expects \['batch', 4, 16\] \(batch, 4 channels, 16 time steps\)"),
    ("channels-first", _npz(lambda a: a.update(X=a["X"].transpose(0, 2, 1))),
     r"\(X\) has shape \[12, 16, 4\], the bundle expects \['batch', 4, 16\] \(batch, 4 channels, 16 time steps\); "
     r"its last two axes are swapped: transpose them"),
    ("NaN", _npz(lambda a: a["X"].__setitem__((3, 2, 1), np.nan)), "NaN/inf values"),
    ("empty", _npz(lambda a: a.update(X=np.zeros((0, TIME_STEPS, N_CHANNELS)), y=np.zeros(0, np.int64),
                                      subject=np.zeros(0, np.int64))), "'X' holds no windows"),
    ("label out of range", _npz(lambda a: a["y"].__setitem__(0, 7)),
     r"\(y\) has labels in \[0, 7\] but the model has 3"),
    ("negative label", _npz(lambda a: a["y"].__setitem__(0, -1)), "labels must be class ids >= 0"),
    ("float labels", _npz(lambda a: a.update(y=a["y"].astype(np.float64))), "'y' must hold integers"),
    ("length mismatch", _npz(lambda a: a.update(y=a["y"][:5])), r"'y' must have shape \(12,\)"),
    ("not a zip", _raw(b"\x80\x04pickle"), r"not a readable \.npz file"),
    ("directory", _directory, "is a directory"),
]


# The command line names a file's windows as the file stores them: (windows, time steps, channels).
CLI_MATCHES = {
    "shape": r"data\.npz: X has shape \[12, 16, 5\], but a \.npz file stores windows as \(windows, time steps, "
             r"channels\) and this bundle takes \(batch, 4 channels, 16 time steps\), so X must be stored as "
             r"\[12, 16, 4\]; window and transpose the data to match",
    "channels-first": r"data\.npz: X has shape \[12, 4, 16\], .* so X must be stored as \[12, 16, 4\]; it looks "
                      r"channels-first: save it transposed, np\.savez\(\.\.\., X=X\.transpose\(0, 2, 1\)\)",
}


@pytest.mark.parametrize("name, write, match", DATA_CASES, ids=[c[0] for c in DATA_CASES])
def test_bad_data_on_the_cli(bundle, tmp_path, capsys, name, write, match):
    match = CLI_MATCHES.get(name, match)
    data = write(tmp_path / "data.npz")
    out = tmp_path / "out"
    code = main(["adapt", str(bundle), "--data", str(data), "--out", str(out), "--no-progress", "--device", "cpu"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert err.startswith("error: ") and "data.npz" in err
    assert re.search(match, err), err
    assert not out.exists()  # nothing was written: the error came before any work


@pytest.mark.parametrize("write, match", [c[1:] for c in DATA_CASES], ids=[c[0] for c in DATA_CASES])
def test_bad_data_from_python(bundle, tmp_path, write, match):
    data = write(tmp_path / "data.npz")
    runner = Runner.load(bundle, device="cpu")
    with pytest.raises((ValueError, InputError), match=match.replace(r"\(X\) ", "").replace(r"\(y\) ", "")):
        ds = load_dataset(data)
        runner.adapt(ds.X, ds.y, progress=False)
    assert runner.step == 0


@pytest.mark.parametrize("X, y, match", [
    (np.zeros((4, N_CHANNELS, TIME_STEPS)), np.zeros(4, np.int64), "X has dtype float64, the bundle expects float32"),
    (np.zeros((4, N_CHANNELS, TIME_STEPS), np.float32), np.zeros(4, np.int32), "y has dtype int32"),
    (np.zeros((4, N_CHANNELS, TIME_STEPS), np.float32), np.zeros(5, np.int64), "y has 5 entries but X has 4 windows"),
    (np.zeros((4, N_CHANNELS, TIME_STEPS), np.float32), np.full(4, 0.5), "integer class indices"),
    (np.array(1.0, np.float32), np.zeros(1, np.int64), "X is a scalar"),
])
def test_bad_arrays_from_python(bundle, X, y, match):
    runner = Runner.load(bundle, device="cpu")
    with pytest.raises(InputError, match=match):
        runner.adapt(X, y, progress=False)
    assert runner.step == 0


# ---- bundles ---------------------------------------------------------------------------------
def _set_manifest(bundle, edit):
    m = json.loads((bundle / "manifest.json").read_text())
    edit(m)
    m[MANIFEST_DIGEST_KEY] = manifest_digest(m)  # as someone who recomputes the digest
    (bundle / "manifest.json").write_text(json.dumps(m))


def _edit_model(bundle, name, edit):
    model = onnx.load(bundle / name)
    edit(model)
    onnx.save(model, bundle / name)
    _set_manifest(bundle, lambda m: m["sha256"].__setitem__(name, sha256_file(bundle / name)))


def _external(model):
    t = model.graph.initializer[0]
    t.data_location = onnx.TensorProto.EXTERNAL
    t.external_data.add(key="location", value="../secret.bin")


def _custom(model):
    model.graph.node[0].domain = "custom.ops"


def _oversize(bundle):
    with open(bundle / "training_model.onnx", "ab") as f:
        f.truncate(1 << 30)  # sparse


BUNDLE_CASES = [
    ("schema version", lambda b: _set_manifest(b, lambda m: m.__setitem__("schema_version", 2)), "schema_version 2"),
    ("path outside", lambda b: _set_manifest(b, lambda m: m["files"].__setitem__("masks", "../m.npz")),
     r"files\.masks is '\.\./m\.npz', which is not a plain file name"),
    ("custom op domain", lambda b: _edit_model(b, "eval_model.onnx", _custom),
     r"eval_model\.onnx: node .* custom\.ops::"),
    ("external data", lambda b: _edit_model(b, "training_model.onnx", _external),
     r"training_model\.onnx: .*'\.\./secret\.bin'"),
    ("oversized file", _oversize, r"training_model\.onnx is 1073741824 bytes, far more than this model needs"),
    ("non-UTF-8 manifest", lambda b: (b / "manifest.json").write_bytes(b"{\"a\": \"\xff\"}"),
     r"manifest\.json is not UTF-8"),
    ("edited lr", lambda b: _set_manifest(b, lambda m: m["optimizer"].__setitem__("lr", 0.5)), "edited after export"),
]


@pytest.mark.parametrize("damage, match", [c[1:] for c in BUNDLE_CASES], ids=[c[0] for c in BUNDLE_CASES])
def test_bad_bundles_on_the_cli_and_from_python(bundle, tmp_path, capsys, damage, match):
    np.savez(tmp_path / "good.npz", **_windows())
    damage(bundle)
    out = tmp_path / "out"
    code = main(["adapt", str(bundle), "--data", str(tmp_path / "good.npz"), "--out", str(out), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and "Traceback" not in err
    assert re.search(match, err), err
    assert not out.exists()
    with pytest.raises(BundleError, match=match):
        Runner.load(bundle, device="cpu")


@pytest.mark.parametrize("args, match", [
    (["--lr", "nan"], "--lr must be a finite number > 0"), (["--lr", "-1"], "--lr must be a finite number > 0"),
    (["--lr", "inf"], "--lr must be a finite number > 0"),
    (["--epochs", "0"], "--epochs and --batch-size must be >= 1"),
    (["--sample-rate-hz", "-5"], "--sample-rate-hz must be a positive number"),
    (["--seed", "-1"], "--seed must be >= 0, got -1"), (["--threads", "-2"], "threads must be an int >= 0"),
])
def test_bad_arguments_on_the_cli(bundle, tmp_path, capsys, args, match):
    np.savez(tmp_path / "good.npz", **_windows())
    out = tmp_path / "out"
    code = main(["adapt", str(bundle), "--data", str(tmp_path / "good.npz"), "--out", str(out), "--no-progress", *args])
    captured = capsys.readouterr()
    assert code == 2 and match in captured.err and not out.exists()
    assert "adapting" not in captured.out  # refused before the adaptation started


def test_a_negative_seed_is_refused_before_the_data_is_read(bundle, tmp_path, capsys, monkeypatch):
    from edgeadapt.cli import adapt

    monkeypatch.setattr(adapt, "load_data", lambda *a, **k: pytest.fail("the data were read"))
    code = main(["adapt", str(bundle), "--data", str(tmp_path / "big.npz"), "--out", str(tmp_path / "out"),
                 "--seed", "-1"])
    assert code == 2 and capsys.readouterr().err == "error: --seed must be >= 0, got -1\n"


# ---- item 15: CSV and minimal .npz files work ------------------------------------------------------
def _csv(path, rows_per_subject=64):
    rng = np.random.default_rng(0)
    lines = ["subject,label," + ",".join(f"c{i}" for i in range(N_CHANNELS))]
    for s in (1, 2):
        for t in range(rows_per_subject):
            values = ",".join(f"{v:.4f}" for v in rng.standard_normal(N_CHANNELS))
            lines.append(f"{s},{(t // TIME_STEPS) % N_CLASSES}," + values)
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("extra", [[], ["--sample-rate-hz", "100"], ["--sample-rate-hz", "100", "--window-s", "0.16"]],
                         ids=["no rate", "rate", "window seconds"])
def test_cli_adapts_on_a_csv_file(bundle, tmp_path, capsys, extra):
    data = _csv(tmp_path / "good.csv")
    out = tmp_path / "out"
    code = main(["adapt", str(bundle), "--data", str(data), "--out", str(out), "--epochs", "1", "--no-progress",
                 "--device", "cpu", *extra])
    assert code == 0, capsys.readouterr().err
    assert Runner.load(out, device="cpu").step > 0
    assert main(["evaluate", str(out), "--data", str(data), "--json", "--device", "cpu"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["n_windows"] > 0


def test_cli_window_seconds_must_match_the_bundle(bundle, tmp_path, capsys):
    data = _csv(tmp_path / "good.csv")
    code = main(["adapt", str(bundle), "--data", str(data), "--out", str(tmp_path / "o"), "--sample-rate-hz", "100",
                 "--window-s", "1"])
    assert code == 2 and "gives 100 samples per window, the bundle takes 16" in capsys.readouterr().err


def test_cli_adapts_on_an_npz_with_only_x_y_subject(bundle, tmp_path, capsys):
    np.savez(tmp_path / "minimal.npz", **_windows())
    out = tmp_path / "out"
    code = main(["adapt", str(bundle), "--data", str(tmp_path / "minimal.npz"), "--out", str(out), "--epochs", "1",
                 "--no-progress", "--device", "cpu"])
    assert code == 0, capsys.readouterr().err
    assert Runner.load(out, device="cpu").step > 0


@pytest.mark.slow
def test_quickstart_on_an_npz_with_only_x_y_subject(tmp_path, capsys):
    from edgeadapt.datasets import SyntheticConfig, make_synthetic

    ds = make_synthetic(SyntheticConfig())
    np.savez(tmp_path / "minimal.npz", X=ds.X.transpose(0, 2, 1), y=ds.y, subject=ds.subject)
    code = main(["quickstart", "--dataset", str(tmp_path / "minimal.npz"), "--small", "--out", str(tmp_path / "qs")])
    assert code == 0, capsys.readouterr().err
    assert (tmp_path / "qs" / "report.json").is_file()
