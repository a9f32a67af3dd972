"""The manifest lists the training engines a bundle holds (``backends``) and the portable step
graphs' interfaces by role (``portable``); bundles written before that still load unchanged."""

from __future__ import annotations

import dataclasses
import hashlib
import json

import pytest

from edgeadapt.bundle import BundleError, Manifest, contract_digest, sweep_orphans

_ORT_FILES = {"training_model": "training_model.onnx", "eval_model": "eval_model.onnx",
              "optimizer_model": "optimizer_model.onnx", "checkpoint": "checkpoint"}
_PORTABLE_FILES = {"portable_train": "portable_train.onnx", "portable_eval": "portable_eval.onnx",
                   "portable_optimizer": "portable_optimizer.onnx", "portable_state": "portable_state.npz"}
_PORTABLE = {"opset": 18, "recompute": False, "graphs": {
    "portable_train": {"inputs": [["param:head.weight", "arg0_1"], ["data", "arg1_1"], ["labels", "arg2_1"],
                                  ["weights", "arg3_1"]],
                       "outputs": [["loss", "sum_1"], ["output", "addmm"], ["grad:head.weight", "mm_1"]]},
    "portable_eval": {"inputs": [["param:head.weight", "arg0_1"], ["data", "arg1_1"], ["labels", "arg2_1"]],
                      "outputs": [["loss", "mean"], ["output", "addmm"]]},
    "portable_optimizer": {"inputs": [["param:head.weight", "p0"], ["grad:head.weight", "g0"],
                                      ["exp_avg:head.weight", "m0"], ["exp_avg_sq:head.weight", "v0"],
                                      ["decay", "decay"], ["step_size", "step_size"],
                                      ["bias_correction2_sqrt", "bias_correction2_sqrt"]],
                           "outputs": [["param:head.weight", "p1"], ["exp_avg:head.weight", "m1"],
                                       ["exp_avg_sq:head.weight", "v1"]]},
}}


def _legacy() -> dict:
    """A manifest as bundles were written before they listed their backends."""
    files = {**_ORT_FILES, "masks": "masks.npz"}
    return {
        "schema_version": 1, "format": "edgeadapt.bundle", "backend": "ort-training", "files": files,
        "sha256": {n: "0" * 64 for n in files.values()},
        "input": {"name": "input", "shape": [None, 4, 16], "dtype": "float32"},
        "output": {"name": "output", "shape": [None, 3], "dtype": "float32"},
        "label": {"name": "labels", "shape": [None], "dtype": "int64", "n_classes": 3},
        "loss": "cross_entropy", "optimizer": {"name": "adamw", "lr": 1e-3}, "batchnorm": "frozen",
        "policy": {}, "parameters": [{"name": "head.weight", "shape": [3, 8], "mode": "full",
                                      "onnx_names": {"value": "head.weight"}, "trainable_numel": 24}],
        "versions": {}, "session": {"enable_mem_pattern": True}, "state": {"epoch": 0, "step": 0},
    }


def _with(backends: list[str], **edits) -> dict:
    d = _legacy()
    del d["backend"]
    files = {"masks": "masks.npz"}
    for b in backends:
        files.update(_ORT_FILES if b == "ort-training" else _PORTABLE_FILES)
    d.update(backends=backends, files=files, sha256={n: "0" * 64 for n in files.values()}, **edits)
    if "portable" in backends and "portable" not in edits:
        d["portable"] = _PORTABLE
    return d


def test_a_legacy_manifest_reads_as_ort_training_and_keeps_its_form_and_digest():
    d = _legacy()
    m = Manifest.from_dict(d)
    assert m.backends == ("ort-training",) and m.portable is None and m.has_backend("ort-training")
    assert m.to_dict() == d
    # the digest such bundles' graphs were stamped with (the formula before backends existed)
    old = {k: v for k, v in d.items() if k not in ("sha256", "state", "versions")}
    old["files"] = {r: n for r, n in d["files"].items() if r != "checkpoint"}
    old_digest = hashlib.sha256(json.dumps(old, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    assert contract_digest(m) == old_digest


@pytest.mark.parametrize("backends", [["ort-training"], ["portable"], ["ort-training", "portable"]])
def test_manifests_listing_backends_round_trip(backends):
    d = _with(backends)
    m = Manifest.from_dict(d)
    assert m.backends == tuple(backends)
    assert m.to_dict() == d
    assert (m.portable is not None) == ("portable" in backends)


def test_the_contract_digest_survives_a_save_that_drops_one_backend():
    both = Manifest.from_dict(_with(["ort-training", "portable"]))
    only_portable = dataclasses.replace(both, backends=("portable",),
                                        files={r: n for r, n in both.files.items() if r not in _ORT_FILES})
    only_ort = dataclasses.replace(both, backends=("ort-training",), portable=None,
                                   files={r: n for r, n in both.files.items() if r not in _PORTABLE_FILES})
    assert contract_digest(both) == contract_digest(only_portable) == contract_digest(only_ort)
    # ...but not an edit of an exported setting
    assert contract_digest(dataclasses.replace(both, loss="mse")) != contract_digest(both)


def test_a_batch_statistics_bundle_without_batchnorm_needs_no_statistics_graph():
    d = _with(["ort-training", "portable"], batchnorm="batch")  # the train graph updates no running statistics
    assert Manifest.from_dict(d).batch_statistics


@pytest.mark.parametrize("edit, message", [
    (lambda d: d["files"].pop("portable_train"), "missing \\['portable_train'\\]"),
    (lambda d: d.update(backends=["portable"]) or d["files"].update(_ORT_FILES), "not expected"),
    (lambda d: d.pop("portable"), "'portable'.*must be present exactly"),
    (lambda d: d.update(batchnorm="batch") or d["portable"]["graphs"]["portable_train"]["outputs"].append(
        ["stat:bn.running_mean", "out9"]), "missing \\['portable_stats'\\]"),
    (lambda d: d["portable"]["graphs"].pop("portable_eval"), "portable.graphs describes"),
])
def test_inconsistent_backend_files_are_refused(edit, message):
    d = json.loads(json.dumps(_with(["ort-training", "portable"])))
    edit(d)
    with pytest.raises(BundleError, match=message):
        Manifest.from_dict(d)


@pytest.mark.parametrize("edit", [
    lambda d: d.update(backends=["portable", "portable"]),
    lambda d: d.update(backends=["tensorrt"]),
    lambda d: d["portable"]["graphs"]["portable_train"]["inputs"].append(["bogus", "x"]),
    lambda d: d["portable"]["graphs"].update(portable_other={"inputs": [], "outputs": []}),
    lambda d: d["files"].update(portable_extra="x.onnx"),
    lambda d: d.update(backend="ort-training"),  # the old key beside the new one
])
def test_malformed_backend_fields_fail_the_schema(edit):
    d = json.loads(json.dumps(_with(["portable"])))
    edit(d)
    with pytest.raises(BundleError, match="manifest.json is invalid"):
        Manifest.from_dict(d)


def test_sweep_removes_the_graphs_and_state_of_a_dropped_backend(tmp_path):
    m = Manifest.from_dict(_with(["portable"]))
    names = [*_ORT_FILES.values(), *_PORTABLE_FILES.values(), "masks.npz", "portable_state-3-ab12.npz", "notes.txt"]
    for name in names:
        (tmp_path / name).write_text("x")
    removed = sweep_orphans(tmp_path, m)
    assert sorted(removed) == sorted([*_ORT_FILES.values(), "portable_state-3-ab12.npz"])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*_PORTABLE_FILES.values(), "masks.npz", "notes.txt"])
