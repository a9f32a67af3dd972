"""User files (.npz layouts and CSV) and load_dataset: round trips and every error names file and problem."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from edgeadapt.datasets import WindowDataset, load_csv, load_dataset, load_npz_file


def _windowed_arrays(n=6, time=5, channels=3):
    rng = np.random.default_rng(0)
    return {
        "X": rng.normal(size=(n, time, channels)),  # (windows, time, channels), float64
        "y": np.array([0, 1, 2, 0, 1, 2][:n]),
        "subject": np.array([1, 1, 1, 2, 2, 2][:n]),
    }


def _continuous_arrays():
    n = 40
    return {
        "signal": np.stack([np.arange(n), 100 + np.arange(n)], axis=1).astype(np.float32),
        "y": (np.arange(n) // 10) % 2,
        "subject": np.repeat([3, 8], n // 2),
        "session": np.repeat([0, 1, 0, 1], n // 4),
    }


def test_windowed_npz_is_transposed_to_channels_first(tmp_path):
    arrays = _windowed_arrays()
    np.savez(tmp_path / "w.npz", **arrays, session=np.array([0, 0, 1, 1, 0, 1]))
    ds = load_npz_file(tmp_path / "w.npz", sample_rate_hz=250)
    assert ds.X.shape == (6, 3, 5) and ds.X.dtype == np.float32
    np.testing.assert_allclose(ds.X, arrays["X"].transpose(0, 2, 1).astype(np.float32))
    assert ds.y.tolist() == [0, 1, 2, 0, 1, 2] and ds.subject.tolist() == [1, 1, 1, 2, 2, 2]
    assert ds.session.tolist() == [0, 0, 1, 1, 0, 1]
    assert ds.class_names == ("0", "1", "2") and ds.channel_names == ("ch0", "ch1", "ch2")
    assert ds.sample_rate_hz == 250.0 and ds.recording is None


def test_windowed_npz_metadata_from_file_and_overrides(tmp_path):
    np.savez(tmp_path / "w.npz", **_windowed_arrays(), sample_rate_hz=50.0, class_names=np.array(["a", "b", "c"]),
             channel_names=np.array(["x", "y", "z"]))
    ds = load_npz_file(tmp_path / "w.npz")
    assert (ds.sample_rate_hz, ds.class_names, ds.channel_names) == (50.0, ("a", "b", "c"), ("x", "y", "z"))
    ds = load_npz_file(tmp_path / "w.npz", sample_rate_hz=25.0, class_names=["p", "q", "r", "s"])
    assert ds.sample_rate_hz == 25.0 and ds.n_classes == 4


def test_continuous_npz_and_csv_give_the_same_windows(tmp_path):
    arrays = _continuous_arrays()
    np.savez(tmp_path / "c.npz", **arrays)
    from_npz = load_npz_file(tmp_path / "c.npz", sample_rate_hz=10, window_length_samples=6, overlap_fraction=0.5)
    lines = ["subject,session,label,emg_a,emg_b"] + [
        f"{s},{q},{y},{a},{b}"
        for s, q, y, (a, b) in zip(arrays["subject"], arrays["session"], arrays["y"], arrays["signal"])
    ]
    (tmp_path / "c.csv").write_text("\n".join(lines) + "\n")
    from_csv = load_csv(tmp_path / "c.csv", sample_rate_hz=10, window_length_samples=6, overlap_fraction=0.5)
    # 4 runs of 10 samples, hop 3: windows at 0, 3 of every run.
    assert from_npz.start_sample.tolist() == [0, 3, 10, 13, 20, 23, 30, 33]
    for name in ("X", "y", "subject", "session", "recording", "start_sample"):
        np.testing.assert_array_equal(getattr(from_csv, name), getattr(from_npz, name))
    assert from_csv.channel_names == ("emg_a", "emg_b")
    np.testing.assert_array_equal(from_npz.X[2], arrays["signal"][10:16].T)


def test_csv_class_ids_written_as_floats_are_class_ids(tmp_path):
    rows = ["subject,label,c0"] + [f"1,{'1.0' if i < 6 else '2.0'},{i}" for i in range(12)]
    (tmp_path / "f.csv").write_text("\n".join(rows) + "\n")
    ds = load_csv(tmp_path / "f.csv", sample_rate_hz=1, window_length_samples=4, overlap_fraction=0.0)
    as_ints = load_csv(_ints(tmp_path, rows), sample_rate_hz=1, window_length_samples=4, overlap_fraction=0.0)
    assert ds.y.tolist() == as_ints.y.tolist() and set(ds.y.tolist()) == {1, 2}
    assert ds.class_names == as_ints.class_names
    (tmp_path / "h.csv").write_text("\n".join(r.replace(",2.0,", ",2.5,") for r in rows) + "\n")
    with pytest.raises(ValueError, match=r"labels \['2.5'\] are numbers but not whole class ids"):
        load_csv(tmp_path / "h.csv", sample_rate_hz=1, window_length_samples=4, overlap_fraction=0.0)


def _ints(tmp_path, rows: list[str]):
    path = tmp_path / "i.csv"
    path.write_text("\n".join(r.replace(".0,", ",") for r in rows) + "\n")
    return path


def test_csv_with_class_names_and_without_session(tmp_path):
    rows = ["subject,label,c0"] + [f"1,{'open' if i < 6 else 'close'},{i}" for i in range(12)]
    path = tmp_path / "named.csv"
    path.write_text("\n".join(rows) + "\n\n")  # a trailing blank line is fine
    ds = load_csv(path, sample_rate_hz=1, window_length_samples=4, overlap_fraction=0.0)
    assert ds.class_names == ("close", "open")  # alphabetical when not given
    assert ds.y.tolist() == [1, 0, 0] and ds.session is None
    ds = load_csv(path, sample_rate_hz=1, window_length_samples=4, overlap_fraction=0.0, class_names=["open", "close"],
                  label_rule="last")
    assert ds.y.tolist() == [0, 1, 1]


def test_saved_dataset_loads_through_every_entry_point(tmp_path, small_dataset):
    path = small_dataset.save_npz(tmp_path / "saved.npz")
    for loaded in (load_npz_file(path), load_dataset(path), load_dataset(str(path))):
        np.testing.assert_array_equal(loaded.X, small_dataset.X)
        np.testing.assert_array_equal(loaded.session, small_dataset.session)
    with pytest.raises(ValueError, match=r"saved.npz: a saved WindowDataset carries its own metadata.*sample_rate_hz"):
        load_npz_file(path, sample_rate_hz=10)
    with pytest.raises(ValueError, match=r"saved.npz: subjects with fewer than min_windows_per_subject=5"):
        load_npz_file(path, min_windows_per_subject=5)


def test_load_dataset_dispatch(tmp_path):
    ds = load_dataset("synthetic", n_subjects=2, windows_per_subject=12, n_time_steps=32, seed=5)
    assert isinstance(ds, WindowDataset) and ds.X.shape == (24, 8, 32)
    csv_path = tmp_path / "d.CSV"
    csv_path.write_text("subject,label,c0\n" + "".join(f"1,0,{i}\n" for i in range(8)))
    assert len(load_dataset(csv_path, sample_rate_hz=1, window_length_samples=4)) == 3
    with pytest.raises(ValueError, match=r"unknown dataset 'emg\.txt': use 'synthetic', 'watch', or a \.npz or \.csv"):
        load_dataset("emg.txt")
    with pytest.raises(FileNotFoundError, match=r"missing.npz: no such file"):
        load_dataset(tmp_path / "missing.npz")
    with pytest.raises(TypeError, match="unexpected keyword argument 'n_subject'"):
        load_dataset("synthetic", n_subject=3)


def test_channels_first_looking_x_warns(tmp_path, caplog):
    arrays = _windowed_arrays(time=3, channels=16)
    np.savez(tmp_path / "w.npz", **arrays, extra=np.zeros(1))
    with caplog.at_level(logging.WARNING):
        load_npz_file(tmp_path / "w.npz", sample_rate_hz=1)
    assert "X.transpose(0, 2, 1)" in caplog.text
    assert "ignoring unknown keys ['extra']" in caplog.text


# --- Errors ------------------------------------------------------------------------------------

_NPZ_ERRORS = [
    ("missing y", lambda a: a.pop("y"), {}, r"missing key 'y' .*edgeadapt adapt --unlabeled"),
    ("no data", lambda a: a.pop("X"), {}, r"expected either 'X' \(windows, time, channels\) or 'signal'"),
    ("both layouts", lambda a: a.update(signal=np.zeros((4, 2))), {}, "expected either 'X'"),
    ("2-D X", lambda a: a.update(X=np.zeros((6, 5))), {}, r"'X' must be 3-D \(windows, time, channels\).*'signal'"),
    ("y length", lambda a: a.update(y=np.zeros(5, np.int64)), {}, r"'y' must have shape \(6,\) \(one per window\)"),
    ("subject length", lambda a: a.update(subject=np.ones(7, np.int64)), {}, r"'subject' must have shape \(6,\)"),
    ("session length", lambda a: a.update(session=np.ones(2, np.int64)), {}, r"'session' must have shape \(6,\)"),
    ("float y", lambda a: a.update(y=np.zeros(6)), {}, "'y' must hold integers, got dtype float64"),
    ("negative y", lambda a: a.update(y=np.full(6, -2)), {}, "labels must be class ids >= 0, found -2"),
    ("unnamed class", lambda a: a.update(class_names=np.array(["a", "b"])), {}, "label 2 has no name"),
    ("NaN", lambda a: a["X"].__setitem__((2, 1, 0), np.nan), {},
     r"NaN/inf values \(first at window 2, channel 0, step 1\)"),
    ("text X", lambda a: a.update(X=np.full((6, 5, 3), "x")), {}, "'X' must hold real numbers"),
    ("no windows", lambda a: a.update(X=np.zeros((0, 5, 3)), y=np.zeros(0, np.int64), subject=np.zeros(0, np.int64)),
     {}, "'X' holds no windows"),
    ("window length", lambda a: None, {"window_length_samples": 4}, "windowed already"),
    ("channel names", lambda a: None, {"channel_names": ["a"]}, "channel_names has 1 names but X has 3 channels"),
]


@pytest.mark.parametrize("edit, kwargs, match", [e[1:] for e in _NPZ_ERRORS], ids=[e[0] for e in _NPZ_ERRORS])
def test_windowed_npz_errors_name_file_and_problem(tmp_path, edit, kwargs, match):
    arrays = _windowed_arrays()
    edit(arrays)
    path = tmp_path / "bad_windows.npz"
    np.savez(path, **arrays)
    with pytest.raises(ValueError, match=r"bad_windows\.npz: .*" + match) as raised:
        load_npz_file(path, **({"sample_rate_hz": 1.0} | kwargs))
    assert str(raised.value).count("bad_windows.npz") == 1


_CONTINUOUS_ERRORS = [
    ("no window length", lambda a: None, {"window_length_samples": None}, "needs window_length_samples="),
    ("3-D signal", lambda a: a.update(signal=np.zeros((40, 2, 1))), {}, r"'signal' must be 2-D \(time, channels\)"),
    ("y per window", lambda a: a.update(y=np.zeros(4, np.int64)), {},
     r"'y' must have shape \(40,\) \(one per sample\)"),
    ("float subject", lambda a: a.update(subject=np.zeros(40)), {}, "'subject' must hold integers"),
    ("NaN", lambda a: a["signal"].__setitem__((17, 1), np.inf), {}, r"NaN/inf values \(first at sample 17\)"),
    ("empty", lambda a: a.update(signal=np.zeros((0, 2)), y=np.zeros(0, np.int64), subject=np.zeros(0, np.int64),
                                 session=np.zeros(0, np.int64)), {}, "'signal' holds no samples"),
    ("short subject", lambda a: a.update(subject=np.array([3] * 37 + [9] * 3), session=np.zeros(40, np.int64)), {},
     r"subjects with fewer than min_windows_per_subject=1 windows \(subject: windows\) \{9: 0\}"),
    ("few windows", lambda a: None, {"min_windows_per_subject": 5},
     r"fewer than min_windows_per_subject=5 windows \(subject: windows\) \{3: 4, 8: 4\}"),
    ("overlap", lambda a: None, {"overlap_fraction": 1.0}, r"overlap_fraction must be in \[0, 1\)"),
    ("label rule", lambda a: None, {"label_rule": "mode"}, "'mode' is not a valid LabelRule"),
]


@pytest.mark.parametrize(
    "edit, kwargs, match", [e[1:] for e in _CONTINUOUS_ERRORS], ids=[e[0] for e in _CONTINUOUS_ERRORS]
)
def test_continuous_npz_errors_name_file_and_problem(tmp_path, edit, kwargs, match):
    arrays = _continuous_arrays()
    edit(arrays)
    path = tmp_path / "bad_signal.npz"
    np.savez(path, **arrays)
    with pytest.raises(ValueError, match=r"bad_signal\.npz: .*" + match) as raised:
        load_npz_file(path, **({"sample_rate_hz": 1.0, "window_length_samples": 6} | kwargs))
    assert str(raised.value).count("bad_signal.npz") == 1


_GOOD_CSV = "subject,label,a,b\n" + "".join(f"{1 + i // 8},{i % 2},{i},{-i}\n" for i in range(16))

_CSV_ERRORS = [
    ("empty file", "", {}, r"the header must be '\[subject,\]\[session,\]\[label,\]<channel>,...'"),
    ("no label", "subject,a\n1,2\n", {}, r"no 'label' column .*edgeadapt adapt --unlabeled"),
    ("no channel", "subject,label\n1,0\n", {}, "at least one channel"),
    ("wrong order", "label,subject,a\n0,1,2\n", {}, r"got \['label', 'subject', 'a'\]"),
    ("no rows", "subject,label,a\n\n", {}, "no data rows below the header"),
    ("field count", _GOOD_CSV.replace("3,-3\n", "3\n"), {}, "line 5: 3 fields, the header has 4"),
    ("text cell", _GOOD_CSV.replace(",5,-5\n", ",5,oops\n"), {}, r"line 7, column 'b': 'oops' is not float"),
    ("empty cell", _GOOD_CSV.replace(",5,-5\n", ",,-5\n"), {}, r"line 7, column 'a': '' is not float"),
    ("float subject", _GOOD_CSV.replace("2,1,9,-9", "2.0,1,9,-9"), {}, r"line 11, column 'subject': '2.0' is not int"),
    ("NaN cell", _GOOD_CSV.replace(",5,-5\n", ",nan,-5\n"), {}, "line 7: NaN/inf in a channel"),
    ("unknown name", _GOOD_CSV.replace("1,0,2,-2", "1,zero,2,-2"), {"class_names": ["0", "1"]},
     r"labels \['zero'\] are not in class_names \['0', '1'\]"),
    ("label out of names", _GOOD_CSV, {"class_names": ["only"]}, "label 1 has no name"),
    ("short subject", _GOOD_CSV + "3,0,1,1\n", {}, r"\{3: 0\}"),
]


@pytest.mark.parametrize("text, kwargs, match", [e[1:] for e in _CSV_ERRORS], ids=[e[0] for e in _CSV_ERRORS])
def test_csv_errors_name_file_line_and_problem(tmp_path, text, kwargs, match):
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(ValueError, match=r"bad\.csv.*" + match) as raised:
        load_csv(path, sample_rate_hz=1.0, window_length_samples=4, **kwargs)
    assert str(raised.value).count("bad.csv") == 1


def test_good_csv_fixture_loads(tmp_path):
    path = tmp_path / "good.csv"
    path.write_text(_GOOD_CSV)
    ds = load_csv(path, sample_rate_hz=1.0, window_length_samples=4)
    assert ds.subjects.tolist() == [1, 2] and len(ds) == 6


def test_csv_encoding(tmp_path):
    with_bom = tmp_path / "excel.csv"
    with_bom.write_bytes(b"\xef\xbb\xbf" + _GOOD_CSV.encode())  # spreadsheet exports start with a BOM
    assert len(load_csv(with_bom, sample_rate_hz=1.0, window_length_samples=4)) == 6
    latin1 = tmp_path / "latin1.csv"
    latin1.write_bytes("subject,label,\u00e9\n1,0,1\n".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1.csv: not UTF-8 text"):
        load_csv(latin1, sample_rate_hz=1.0, window_length_samples=4)


def test_unreadable_npz_is_named(tmp_path):
    path = tmp_path / "broken.npz"
    path.write_bytes(b"PK\x03\x04 truncated")
    with pytest.raises(ValueError, match=r"broken.npz: not a readable .npz file"):
        load_dataset(path)
    with pytest.raises(FileNotFoundError, match="absent.npz"):
        load_npz_file(tmp_path / "absent.npz")


def test_subject_is_optional_and_labels_are_with_require_labels_false(tmp_path):
    arrays = _windowed_arrays()
    one_person = {k: v for k, v in arrays.items() if k != "subject"}
    np.savez(tmp_path / "one.npz", **one_person)
    ds = load_npz_file(tmp_path / "one.npz")
    np.testing.assert_array_equal(ds.subject, 0)
    np.testing.assert_array_equal(ds.y, arrays["y"])
    unlabeled = {k: v for k, v in one_person.items() if k != "y"}
    np.savez(tmp_path / "unlabeled.npz", **unlabeled)
    with pytest.raises(ValueError, match="missing key 'y'"):
        load_npz_file(tmp_path / "unlabeled.npz")
    ds = load_npz_file(tmp_path / "unlabeled.npz", require_labels=False)
    np.testing.assert_array_equal(ds.X, arrays["X"].transpose(0, 2, 1).astype(np.float32))
    np.testing.assert_array_equal(ds.y, 0)
    # a CSV of bare channels: one subject, no labels
    rows = "".join(f"{i},{-i}\n" for i in range(16))
    (tmp_path / "bare.csv").write_text("a,b\n" + rows)
    ds = load_csv(tmp_path / "bare.csv", window_length_samples=4, overlap_fraction=0.0, require_labels=False)
    assert ds.X.shape == (4, 2, 4) and ds.channel_names == ("a", "b")
    np.testing.assert_array_equal(ds.X[1, 0], [4, 5, 6, 7])
    np.testing.assert_array_equal(ds.subject, 0)
    with pytest.raises(ValueError, match="no 'label' column"):
        load_csv(tmp_path / "bare.csv", window_length_samples=4)
    # a label column without a subject one
    (tmp_path / "label.csv").write_text("label,a,b\n" + "".join(f"{i // 8},{i},{-i}\n" for i in range(16)))
    ds = load_csv(tmp_path / "label.csv", window_length_samples=8, overlap_fraction=0.0)
    np.testing.assert_array_equal(ds.y, [0, 1])


def test_a_metadata_name_among_the_channels_is_refused(tmp_path):
    (tmp_path / "w.csv").write_text("label,subject,a\n0,1,2\n")
    with pytest.raises(ValueError, match=r"got \['label', 'subject', 'a'\]"):
        load_csv(tmp_path / "w.csv", window_length_samples=1)
