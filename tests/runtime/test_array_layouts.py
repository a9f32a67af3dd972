"""Arrays of any memory layout give exactly the results of their contiguous copies.

ONNX Runtime reads a numpy buffer through a raw pointer; the runner must hand it a native-order,
C-contiguous array and keep that array alive while the session can read it. Every entry point is
fed the same values as transposed, sliced, Fortran-order, read-only and big-endian arrays, several
times over, and must agree bit for bit with the contiguous copy.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from helpers import make_cnn

from edgeadapt.cli import main
from edgeadapt.datasets import load_dataset
from edgeadapt.runtime import Runner

N, CHANNELS, STEPS = 256, 4, 16
REPEATS = 3


def _layouts(X: np.ndarray) -> dict[str, np.ndarray]:
    """Arrays equal to ``X`` (float32, (windows, channels, steps)) in other memory layouts."""
    transposed = np.ascontiguousarray(X.transpose(0, 2, 1)).transpose(0, 2, 1)
    wide = np.zeros((X.shape[0] * 2, X.shape[1], X.shape[2] * 3), np.float32)
    wide[::2, :, 1::3] = X
    read_only = X.copy()
    read_only.flags.writeable = False
    out = {"transposed": transposed, "sliced": wide[::2, :, 1::3], "fortran": np.asfortranarray(X),
           "read-only": read_only, "big-endian": X.astype(">f4")}
    for v in out.values():
        assert np.array_equal(v, X)
    assert not out["transposed"].flags.c_contiguous and not out["sliced"].flags.c_contiguous
    assert out["big-endian"].dtype.byteorder == ">"
    return out


def _labels_sliced(y: np.ndarray) -> np.ndarray:
    wide = np.zeros(2 * len(y), np.int64)
    wide[1::2] = y
    return wide[1::2]


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(1)
    X = (3 * rng.standard_normal((N, CHANNELS, STEPS))).astype(np.float32)
    y = rng.integers(0, 3, N).astype(np.int64)
    return X, y


@pytest.fixture(scope="module")
def batch_bundle(tmp_path_factory):
    """The test CNN exported with batch-statistics BatchNorm (for the label-free statistics update)."""
    import torch

    from edgeadapt.export import Rule, UpdatePolicy, export_bundle

    out = tmp_path_factory.mktemp("bundles") / "cnn-batch"
    export_bundle(make_cnn(), torch.randn(2, CHANNELS, STEPS, generator=torch.Generator().manual_seed(0)), out,
                  policy=UpdatePolicy(rules=(Rule("head", "full"),)), batchnorm="batch")
    return out


@pytest.fixture(scope="module")
def runner(cnn_bundle):
    return Runner.load(cnn_bundle, device="cpu", threads=1)


@pytest.mark.parametrize("layout", ["transposed", "sliced", "fortran", "read-only", "big-endian"])
def test_predict_and_evaluate_match_the_contiguous_copy(runner, data, layout):
    X, y = data
    want_out, want_eval = runner.predict(X), runner.evaluate(X, y)
    for _ in range(REPEATS):
        v = _layouts(X)[layout]  # a fresh array each time: freed buffers get reused
        assert np.array_equal(runner.predict(v, batch_size=64), runner.predict(X, batch_size=64))
        assert np.array_equal(runner.predict(v), want_out)
        assert runner.evaluate(v, y) == want_eval
        assert runner.evaluate(X, _labels_sliced(y)) == want_eval
        assert runner.evaluate(v, y.astype(">i8")) == want_eval


def _adapted(bundle, X, y, **kwargs) -> dict[str, np.ndarray]:
    r = Runner.load(bundle, device="cpu", threads=1)
    r.adapt(X, y, epochs=2, batch_size=64, progress=False, **kwargs)
    return r.parameters()


def _same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("layout", ["transposed", "sliced", "fortran", "read-only", "big-endian"])
def test_adapt_matches_the_contiguous_copy(cnn_bundle, data, layout):
    X, y = data
    want = _adapted(cnn_bundle, X, y)
    for _ in range(2):
        assert _same(_adapted(cnn_bundle, _layouts(X)[layout], _labels_sliced(y)), want)
    r = Runner.load(cnn_bundle, device="cpu", threads=1)
    r.train_step(_layouts(X)[layout][:32], y[:32])
    r2 = Runner.load(cnn_bundle, device="cpu", threads=1)
    r2.train_step(X[:32], y[:32])
    assert _same(r.parameters(), r2.parameters())


@pytest.mark.parametrize("layout", ["transposed", "sliced", "fortran", "read-only", "big-endian"])
def test_batchnorm_statistics_match_the_contiguous_copy(batch_bundle, data, layout):
    X, y = data

    def statistics(X, y):
        r = Runner.load(batch_bundle, device="cpu", threads=1)
        result = r.update_bn_statistics(X, y, epochs=1, batch_size=64, progress=False)
        return r.parameters(), result.epoch_losses

    want = statistics(X, y)
    for _ in range(REPEATS):
        got = statistics(_layouts(X)[layout], _labels_sliced(y))
        assert _same(got[0], want[0]) and got[1] == want[1]


def _csv(path, rows: int = 3000) -> None:
    rng = np.random.default_rng(2)
    lines = ["subject,label," + ",".join(f"c{i}" for i in range(CHANNELS))]
    lines += [f"1,{(t // 40) % 3}," + ",".join(f"{v:.4f}" for v in 3 * rng.standard_normal(CHANNELS))
              for t in range(rows)]
    path.write_text("\n".join(lines) + "\n")


def _signal_npz(path, rows: int = 3000) -> None:
    rng = np.random.default_rng(3)
    signal = (3 * rng.standard_normal((rows, CHANNELS))).astype(np.float32)
    np.savez(path, signal=signal, y=(np.arange(rows) // 40) % 3, subject=np.ones(rows, np.int64))


@pytest.mark.parametrize("write", [_csv, _signal_npz], ids=["csv", "continuous-npz"])
def test_cli_evaluate_on_continuous_data_matches_the_contiguous_copy(cnn_bundle, tmp_path, capsys, write):
    path = tmp_path / ("data.csv" if write is _csv else "data.npz")
    write(path)
    ds = load_dataset(path, window_length_samples=STEPS)
    want = Runner.load(cnn_bundle, device="cpu").evaluate(np.array(ds.X, order="C"), ds.y)
    for _ in range(REPEATS):
        assert main(["evaluate", str(cnn_bundle), "--data", str(path), "--json", "--device", "cpu"]) == 0
        got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert (got["loss"], got["accuracy"], got["n_windows"]) == (want.loss, want.accuracy, want.n_windows)


def test_cli_adapt_on_a_csv_file_matches_the_contiguous_copy(cnn_bundle, tmp_path, capsys):
    path = tmp_path / "data.csv"
    _csv(path, rows=800)
    ds = load_dataset(path, window_length_samples=STEPS)
    bundle = tmp_path / "b"
    shutil.copytree(cnn_bundle, bundle)
    want = _adapted(bundle, np.array(ds.X, order="C"), ds.y)
    args = ["--epochs", "2", "--batch-size", "64", "--no-progress", "--device", "cpu", "--threads", "1"]
    assert main(["adapt", str(bundle), "--data", str(path), "--out", str(tmp_path / "out"), *args]) == 0
    capsys.readouterr()
    assert _same(Runner.load(tmp_path / "out", device="cpu").parameters(), want)
