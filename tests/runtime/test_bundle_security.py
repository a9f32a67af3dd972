"""A bundle is untrusted input: paths stay inside it, models are checked before ONNX Runtime
sees them, the manifest must agree with the graphs, and every leak is a project error."""

from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import onnx
import pytest
from helpers import make_data

from edgeadapt.bundle import CONTRACT_KEY, MANIFEST_DIGEST_KEY, BundleError, manifest_digest, read_manifest, sha256_file
from edgeadapt.runtime import InputError, Runner


@pytest.fixture
def bundle(cnn_bundle, tmp_path):
    dst = tmp_path / "bundle"
    shutil.copytree(cnn_bundle, dst)
    return dst


def _edit_manifest(bundle, edit) -> None:
    """Edit manifest.json as someone who also recomputes its own digest would."""
    m = json.loads((bundle / "manifest.json").read_text())
    edit(m)
    m[MANIFEST_DIGEST_KEY] = manifest_digest(m)
    (bundle / "manifest.json").write_text(json.dumps(m))


def _rehash(bundle, name: str) -> None:
    _edit_manifest(bundle, lambda m: m["sha256"].__setitem__(name, sha256_file(bundle / name)))


def _edit_model(bundle, name: str, edit) -> None:
    model = onnx.load(bundle / name)
    edit(model)
    onnx.save(model, bundle / name)
    _rehash(bundle, name)


def _strip_digest(bundle) -> None:
    """What a bundle exported before graphs carried the settings digest looks like."""
    for name in ("training_model.onnx", "eval_model.onnx", "optimizer_model.onnx"):
        _edit_model(bundle, name, lambda m: m.metadata_props.__delitem__(slice(None)))


# ---- item 8: names stay inside the bundle ------------------------------------------------
@pytest.mark.parametrize("role, name", [
    ("masks", "../outside.txt"), ("checkpoint", "../x"), ("checkpoint", "/etc/passwd"),
    ("eval_model", "sub/eval_model.onnx"), ("masks", ".."),
])
def test_member_names_outside_the_bundle_are_refused(bundle, role, name):
    outside = bundle.parent / "outside.txt"
    outside.write_text("secret")
    _edit_manifest(bundle, lambda m: (m["files"].__setitem__(role, name),
                                      m["sha256"].__setitem__(name, sha256_file(outside))))
    with pytest.raises(BundleError, match=rf"files\.{role}|sha256 key.*not a plain file name"):
        Runner.load(bundle)
    with pytest.raises(BundleError, match="not a plain file name inside the bundle"):
        read_manifest(bundle, verify=False)


def test_symlink_leaving_the_bundle_is_refused(bundle):
    outside = bundle.parent / "masks_elsewhere.npz"
    shutil.move(bundle / "masks.npz", outside)
    (bundle / "masks.npz").symlink_to(outside)
    with pytest.raises(BundleError, match=r"masks\.npz: files\.masks resolves to .* outside the bundle"):
        Runner.load(bundle)


def test_a_manifest_naming_an_outside_path_cannot_be_built_for_saving(bundle):
    manifest = read_manifest(bundle)
    with pytest.raises(BundleError, match="not a plain file name"):
        dataclasses.replace(manifest, files={**manifest.files, "masks": "../outside.txt"})


# ---- item 9: external data and op domains ----------------------------------------------------
def _external(model):
    t = model.graph.initializer[0]
    t.data_location = onnx.TensorProto.EXTERNAL
    t.external_data.add(key="location", value="../../etc/passwd")
    t.ClearField("raw_data")


def test_external_data_outside_the_bundle_is_refused(bundle):
    _edit_model(bundle, "training_model.onnx", _external)
    with pytest.raises(BundleError,
                       match=r"training_model\.onnx: initializer .* keeps its data in '\.\./\.\./etc/passwd'"):
        Runner.load(bundle)


def test_custom_op_domain_is_refused(bundle):
    def add_custom(model):
        model.graph.node[0].domain = "evil.ops"
        model.graph.node[0].name = "payload"
    _edit_model(bundle, "eval_model.onnx", add_custom)
    with pytest.raises(BundleError, match=r"eval_model\.onnx: node 'payload' uses op evil\.ops::"):
        Runner.load(bundle)


# ---- item 10: the manifest against the graphs, and bounded numbers ----------------------------
EDITS = {
    "lr": lambda m: m["optimizer"].__setitem__("lr", 0.01),
    "n_classes": lambda m: m["label"].__setitem__("n_classes", 5),
    "output name": lambda m: m["output"].__setitem__("name", "logits"),
    "weight decay": lambda m: m["optimizer"].__setitem__("weight_decay", 0.5),
    "input shape": lambda m: m["input"].__setitem__("shape", [None, 4, 32]),
    "label dtype": lambda m: m["label"].__setitem__("dtype", "int32"),
}


@pytest.mark.parametrize("what", list(EDITS))
def test_edited_settings_are_refused(bundle, what):
    _edit_manifest(bundle, EDITS[what])
    with pytest.raises(BundleError, match="were edited after export"):
        Runner.load(bundle)


@pytest.mark.parametrize("what, match", [
    ("n_classes", "label.n_classes is 5 but the output 'output' has width 3"),
    ("output name", "names the output 'logits'"),
    ("weight decay", "has weight_decay=0.0099.*the manifest's optimizer says 0.5"),
    ("input shape", r"input 'input' has shape \[None, 4, 16\], the manifest says \[None, 4, 32\]"),
    ("label dtype", "label 'labels' is type 7"),
])
def test_without_the_digest_the_graphs_still_catch_edits(bundle, what, match):
    _strip_digest(bundle)
    Runner.load(bundle)  # an old bundle without the digest loads
    _edit_manifest(bundle, EDITS[what])
    with pytest.raises(BundleError, match=match):
        Runner.load(bundle)


@pytest.mark.parametrize("field, value, match", [
    ("lr", 100.0, "optimizer/lr"), ("lr", 0, "optimizer/lr"), ("lr", "NaN", "not valid JSON"),
    ("weight_decay", -1, "optimizer/weight_decay"), ("betas", [0.9, 1.5], "optimizer/betas"),
    ("eps", 0, "optimizer/eps"),
])
def test_numbers_are_bounded(bundle, field, value, match):
    text = (bundle / "manifest.json").read_text()
    m = json.loads(text)
    m["optimizer"][field] = value
    m[MANIFEST_DIGEST_KEY] = manifest_digest(m)
    raw = json.dumps(m).replace('"NaN"', "NaN")
    (bundle / "manifest.json").write_text(raw)
    with pytest.raises(BundleError, match=match):
        read_manifest(bundle)


def test_state_counters_and_shapes_are_bounded(bundle):
    _edit_manifest(bundle, lambda m: m["state"].__setitem__("step", -3))
    with pytest.raises(BundleError, match="state/step"):
        read_manifest(bundle)


def test_masks_are_verified(bundle):
    with np.load(bundle / "masks.npz") as z:
        masks = {k: z[k] for k in z.files}
    name = next(k for k, v in masks.items() if v.any() and not v.all())  # the channel-split conv2
    masks[name] = ~masks[name]
    masks[name][0] = True
    np.savez(bundle / "masks.npz", **masks)
    _rehash(bundle, "masks.npz")
    with pytest.raises(BundleError, match=rf"masks\.npz: mask of {name} selects"):
        Runner.load(bundle)


def test_oversized_checkpoint_is_refused_before_it_is_read(bundle, monkeypatch):
    import edgeadapt.bundle as bundle_mod

    with open(bundle / "checkpoint", "ab") as f:
        f.truncate(64 << 20)  # sparse: a 64 MiB file for a model of a few KiB
    read = []
    real = bundle_mod.sha256_file
    monkeypatch.setattr(bundle_mod, "sha256_file", lambda p, *a: read.append(p.name) or real(p, *a))
    with pytest.raises(BundleError, match=r"checkpoint is 67108864 bytes, far more than this model needs .* not read"):
        Runner.load(bundle)
    assert "checkpoint" not in read


def test_damaged_checkpoint_values_are_refused(bundle):
    runner = Runner.load(bundle)
    runner.adapt(*make_data(np.random.default_rng(0), n=8), epochs=1, batch_size=4, progress=False)
    # A checkpoint whose values are NaN (as a damaged file that still parses would give).
    import edgeadapt.runtime.backend as backend_mod

    real = backend_mod.OrtTrainingBackend.get_tensor
    try:
        backend_mod.OrtTrainingBackend.get_tensor = lambda self, n: real(self, n) * np.nan
        with pytest.raises(BundleError, match=r"checkpoint: tensor '.*' holds \d+ NaN or infinite values"):
            Runner.load(bundle)
    finally:
        backend_mod.OrtTrainingBackend.get_tensor = real


def test_digest_is_stamped_in_every_graph(bundle):
    manifest = read_manifest(bundle)
    from edgeadapt.bundle import contract_digest

    for role in ("training_model", "eval_model", "optimizer_model"):
        props = {p.key: p.value for p in onnx.load(bundle / manifest.files[role]).metadata_props}
        assert props[CONTRACT_KEY] == contract_digest(manifest)


# ---- item 11: errors that leaked -------------------------------------------------------------
def test_non_utf8_manifest_names_the_file(bundle):
    (bundle / "manifest.json").write_bytes(b'{"schema_version": 1, "x": "\xff\xfe"}')
    with pytest.raises(BundleError, match=r"manifest\.json is not UTF-8 text"):
        Runner.load(bundle)


@pytest.mark.parametrize("dtype", [np.int32, np.uint8])
def test_labels_of_another_integer_dtype_fail_clearly(bundle, dtype):
    X, y = make_data(np.random.default_rng(0), n=8)
    with pytest.raises(InputError, match=rf"y has dtype {np.dtype(dtype)}, the bundle expects int64.*astype"):
        Runner.load(bundle).adapt(X, y.astype(dtype), progress=False)


def test_zero_dimensional_labels_fail_clearly(bundle):
    X, _ = make_data(np.random.default_rng(0), n=8)
    with pytest.raises(InputError, match="y is a scalar"):
        Runner.load(bundle).adapt(X, np.array(1), progress=False)


@pytest.mark.parametrize("lr", [float("nan"), float("inf"), -1e-3, "fast"])  # 0 means: update BN statistics only
def test_bad_learning_rates_are_refused_before_any_step(bundle, lr):
    runner = Runner.load(bundle)
    before = runner.parameters(trainable_only=True)
    with pytest.raises(InputError, match="lr must be"):
        runner.adapt(*make_data(np.random.default_rng(0), n=8), lr=lr, progress=False)
    after = runner.parameters(trainable_only=True)
    assert runner.step == 0 and all(np.array_equal(before[k], after[k]) for k in before)


# ---- the manifest itself: bounded before parsing, covered by its own digest ------------------
def _write_with(bundle, edit, placeholder_value: str, *, reseal: bool = True) -> None:
    """Write the manifest with ``"PLACEHOLDER"`` (set by ``edit``) replaced by raw JSON text (the
    digest, when resealed, covers the placeholder: for checks that come before the digest's)."""
    m = json.loads((bundle / "manifest.json").read_text())
    edit(m)
    if reseal:
        m[MANIFEST_DIGEST_KEY] = manifest_digest(m)
    (bundle / "manifest.json").write_text(json.dumps(m).replace('"PLACEHOLDER"', placeholder_value))


def test_an_oversized_manifest_is_refused_before_parsing(bundle, monkeypatch):
    from edgeadapt.bundle import MAX_MANIFEST_BYTES

    _write_with(bundle, lambda m: m.__setitem__("notes", "PLACEHOLDER"), '"' + "x" * MAX_MANIFEST_BYTES + '"')
    monkeypatch.setattr(json, "loads", lambda *a, **k: pytest.fail("the manifest was parsed"))
    with pytest.raises(BundleError, match=r"manifest\.json is \d+ bytes, more than any manifest needs"):
        read_manifest(bundle)


def test_a_deeply_nested_manifest_is_refused_before_parsing(bundle):
    _write_with(bundle, lambda m: m.__setitem__("policy", "PLACEHOLDER"), "[" * 990 + "]" * 990, reseal=False)
    with pytest.raises(BundleError, match=r"manifest\.json nests 991 levels deep, more than any manifest needs"):
        Runner.load(bundle)


def test_brackets_inside_strings_do_not_count_as_nesting(bundle):
    _edit_manifest(bundle, lambda m: m["versions"].__setitem__("note", "[[[{{" * 100 + '\\"]' * 3))
    assert read_manifest(bundle).versions["note"].startswith("[[[{{")


def test_an_unknown_manifest_key_is_refused(bundle):
    _edit_manifest(bundle, lambda m: m.__setitem__("notes", "x" * 1000))
    with pytest.raises(BundleError, match=r"invalid at <root>: Additional properties are not allowed \('notes'"):
        read_manifest(bundle, verify=False)


@pytest.mark.parametrize("edit", [
    lambda m: m["state"].__setitem__("step", 7),
    lambda m: m["versions"].__setitem__("onnxruntime", "9.9"),
    lambda m: m["sha256"].__setitem__("checkpoint", "0" * 64),
])
def test_a_manifest_changed_after_writing_is_refused(bundle, edit):
    m = json.loads((bundle / "manifest.json").read_text())
    edit(m)  # not resealed: damage, or an edit by hand
    (bundle / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(BundleError, match=r"manifest\.json was changed after it was written"):
        read_manifest(bundle, verify=False)


def test_every_save_reseals_the_manifest(bundle):
    runner = Runner.load(bundle)
    runner.adapt(*make_data(np.random.default_rng(0), n=8), epochs=1, batch_size=4, progress=False)
    runner.save()
    raw = json.loads((bundle / "manifest.json").read_text())
    assert raw[MANIFEST_DIGEST_KEY] == manifest_digest(raw) and raw["state"]["step"] == 2
    assert Runner.load(bundle).step == 2


def test_absurd_parameter_shapes_are_refused_before_any_file_is_read(bundle, monkeypatch):
    import edgeadapt.bundle as bundle_mod

    _edit_manifest(bundle, lambda m: m["parameters"][0].__setitem__("shape", [1 << 31] * 3))
    with open(bundle / "checkpoint", "ab") as f:
        f.truncate(1 << 34)  # sparse: what the claimed shape would allow the checkpoint to be
    monkeypatch.setattr(bundle_mod, "sha256_file", lambda p, *a: pytest.fail(f"{p} was hashed"))
    with pytest.raises(BundleError, match="elements in all, more than a bundle may"):
        Runner.load(bundle)


def test_counters_near_the_limit_are_refused_at_load_not_at_save(bundle):
    _edit_manifest(bundle, lambda m: m["state"].__setitem__("step", 1 << 62))
    with pytest.raises(BundleError, match=r"state\.step is 4611686018427387904, beyond any real run"):
        Runner.load(bundle)


def test_an_invalid_manifest_is_never_written(bundle, tmp_path):
    import dataclasses

    from edgeadapt.bundle import write_manifest

    manifest = dataclasses.replace(read_manifest(bundle), state={"epoch": 0, "step": (1 << 62) + 1})
    before = (bundle / "manifest.json").read_bytes()
    with pytest.raises(BundleError, match=r"not written, the manifest would be invalid at state/step"):
        write_manifest(bundle, manifest)
    assert (bundle / "manifest.json").read_bytes() == before


@pytest.mark.parametrize("value", ["[1]", '"x"', "0", "1e400", "2.5"])
def test_bad_micro_batch_in_the_plan_is_refused_at_load(bundle, value):
    _strip_digest(bundle)  # even a bundle whose graphs carry no settings digest
    if value == "1e400":  # parses as inf, which no digest can be computed over
        _write_with(bundle, lambda m: m["plan"].__setitem__("micro_batch_windows", "PLACEHOLDER"), value, reseal=False)
    else:
        _edit_manifest(bundle, lambda m: m["plan"].__setitem__("micro_batch_windows", json.loads(value)))
    with pytest.raises(BundleError, match=r"manifest\.json (is invalid at plan/micro_batch_windows|is not valid JSON)"):
        Runner.load(bundle)


@pytest.mark.parametrize("member, data, match", [
    ("readme.txt", b"hello", r"member 'readme\.txt' is not a \.npy array"),
    ("extra.npy", None, r"member 'extra\.npy' claims shape \[1099511627776\]"),  # a header of 4 TiB
])
def test_masks_members_are_checked_before_reading(bundle, member, data, match):
    import io
    import zipfile

    if data is None:
        header = io.BytesIO()
        np.lib.format.write_array_header_1_0(header, {"descr": "<f4", "fortran_order": False, "shape": (1 << 40,)})
        data = header.getvalue()
    with zipfile.ZipFile(bundle / "masks.npz", "a") as z:
        z.writestr(member, data)
    _rehash(bundle, "masks.npz")
    with pytest.raises(BundleError, match=rf"masks\.npz: {match}"):
        Runner.load(bundle)


# ---- ops: only what the exporter writes, no control flow, no sizes from data --------------------
def _add_nodes(bundle, name: str, nodes, initializers=()) -> None:
    """Add nodes to a model; ``"DATA"`` in their inputs stands for the graph's first input."""
    def edit(model):
        data = model.graph.input[0].name
        for node in nodes:
            node.input[:] = [data if i == "DATA" else i for i in node.input]
        model.graph.node.extend(nodes)
        model.graph.initializer.extend(initializers)
    _edit_model(bundle, name, edit)


def test_a_loop_without_trip_count_is_refused(bundle):
    """An endless Loop (no trip count, condition always true) would spin evaluate forever."""
    from onnx import TensorProto, helper

    body = helper.make_graph(
        [helper.make_node("Identity", ["cond_in"], ["cond_out"])], "forever",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []),
         helper.make_tensor_value_info("cond_in", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, [])])
    true = helper.make_tensor("always", TensorProto.BOOL, [], [True])
    _add_nodes(bundle, "eval_model.onnx", [helper.make_node("Loop", ["", "always"], [], name="spin", body=body)],
               [true])
    with pytest.raises(BundleError, match=r"eval_model\.onnx: node 'spin' is Loop, control flow, which the exporter "
                                          r"never writes into a eval_model"):
        Runner.load(bundle, backend="ort-training")  # the graphs edited above


def test_an_op_the_exporter_never_writes_is_refused(bundle):
    from onnx import helper

    _add_nodes(bundle, "eval_model.onnx", [helper.make_node("RandomNormalLike", ["DATA"], ["noise"], name="dice")])
    with pytest.raises(BundleError, match=r"node 'dice' is RandomNormalLike, an op the exporter never writes"):
        Runner.load(bundle, backend="ort-training")  # the graphs edited above


def test_a_size_computed_from_the_input_values_is_refused(bundle):
    """ConstantOfShape of Cast(ReduceMax(input)): the data would choose how much to allocate."""
    from onnx import helper

    nodes = [helper.make_node("ReduceMax", ["DATA"], ["peak"], keepdims=0),
             helper.make_node("Cast", ["peak"], ["peak_int"], to=7),
             helper.make_node("Unsqueeze", ["peak_int", "axis0"], ["dims"]),
             helper.make_node("ConstantOfShape", ["dims"], ["hog"], name="alloc")]
    axis = helper.make_tensor("axis0", 7, [1], [0])
    _add_nodes(bundle, "eval_model.onnx", nodes, [axis])
    with pytest.raises(BundleError, match=r"ConstantOfShape node 'alloc' is not bounded: its input 'dims' is "
                                          r"computed from the values of ReduceMax node"):
        Runner.load(bundle, backend="ort-training")  # the graphs edited above


@pytest.mark.parametrize("op, dims, match", [
    ("ConstantOfShape", [1 << 20, 1 << 20], "asks for more than 268435456 elements"),
    ("ConstantOfShape", [1 << 40], "beyond 16777216"),
])
def test_constant_sizes_are_bounded(bundle, op, dims, match):
    from onnx import helper

    shape = helper.make_tensor("big_shape", 7, [len(dims)], dims)
    _add_nodes(bundle, "eval_model.onnx", [helper.make_node(op, ["big_shape"], ["hog"], name="alloc")], [shape])
    with pytest.raises(BundleError, match=rf"{op} node 'alloc' is not bounded: .*{match}"):
        Runner.load(bundle, backend="ort-training")  # the graphs edited above


def test_a_range_with_a_tiny_step_is_refused(bundle):
    from onnx import helper

    consts = [helper.make_tensor("r0", 1, [], [0.0]), helper.make_tensor("r1", 1, [], [1.0]),
              helper.make_tensor("step", 1, [], [1e-30])]
    _add_nodes(bundle, "eval_model.onnx", [helper.make_node("Range", ["r0", "r1", "step"], ["ramp"], name="ramp")],
               consts)
    with pytest.raises(BundleError, match=r"Range node 'ramp' is not bounded: it counts \d+ steps"):
        Runner.load(bundle, backend="ort-training")  # the graphs edited above


def test_the_op_table_has_no_control_flow_and_knows_every_role():
    from edgeadapt.op_allowlist import ALLOWED_OPS, CONTROL_FLOW_OPS, check_ops

    assert not any(CONTROL_FLOW_OPS & ops for ops in ALLOWED_OPS.values())
    assert {"training_model", "eval_model", "optimizer_model", "prefix_model"} <= set(ALLOWED_OPS)
    with pytest.raises(BundleError, match="no ops are allowed for a model of role 'mystery'"):
        check_ops(onnx.ModelProto(), "mystery")


# ---- more errors that leaked ----------------------------------------------------------------
def test_a_symbolic_link_loop_is_a_bundle_error(bundle):
    (bundle / "masks.npz").unlink()
    (bundle / "masks.npz").symlink_to("masks.npz")
    with pytest.raises(BundleError, match=r"masks\.npz: files\.masks cannot be resolved .*symbolic link loop"):
        Runner.load(bundle)


def test_two_roles_linked_to_one_file_are_refused(bundle):
    (bundle / "eval_model.onnx").unlink()
    (bundle / "eval_model.onnx").symlink_to("training_model.onnx")
    _rehash(bundle, "eval_model.onnx")
    with pytest.raises(BundleError, match=r"files\.(eval|training)_model \((eval|training)_model\.onnx\) and "
                                          r"files\.(training|eval)_model are the same file"):
        Runner.load(bundle)


def test_a_malformed_plan_entry_is_refused_by_plan_and_load(bundle, capsys):
    from edgeadapt.cli import main

    _edit_manifest(bundle, lambda m: m["plan"]["params"].__setitem__(0, "x"))
    assert main(["plan", str(bundle)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "manifest.json is invalid at plan/params/0" in err
    with pytest.raises(BundleError, match="invalid at plan/params/0"):
        Runner.load(bundle)


def test_inspect_prints_no_terminal_escape_sequences_from_the_bundle(bundle, capsys):
    from edgeadapt.cli import main

    _edit_manifest(bundle, lambda m: m["versions"].__setitem__("onnxruntime", "1.19\x1b[2J\x1b]0;owned\x07"))
    assert main(["inspect", str(bundle)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out
    assert "1.19\\x1b[2J\\x1b]0;owned\\x07" in out  # shown, escaped


def test_a_full_disk_at_save_is_one_clear_error_and_keeps_the_bundle(bundle, monkeypatch):
    import edgeadapt.runtime.backend as backend_mod

    runner = Runner.load(bundle, backend="ort-training")
    runner.adapt(*make_data(np.random.default_rng(0), n=8), epochs=1, batch_size=4, progress=False)
    before = sorted(p.name for p in bundle.iterdir())

    def full(state, path, include_optimizer_state):
        with open(path, "wb") as f:
            f.write(b"half a checkpoint")
        raise RuntimeError("/onnxruntime_src/orttraining/orttraining/training_api/checkpoint.cc:123 "
                           "onnxruntime::training::api::SaveCheckpoint: No space left on device")

    monkeypatch.setattr(backend_mod.C, "save_checkpoint", full)
    with pytest.raises(OSError, match=r"could not write a checkpoint in .*bundle \(.*No space left on device\); the "
                                      r"disk may be full"):
        runner.save()
    monkeypatch.undo()
    assert sorted(p.name for p in bundle.iterdir()) == before  # no partial checkpoint left
    assert Runner.load(bundle, backend="ort-training").step == 0
    runner.save()  # once there is room, the same runner saves
    assert Runner.load(bundle, backend="ort-training").step == 2
