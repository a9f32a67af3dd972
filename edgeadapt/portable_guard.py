"""Checks of a bundle's portable step graphs against its manifest, before onnxruntime sees them.

The manifest's ``portable.graphs`` lists every graph input and output by role, in graph order
(see :mod:`edgeadapt.runtime.portable`). A hand-edited bundle whose graphs do not have exactly
those interfaces, or whose tensors disagree with the manifest's parameters, input, output and
label, is refused at load, before any step runs: :func:`check_portable_graphs` (called by
:func:`edgeadapt.onnx_guard.check_bundle_models`) raises a :class:`~edgeadapt.bundle.BundleError`
naming the file and the role.
"""

from __future__ import annotations

from pathlib import Path

from .bundle import PORTABLE_STATS_ROLE, BundleError, Manifest

__all__ = ["check_portable_graphs", "PORTABLE_DOMAINS"]

#: Op domains a portable graph may use: standard ONNX only (stock onnxruntime runs it).
PORTABLE_DOMAINS = frozenset({"", "ai.onnx"})
_ELEM = {"float32": 1, "int64": 7, "int32": 6, "float64": 11}
_ADAMW_SCALARS = ("decay", "step_size", "bias_correction2_sqrt")


def _kinds(pairs, kind: str) -> list[str]:
    return [r.split(":", 1)[1] for r, _ in pairs if r.startswith(kind + ":")]


def _dims(value) -> list:
    return [d.dim_value if d.HasField("dim_value") else None for d in value.type.tensor_type.shape.dim]


def _expect(path: Path, what: str, got, want) -> None:
    if got != want:
        raise BundleError(f"{path}: {what} is {got}, the manifest says {want}; the bundle was edited - re-export it")


def _check_interface(path: Path, model, spec, opset: int) -> tuple[dict, dict]:
    """The graph's inputs/outputs are the spec's names in order, its default-domain opset is the
    manifest's and it uses standard ONNX ops only. Returns role -> ValueInfo for inputs, outputs."""
    inputs, outputs = list(model.graph.input), list(model.graph.output)
    _expect(path, "the list of graph inputs", [v.name for v in inputs], [n for _, n in spec["inputs"]])
    _expect(path, "the list of graph outputs", [v.name for v in outputs], [n for _, n in spec["outputs"]])
    versions = {o.domain: o.version for o in model.opset_import}
    _expect(path, "the ONNX opset", versions.get("", versions.get("ai.onnx")), opset)
    foreign = sorted({f"{n.domain}::{n.op_type}" for n in model.graph.node if n.domain not in PORTABLE_DOMAINS})
    if foreign:
        raise BundleError(f"{path}: uses ops outside standard ONNX ({', '.join(foreign[:5])}); a portable graph "
                          "runs on stock onnxruntime - re-export the bundle")
    return ({r: v for (r, _), v in zip(spec["inputs"], inputs)}, {r: v for (r, _), v in zip(spec["outputs"], outputs)})


def _parameter_shapes(manifest: Manifest, prefix) -> tuple[dict[str, list], set[str]]:
    """Graph tensor -> shape for every manifest parameter tensor the suffix graphs hold, and the
    names of the trained ones (a split parameter trains its ``trained`` slice)."""
    in_prefix = set() if prefix is None else {t.name for t in prefix.graph.initializer}
    shapes, trained = {}, set()
    for p in manifest.parameters:
        names = p.onnx_names
        if not names or (not p.is_split and names["value"] in in_prefix):
            continue
        if p.is_split:
            per_row = p.trainable_numel // max(1, _prod(p.shape[1:]))
            shapes[names["trained"]] = [per_row, *p.shape[1:]]
            shapes[names["frozen"]] = [p.shape[0] - per_row, *p.shape[1:]]
            shapes[names["index"]] = [p.shape[0]]
            trained.add(names["trained"])
        else:
            shapes[names["value"]] = list(p.shape)
            if p.trainable_numel:
                trained.add(names["value"])
    return shapes, trained


def _prod(dims) -> int:
    out = 1
    for d in dims:
        out *= int(d)
    return out


def check_portable_graphs(paths: dict[str, Path], models: dict, manifest: Manifest, data_input: str,
                          data_dims) -> tuple[str, ...]:
    """Check every portable graph of a bundle against its manifest.

    Args:
        paths, models: by file role, the portable graphs (and ``prefix_model`` when present),
            parsed by :func:`edgeadapt.onnx_guard.check_onnx_file`.
        manifest: the bundle's manifest.
        data_input: ``features`` behind a prefix model, else the manifest's input name (unused
            beyond messages: portable graphs name their data input by role).
        data_dims: the manifest's input shape, or ``None`` behind a prefix model.

    Returns:
        The parameter tensors the train graph reads (what the portable state must hold).

    Raises:
        BundleError: naming the graph file and the role that disagrees.
    """
    spec = manifest.portable
    opset = int(spec["opset"])
    io = {role: _check_interface(paths[role], models[role], spec["graphs"][role], opset) for role in spec["graphs"]}
    shapes, trained = _parameter_shapes(manifest, models.get("prefix_model"))
    has_labels = manifest.label is not None
    train_path = paths["portable_train"]
    train_in, train_out = io["portable_train"]
    params = _kinds(spec["graphs"]["portable_train"]["inputs"], "param")
    graph_shapes = {n: _dims(train_in["param:" + n]) for n in params}
    missing = sorted(set(shapes) - set(params))
    if missing:
        raise BundleError(f"{train_path}: takes no input for the parameter tensor {missing[0]!r} the manifest lists; "
                          "the bundle was edited - re-export it")
    for n, want in shapes.items():
        _expect(train_path, f"the shape of param:{n}", graph_shapes[n], want)
    trained_outputs = sorted(_kinds(spec["graphs"]["portable_train"]["outputs"], "grad"))
    _expect(train_path, "the set of trained tensors (grad:* outputs)", trained_outputs, sorted(trained))
    for n in trained:
        _expect(train_path, f"the shape of grad:{n}", _dims(train_out["grad:" + n]), graph_shapes[n])
    out_spec = manifest.output
    for role, (ins, outs) in io.items():
        path = paths[role]
        if role == "portable_optimizer":
            continue
        for n in _kinds(spec["graphs"][role]["inputs"], "param"):
            if n not in graph_shapes:
                raise BundleError(f"{path}: reads param:{n}, which the train graph does not; re-export the bundle")
            _expect(path, f"the shape of param:{n}", _dims(ins["param:" + n]), graph_shapes[n])
        if "data" not in ins:
            raise BundleError(f"{path}: has no data input; re-export the bundle")
        d = _dims(ins["data"])
        if data_dims is not None and (len(d) != len(data_dims) or any(
                a is not None and b is not None and a != b for a, b in zip(d[1:], list(data_dims)[1:]))):
            _expect(path, f"the shape of data ({data_input})", d, list(data_dims))
        # the statistics graph may leave the labels out (then it reports no loss)
        if ("labels" in ins and not has_labels) or (role != PORTABLE_STATS_ROLE and has_labels and "labels" not in ins):
            _expect(path, "whether it takes labels", "labels" in ins, has_labels)
        if "labels" in ins:
            _expect(path, "the element type of labels", ins["labels"].type.tensor_type.elem_type,
                    _ELEM[manifest.label["dtype"]])
        if "output" in outs:
            got = _dims(outs["output"])
            if len(got) != len(out_spec.shape) or any(a is not None and b is not None and a != b
                                                      for a, b in zip(got[1:], out_spec.shape[1:])):
                _expect(path, "the shape of output", got, list(out_spec.shape))
        elif role != PORTABLE_STATS_ROLE:
            raise BundleError(f"{path}: has no output role 'output'; re-export the bundle")
        if role != PORTABLE_STATS_ROLE and "loss" not in outs:
            raise BundleError(f"{path}: has no output role 'loss'; re-export the bundle")
    if "weights" not in train_in:
        raise BundleError(f"{train_path}: has no weights input; re-export the bundle")
    stats = set(_kinds(spec["graphs"]["portable_train"]["outputs"], "stat"))
    if PORTABLE_STATS_ROLE in io:
        stat_outs = set(_kinds(spec["graphs"][PORTABLE_STATS_ROLE]["outputs"], "stat"))
        _expect(paths[PORTABLE_STATS_ROLE], "the set of running statistics", sorted(stat_outs), sorted(stats))
    for n in stats:
        if n not in graph_shapes:
            raise BundleError(f"{train_path}: updates stat:{n}, which is not one of its parameters; "
                              "re-export the bundle")
    _check_optimizer(paths["portable_optimizer"], io["portable_optimizer"], spec["graphs"]["portable_optimizer"],
                     manifest, trained, graph_shapes)
    return tuple(params)


def _check_optimizer(path: Path, io, spec, manifest: Manifest, trained: set[str], shapes: dict) -> None:
    ins, outs = io
    adamw = manifest.optimizer["name"] == "adamw"
    kinds_in = ("param", "grad", "exp_avg", "exp_avg_sq") if adamw else ("param", "grad")
    kinds_out = ("param", "exp_avg", "exp_avg_sq") if adamw else ("param",)
    for kind in kinds_in:
        _expect(path, f"the set of {kind}:* inputs", sorted(_kinds(spec["inputs"], kind)), sorted(trained))
    for kind in kinds_out:
        _expect(path, f"the set of {kind}:* outputs", sorted(_kinds(spec["outputs"], kind)), sorted(trained))
    scalars = sorted(r for r in ins if ":" not in r)
    _expect(path, "its scalar inputs", scalars, sorted(_ADAMW_SCALARS if adamw else ("lr",)))
    for n in trained:
        for kind in kinds_in:
            _expect(path, f"the shape of {kind}:{n}", _dims(ins[f"{kind}:{n}"]), shapes[n])
        for kind in kinds_out:
            _expect(path, f"the shape of output {kind}:{n}", _dims(outs[f"{kind}:{n}"]), shapes[n])
