"""Checks of a bundle's ONNX models and masks before ONNX Runtime sees them.

A bundle is untrusted input: its checksums prove only that the files are the ones the manifest
lists, not that the manifest tells the truth about them. Before any session is opened,
:func:`check_bundle_models`

* parses every ONNX file (``onnx``, no torch) and refuses external data that is not a
  checksummed file of the bundle, ops outside the domains the exporter writes
  (:data:`ALLOWED_DOMAINS`), ops the exporter never writes into the model's role, control flow
  and sizes computed from data (:mod:`edgeadapt.op_allowlist`), model-local functions, and IR
  versions ONNX Runtime 1.19 cannot load;
* compares the manifest with the graphs it describes: input, output and label names, element
  types and shapes, the label range against the output width, every parameter's graph tensors
  and shapes, which of them have gradients, and the optimizer's settings;
* recomputes :func:`edgeadapt.bundle.contract_digest` and compares it with the one the exporter
  stored in every graph's metadata, so an edited learning rate (or any other exported setting)
  in ``manifest.json`` is refused;
* reads ``masks.npz`` (no pickle, sizes checked before reading) and checks it against the
  parameter entries and the graph.

Every refusal is a :class:`~edgeadapt.bundle.BundleError` that names the file and, where it
applies, the node, tensor or parameter. See ``docs/bundle-trust.md``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from .bundle import (CONTRACT_KEY, PORTABLE_GRAPH_ROLES, BundleError, Manifest, check_member_name, contract_digest,
                     file_size_limits, member_path)
from .npz import read_arrays
from .op_allowlist import check_ops, subgraphs

__all__ = [
    "ALLOWED_DOMAINS",
    "MAX_IR_VERSION",
    "MAX_ABS_VALUE",
    "check_bundle_models",
    "check_checkpoint_values",
    "check_onnx_file",
    "check_masks",
    "stamp_contract",
]

log = logging.getLogger(__name__)

#: Op domains the exporter's graphs use: standard ONNX (``""``/``ai.onnx``) in the forward and
#: eval graphs, ``com.microsoft`` for ONNX Runtime's gradient and optimizer kernels
#: (``SoftmaxCrossEntropyLossInternal``, ``InPlaceAccumulatorV2``, ``AdamWOptimizer``,
#: ``SGDOptimizerV2``, ...), and the training preview domain that ORT's artifacts may declare.
ALLOWED_DOMAINS = frozenset({"", "ai.onnx", "com.microsoft", "ai.onnx.preview.training"})
#: Largest magnitude a checkpoint value may have: beyond it float32 products overflow to inf in a
#: forward pass (a sign of damaged bytes, not of a trained model).
MAX_ABS_VALUE = 1e12
#: ONNX Runtime 1.19.2 loads models of IR version <= 10.
MAX_IR_VERSION = 10
_MODEL_ROLES = ("training_model", "eval_model", "optimizer_model", "prefix_model")
# onnx TensorProto element types of the manifest's dtypes.
_ELEM_TYPES = {"float32": 1, "int32": 6, "int64": 7, "float64": 11}
_FEATURES = "features"


def _load(path: Path):
    import onnx  # the device extra installs it; torch-free
    from google.protobuf.message import DecodeError

    try:
        return onnx.load_model(str(path), load_external_data=False)
    except (DecodeError, ValueError, RuntimeError, OSError, RecursionError) as e:
        raise BundleError(f"{path}: not a readable ONNX model ({type(e).__name__}: {str(e)[:200]})") from None


def _check_strings(path: Path, model) -> None:
    """Decode every name the checks and ONNX Runtime read: protobuf decodes strings lazily, so
    damaged text would otherwise surface later as a raw ``UnicodeDecodeError``."""
    try:
        texts = [model.producer_name, model.domain, *(o.domain for o in model.opset_import),
                 *(x for p in model.metadata_props for x in (p.key, p.value))]
        for graph in subgraphs(model.graph):
            texts.append(graph.name)
            for v in (*graph.input, *graph.output, *graph.value_info):
                texts += [v.name, *(d.dim_param for d in v.type.tensor_type.shape.dim)]
            for t in graph.initializer:
                texts += [t.name, *(x for e in t.external_data for x in (e.key, e.value))]
            for node in graph.node:
                texts += [node.name, node.op_type, node.domain, *node.input, *node.output,
                          *(a.name for a in node.attribute)]
        bad = next((t for t in texts if not isinstance(t, str)), None)
    except (UnicodeDecodeError, ValueError, TypeError) as e:
        raise BundleError(f"{path}: damaged ONNX model (a name is not valid text: {str(e)[:120]})") from None
    if bad is not None:
        raise BundleError(f"{path}: damaged ONNX model (a name is not valid text: {bad[:40]!r})")


def _check_wiring(path: Path, graph, outer: frozenset[str] = frozenset()) -> None:
    """Every node input is produced somewhere (graph input, initializer, an earlier scope or
    some node's output) and no name is produced twice: what ONNX Runtime checks when it builds
    a session, here before one is built (the training session opens lazily)."""
    produced = set(outer) | {v.name for v in graph.input} | {t.name for t in graph.initializer}
    produced |= {s.values.name for s in graph.sparse_initializer}
    for node in graph.node:
        for out in node.output:
            if out and out in produced and out not in outer:
                raise BundleError(f"{path}: node {node.name or node.op_type!r} writes {out!r}, "
                                  "which is already defined")
            produced.add(out)
    for node in graph.node:
        for name in node.input:
            if name and name not in produced:
                raise BundleError(f"{path}: node {node.name or node.op_type!r} reads {name!r}, which nothing in the "
                                  "graph produces; the model is damaged")
        for attr in node.attribute:
            for g in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                _check_wiring(path, g, frozenset(produced))
    for v in graph.output:
        if v.name not in produced:
            raise BundleError(f"{path}: graph output {v.name!r} is produced by no node; the model is damaged")


def _tensors(graph) -> Iterator[tuple[str, object]]:
    """(where, TensorProto) of every tensor a graph holds: initializers and attribute tensors."""
    for t in graph.initializer:
        yield f"initializer {t.name!r}", t
    for s in graph.sparse_initializer:
        yield f"sparse initializer {s.values.name!r}", s.values
        yield f"sparse initializer {s.values.name!r} (indices)", s.indices
    for node in graph.node:
        for attr in node.attribute:
            if attr.HasField("t"):
                yield f"node {node.name or node.op_type!r} attribute {attr.name!r}", attr.t
            for t in attr.tensors:
                yield f"node {node.name or node.op_type!r} attribute {attr.name!r}", t


def check_onnx_file(bundle_dir: str | Path, name: str, checksummed: set[str] | frozenset[str] = frozenset(),
                    role: str | None = None):
    """Parse one ONNX file of a bundle and refuse what the exporter never writes.

    Args:
        bundle_dir: the bundle.
        name: the member file name.
        checksummed: member names the manifest checksums; external data may live only there.
        role: the model's role in the bundle; when given, its ops are checked against
            :data:`edgeadapt.op_allowlist.ALLOWED_OPS` and sizes computed from data are refused
            (:func:`edgeadapt.op_allowlist.check_ops`).

    Returns:
        The parsed ``onnx.ModelProto`` (external data not loaded).

    Raises:
        BundleError: unreadable file, IR version too new, external data outside the bundle or
            not checksummed, an op domain outside :data:`ALLOWED_DOMAINS`, a local function.
    """
    path = member_path(bundle_dir, name)
    model = _load(path)
    _check_strings(path, model)
    _check_wiring(path, model.graph)
    if model.ir_version > MAX_IR_VERSION:
        raise BundleError(f"{path}: ONNX IR version {model.ir_version}; ONNX Runtime 1.19.2 loads <= {MAX_IR_VERSION}")
    if len(model.functions):
        raise BundleError(
            f"{path}: defines local functions ({', '.join(f.name for f in model.functions)[:200]}); "
            "the exporter never writes them"
        )
    for graph in subgraphs(model.graph):
        for where, tensor in _tensors(graph):
            if tensor.data_location != 1:  # TensorProto.EXTERNAL
                continue
            location = next((e.value for e in tensor.external_data if e.key == "location"), "")
            try:
                check_member_name(location, f"{name}: the external data of {where}")
            except BundleError:
                raise BundleError(
                    f"{path}: {where} keeps its data in {location!r}, which is not a file of the bundle "
                    "(external data must be a plain file name beside the model); refused"
                ) from None
            if location not in checksummed:
                raise BundleError(
                    f"{path}: {where} keeps its data in {location!r}, which the manifest does not checksum; refused"
                )
            member_path(bundle_dir, location, f"{name}: the external data of {where}")
        for node in graph.node:
            if node.domain not in ALLOWED_DOMAINS:
                raise BundleError(
                    f"{path}: node {node.name or '(unnamed)'!r} uses op {node.domain}::{node.op_type}, outside "
                    f"the domains the exporter writes {sorted(ALLOWED_DOMAINS)}; the model was not made by "
                    "edgeadapt export (custom ops are refused)"
                )
    if role is not None:
        check_ops(model, role, str(path))
    return model


# ---- the manifest against the graphs -----------------------------------------------------
def _value_info(model) -> dict[str, tuple[int, list]]:
    """name -> (element type, dims) of the graph's inputs and outputs; a dim is an int or None."""
    out = {}
    for v in (*model.graph.input, *model.graph.output):
        t = v.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim]
        out[v.name] = (t.elem_type, dims)
    return out


def _same_dims(spec_dims, graph_dims) -> bool:
    """Whether a manifest shape (None = dynamic) agrees with a graph shape; axis 0 is the batch."""
    if len(spec_dims) != len(graph_dims):
        return False
    return all(s is None or g is None or s == g for s, g in zip(spec_dims[1:], graph_dims[1:]))


def _check_io(path: Path, model, manifest: Manifest, data_input: str, data_dims) -> None:
    info = _value_info(model)
    inputs = [v.name for v in model.graph.input]
    outputs = [v.name for v in model.graph.output]
    if data_input not in info or data_input not in inputs:
        raise BundleError(f"{path}: the manifest names the input {data_input!r}, "
                          f"the graph's inputs are {inputs[:6]}...")
    if data_dims is not None and not _same_dims(list(data_dims), info[data_input][1]):
        raise BundleError(f"{path}: input {data_input!r} has shape {info[data_input][1]}, "
                          f"the manifest says {list(data_dims)}")
    out = manifest.output
    if out.name not in outputs:
        raise BundleError(f"{path}: the manifest names the output {out.name!r}, the graph's outputs are {outputs[:6]}")
    elem, dims = info[out.name]
    if elem != _ELEM_TYPES[out.dtype] or not _same_dims(list(out.shape), dims):
        raise BundleError(f"{path}: output {out.name!r} is type {elem} shape {dims}, the manifest says "
                          f"{out.dtype} {list(out.shape)}")
    label = manifest.label
    if label is not None:
        if label["name"] not in inputs:
            raise BundleError(f"{path}: the manifest names the label input {label['name']!r}, the graph has none")
        elem, dims = info[label["name"]]
        if elem != _ELEM_TYPES[label["dtype"]] or not _same_dims(list(label["shape"]), dims):
            raise BundleError(f"{path}: label {label['name']!r} is type {elem} shape {dims}, the manifest says "
                              f"{label['dtype']} {label['shape']}")
        n_classes = label.get("n_classes")
        if n_classes is not None and dims and (len(out.shape) < 2 or out.shape[-1] != n_classes):
            raise BundleError(f"{path}: the manifest's label.n_classes is {n_classes} but the output "
                              f"{out.name!r} has width {out.shape[-1] if len(out.shape) > 1 else None}")
    elif manifest.loss != "entropy":
        raise BundleError(f"{path}: the manifest's loss {manifest.loss!r} needs a label spec")


def _check_parameters(path: Path, model, manifest: Manifest, prefix=None) -> None:
    info = _value_info(model)
    inputs = {v.name for v in model.graph.input}
    # A bundle with a prefix model keeps the frozen parameters before the cut there, as initializers.
    in_prefix = {} if prefix is None else {t.name: list(t.dims) for t in prefix.graph.initializer}
    trained_in_graph = {n[: -len("_grad.accumulation.buffer")] for n in inputs
                        if n.endswith("_grad.accumulation.buffer")}
    claimed = set()
    for p in manifest.parameters:
        names = p.onnx_names
        if not names:
            continue
        if not p.trainable_numel and not p.is_split and names["value"] not in inputs and names["value"] in in_prefix:
            if in_prefix[names["value"]] != list(p.shape):
                raise BundleError(f"{path}: parameter {p.name} has shape {in_prefix[names['value']]} in the prefix "
                                  f"model, the manifest says {list(p.shape)}")
            continue
        for role, tensor in names.items():
            if tensor not in inputs:
                raise BundleError(f"{path}: parameter {p.name} ({role}) names the graph tensor {tensor!r}, "
                                  "which the training graph does not have")
        if p.is_split:
            trained, frozen = info[names["trained"]][1], info[names["frozen"]][1]
            rest = list(p.shape[1:])
            if (trained[1:] != rest or frozen[1:] != rest or None in trained or None in frozen
                    or trained[0] + frozen[0] != p.shape[0]
                    or trained[0] * math.prod(rest) != p.trainable_numel):
                raise BundleError(f"{path}: parameter {p.name} is split into {trained} + {frozen} in the graph, "
                                  f"the manifest says shape {list(p.shape)} with {p.trainable_numel} trained elements")
            grad_name = names["trained"]
        else:
            dims = info[names["value"]][1]
            if dims != list(p.shape):
                raise BundleError(f"{path}: parameter {p.name} has shape {dims} in the graph, "
                                  f"the manifest says {list(p.shape)}")
            grad_name = names["value"]
        if (grad_name in trained_in_graph) != (p.trainable_numel > 0):
            state = "trains" if grad_name in trained_in_graph else "does not train"
            raise BundleError(f"{path}: the graph {state} parameter {p.name}, the manifest says "
                              f"{p.trainable_numel} trainable elements")
        if p.trainable_numel:
            claimed.add(grad_name)
    extra = sorted(trained_in_graph - claimed)
    if extra:
        raise BundleError(f"{path}: the graph trains {extra[:5]}, which the manifest does not list as trainable")


def _attr(node, name: str):
    for a in node.attribute:
        if a.name == name:
            return a.f if a.type == 1 else a.i
    return None


def _check_optimizer(path: Path, model, manifest: Manifest) -> None:
    opt = manifest.optimizer
    ops = {n.op_type: n for n in model.graph.node}
    if opt["name"] == "adamw":
        node = ops.get("AdamWOptimizer")
        if node is None:
            raise BundleError(f"{path}: the manifest's optimizer is adamw, the model has ops {sorted(ops)}")
        want = {"alpha": opt.get("betas", (0.9, 0.999))[0], "beta": opt.get("betas", (0.9, 0.999))[1],
                "epsilon": opt.get("eps", 1e-8), "weight_decay": opt.get("weight_decay", 0.0)}
        for attr, value in want.items():
            got = _attr(node, attr)
            if got is None or not math.isclose(got, value, rel_tol=1e-6, abs_tol=1e-12):
                raise BundleError(f"{path}: node {node.name!r} has {attr}={got}, the manifest's optimizer says {value}")
    elif "AdamWOptimizer" in ops or not any("SGD" in op for op in ops):
        raise BundleError(f"{path}: the manifest's optimizer is sgd, the model has ops {sorted(ops)}")


def check_masks(bundle_dir: str | Path, manifest: Manifest, training_model=None) -> None:
    """Check ``masks.npz`` against the parameter entries (and the training graph's split tensors).

    Raises:
        BundleError: naming ``masks.npz`` and the parameter: not a plain ``.npz`` (pickles are
            never loaded), members larger than the model needs, a missing or extra parameter, a
            mask of the wrong dtype or shape, or a mask that disagrees with what trains.
    """
    name = manifest.files["masks"]
    path = member_path(bundle_dir, name, "files.masks")
    try:
        masks = read_arrays(path, max_unpacked_bytes=file_size_limits(manifest)[name])
    except ValueError as e:
        raise BundleError(f"{e}; the masks of this model are damaged - re-export the bundle") from None
    entries = {p.name: p for p in manifest.parameters}
    if set(masks) != set(entries):
        missing, extra = sorted(set(entries) - set(masks)), sorted(set(masks) - set(entries))
        raise BundleError(f"{path}: masks do not match the manifest's parameters "
                          f"(missing {missing[:5]}, extra {extra[:5]})")
    info = _value_info(training_model) if training_model is not None else {}
    for pname, m in masks.items():
        p = entries[pname]
        n_out = p.shape[0] if p.shape else 1
        if m.dtype != np.bool_ or m.shape != (n_out,):
            raise BundleError(f"{path}: mask of {pname} is {m.dtype} {list(m.shape)}, expected bool [{n_out}]")
        per_channel = math.prod(p.shape[1:]) if p.shape else 1
        if p.mode == "channels":
            if int(m.sum()) * per_channel != p.trainable_numel:
                raise BundleError(f"{path}: mask of {pname} selects {int(m.sum())} channels, the manifest trains "
                                  f"{p.trainable_numel} elements ({per_channel} per channel)")
            trained = info.get(p.onnx_names.get("trained", ""))
            if trained is not None and trained[1] and trained[1][0] != int(m.sum()):
                raise BundleError(f"{path}: mask of {pname} selects {int(m.sum())} channels, "
                                  f"the graph trains {trained[1][0]}")
        elif bool(m.all()) != (p.trainable_numel > 0) or bool(m.any()) != bool(m.all()):
            raise BundleError(f"{path}: mask of {pname} ({int(m.sum())} of {n_out} channels) disagrees with its "
                              f"mode {p.mode!r} and {p.trainable_numel} trainable elements")


def check_bundle_models(bundle_dir: str | Path, manifest: Manifest, backend: str = "ort-training") -> tuple[str, ...]:
    """Everything in this module's docstring, for a bundle whose checksums were verified; with
    ``backend="portable"`` for its portable graphs instead (:mod:`edgeadapt.portable_guard`).

    Returns:
        The names of the training graph's parameter inputs (the tensors the checkpoint must
        hold), for :func:`check_checkpoint_values`.

    Raises:
        BundleError: naming the file and what is wrong.
    """
    bundle_dir = Path(bundle_dir)
    checksummed = frozenset(manifest.sha256)
    models = {role: check_onnx_file(bundle_dir, manifest.files[role], checksummed, role)
              for role in (_MODEL_ROLES if backend == "ort-training" else ("prefix_model", *PORTABLE_GRAPH_ROLES))
              if role in manifest.files}
    paths = {role: member_path(bundle_dir, manifest.files[role]) for role in models}
    digest = contract_digest(manifest)
    stamps = {role: {p.key: p.value for p in m.metadata_props}.get(CONTRACT_KEY) for role, m in models.items()}
    if any(stamps.values()):
        for role, stamp in stamps.items():
            if stamp != digest:
                raise BundleError(
                    f"{paths[role]}: the exported settings it was made with (digest {str(stamp)[:12]}...) differ from "
                    f"manifest.json's (digest {digest[:12]}...): the manifest's specs, loss, optimizer, learning "
                    "rate, policy or parameters were edited after export; re-export the bundle instead"
                )
    else:
        log.info("%s: exported before graphs carried a settings digest; manifest edits cannot be detected", bundle_dir)
    data_input, data_dims = manifest.input.name, manifest.input.shape
    if "prefix_model" in models:
        prefix = models["prefix_model"]
        info = _value_info(prefix)
        if manifest.input.name not in info or _FEATURES not in [o.name for o in prefix.graph.output]:
            raise BundleError(f"{paths['prefix_model']}: must map {manifest.input.name!r} to {_FEATURES!r}")
        if not _same_dims(list(manifest.input.shape), info[manifest.input.name][1]):
            raise BundleError(f"{paths['prefix_model']}: input has shape {info[manifest.input.name][1]}, "
                              f"the manifest says {list(manifest.input.shape)}")
        data_input, data_dims = _FEATURES, None
    if backend == "portable":
        from .portable_guard import check_portable_graphs

        try:
            names = check_portable_graphs(paths, models, manifest, data_input, data_dims)
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
            if isinstance(e, BundleError):
                raise
            raise BundleError(f"{bundle_dir}: malformed portable graphs ({type(e).__name__}: {str(e)[:200]})") from None
        check_masks(bundle_dir, manifest)
        return names
    checks = [(role, _check_io, (manifest, data_input, data_dims)) for role in ("training_model", "eval_model")]
    checks += [("training_model", _check_parameters, (manifest, models.get("prefix_model"))),
               ("optimizer_model", _check_optimizer, (manifest,))]
    for role, check, args in checks:
        try:
            check(paths[role], models[role], *args)
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
            if isinstance(e, BundleError):
                raise
            raise BundleError(f"{paths[role]}: malformed model ({type(e).__name__}: {str(e)[:200]})") from None
    check_masks(bundle_dir, manifest, models["training_model"])
    skip = {data_input, *((manifest.label["name"],) if manifest.label else ()), "lazy_reset_grad"}
    return tuple(v.name for v in models["training_model"].graph.input
                 if v.name not in skip and not v.name.endswith("_grad.accumulation.buffer"))


def check_checkpoint_values(get_tensor, names: tuple[str, ...], manifest: Manifest, bundle_dir: str | Path,
                            state_role: str = "checkpoint") -> None:
    """Check the values ONNX Runtime loaded from the checkpoint, one tensor at a time.

    Every parameter input of the training graph must be present, finite and below
    :data:`MAX_ABS_VALUE` in magnitude; a channel-split
    parameter's index must be a permutation of its channels (a damaged index would gather
    out of bounds).

    Args:
        get_tensor: ``name -> numpy array`` (a copy) of the loaded checkpoint state.
        names: from :func:`check_bundle_models`.
        manifest: the bundle's manifest.
        bundle_dir: for messages.
        state_role: the manifest file role of the state those values came from (for messages).

    Raises:
        BundleError: naming the checkpoint file and the tensor.
    """
    path = Path(bundle_dir) / manifest.files[state_role]
    index_of = {p.onnx_names["index"]: p for p in manifest.parameters if p.is_split}
    for name in names:
        try:
            value = get_tensor(name)
        except Exception as e:  # ORT raises its own types for a missing parameter
            raise BundleError(f"{path}: holds no tensor {name!r} that the training graph needs "
                              f"({str(e)[:120]})") from None
        if name in index_of:
            n = index_of[name].shape[0]
            if value.shape != (n,) or not np.array_equal(np.sort(value), np.arange(n)):
                raise BundleError(f"{path}: the channel index {name!r} of {index_of[name].name} is not a "
                                  f"permutation of its {n} channels; the checkpoint is damaged")
        elif np.issubdtype(value.dtype, np.floating) and value.size:
            if not np.isfinite(value).all():
                raise BundleError(f"{path}: tensor {name!r} holds {int((~np.isfinite(value)).sum())} NaN or infinite "
                                  "values; the checkpoint is damaged - restore a copy or re-export")
            if (peak := float(np.abs(value).max())) > MAX_ABS_VALUE:
                raise BundleError(f"{path}: tensor {name!r} holds a value of magnitude {peak:.3g} "
                                  f"(> {MAX_ABS_VALUE:g}, "
                                  "which overflows float32 arithmetic); "
                                  "the checkpoint is damaged - restore a copy or re-export")


def stamp_contract(bundle_dir: str | Path, manifest: Manifest) -> Manifest:
    """Store :func:`~edgeadapt.bundle.contract_digest` in every ONNX graph's metadata (export side).

    Call it last, with the manifest's final settings, before writing the manifest: it rewrites
    the ONNX files of the bundle and returns the manifest with their new checksums.
    """
    import dataclasses

    import onnx

    from .bundle import sha256_file

    bundle_dir = Path(bundle_dir)
    digest = contract_digest(manifest)
    sha = dict(manifest.sha256)
    for role in (*_MODEL_ROLES, *PORTABLE_GRAPH_ROLES):
        if role not in manifest.files:
            continue
        path = member_path(bundle_dir, manifest.files[role])
        model = onnx.load_model(str(path), load_external_data=False)
        kept = [p for p in model.metadata_props if p.key != CONTRACT_KEY]
        del model.metadata_props[:]
        model.metadata_props.extend(kept)
        model.metadata_props.add(key=CONTRACT_KEY, value=digest)
        onnx.save_model(model, str(path))
        sha[manifest.files[role]] = sha256_file(path)
    return dataclasses.replace(manifest, sha256=sha)
