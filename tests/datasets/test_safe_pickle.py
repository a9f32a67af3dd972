"""The restricted unpickler: numpy object arrays load, every other global is refused unrun."""

from __future__ import annotations

import io
import os
import pickle

import numpy as np
import pytest

from edgeadapt.datasets import NumpyOnlyUnpickler, load_object_npy

# A hand-written protocol-0 pickle of `os.system("touch <file>")`: GLOBAL, MARK, string, TUPLE, REDUCE.
_OS_SYSTEM_PICKLE = b"cos\nsystem\n(S'touch %s'\ntR."


def _write_object_npy(path, payload: bytes) -> None:
    """An .npy file with an object-array header followed by an arbitrary pickle payload."""
    with open(path, "wb") as f:
        np.lib.format.write_array_header_1_0(f, {"descr": "|O", "fortran_order": False, "shape": ()})
        f.write(payload)


@pytest.fixture
def os_system_calls(monkeypatch):
    """Replace os.system by a recorder, so that even a broken unpickler cannot run a command."""
    calls = []
    monkeypatch.setattr(os, "system", lambda command: calls.append(command) or 0)
    return calls


def test_refuses_os_system_without_calling_it(tmp_path, os_system_calls):
    sentinel = tmp_path / "sentinel"
    payload = _OS_SYSTEM_PICKLE % str(sentinel).encode()
    # Prove the payload is what it claims to be: the ordinary unpickler resolves and calls os.system
    # (here the recorder).
    pickle.loads(payload)
    assert os_system_calls == [f"touch {sentinel}"]
    os_system_calls.clear()

    with pytest.raises(pickle.UnpicklingError, match=r"refused global os\.system"):
        NumpyOnlyUnpickler(io.BytesIO(payload)).load()
    path = tmp_path / "evil.npy"
    _write_object_npy(path, payload)
    with pytest.raises(pickle.UnpicklingError, match=r"refused global os\.system"):
        load_object_npy(path)
    assert os_system_calls == []
    assert not sentinel.exists()


@pytest.mark.parametrize(
    "module, name",
    [("builtins", "eval"), ("posix", "system"), ("subprocess", "Popen"), ("numpy", "load"), ("builtins", "getattr")],
)
def test_refuses_any_other_global(module, name):
    payload = f"c{module}\n{name}\n.".encode()
    with pytest.raises(pickle.UnpicklingError, match=rf"refused global {module}\.{name}"):
        NumpyOnlyUnpickler(io.BytesIO(payload)).load()


def test_codecs_encode_is_admitted_only_for_latin1():
    ok = b"c_codecs\nencode\n(X\x02\x00\x00\x00abX\x06\x00\x00\x00latin1tR."
    assert NumpyOnlyUnpickler(io.BytesIO(ok)).load() == b"ab"
    rot13 = b"c_codecs\nencode\n(X\x02\x00\x00\x00abX\x05\x00\x00\x00rot13tR."
    with pytest.raises(pickle.UnpicklingError, match=r"_codecs.encode\(str, 'rot13'\)"):
        NumpyOnlyUnpickler(io.BytesIO(rot13)).load()


@pytest.mark.parametrize("protocol", [2, 3])
def test_loads_numpy_object_arrays(tmp_path, protocol):
    value = {
        "X": [np.arange(6.0).reshape(3, 2), np.ones((2, 2), np.float32)],
        "y": np.array([3, 4], dtype=np.int64),
        "names": ["a", "b"],
        "scale": np.float64(2.5),
    }
    array = np.empty((), dtype=object)
    array[()] = value
    path = tmp_path / "ok.npy"
    _write_object_npy(path, pickle.dumps(array, protocol=protocol))  # protocol 2 rebuilds bytes via _codecs
    loaded = load_object_npy(path)
    assert sorted(loaded) == ["X", "names", "scale", "y"]
    for got, want in zip(loaded["X"], value["X"]):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(loaded["y"], value["y"])
    assert loaded["names"] == ["a", "b"] and loaded["scale"] == 2.5


def test_np_save_output_loads(tmp_path):
    path = tmp_path / "saved.npy"
    np.save(path, np.array([{"a": 1}, [2, 3]], dtype=object), allow_pickle=True)
    loaded = load_object_npy(path)
    assert loaded.shape == (2,) and loaded[0] == {"a": 1} and loaded[1] == [2, 3]


def test_rejects_files_that_are_not_object_npy(tmp_path):
    numeric = tmp_path / "numbers.npy"
    np.save(numeric, np.zeros(3))
    with pytest.raises(ValueError, match=r"numbers.npy: expected a pickled object array, found dtype float64"):
        load_object_npy(numeric)
    text = tmp_path / "text.npy"
    text.write_text("hello")
    with pytest.raises(ValueError, match=r"text.npy: not an .npy file"):
        load_object_npy(text)
