"""The artifact bundle: file layout, ``manifest.json`` schema, checksums.

Torch-free: both the exporter and the on-device runner use it. A bundle is a directory::

    manifest.json          schema version, tensor specs, loss, optimizer, policy, sha256 of every file,
                           and its own digest (``manifest_sha256``, see :func:`manifest_digest`)
    training_model.onnx    forward + loss + backward (ONNX Runtime training artifact)
    eval_model.onnx        forward + loss
    optimizer_model.onnx   the optimizer update
    checkpoint[.stepN]     parameter values (+ optimizer state once adapted)
    masks.npz              per-parameter bool masks over output channels (True = may change)
    prefix_model.onnx      optional: the frozen prefix up to the plan's cut as a plain inference
                           model (``input`` -> ``features``); the training and eval models then
                           take ``features`` as their input
    portable_*.onnx        the portable backend (stock onnxruntime): train / eval / [stats] /
    portable_state.npz     optimizer step graphs and the parameter + optimizer state they read

The manifest's ``backends`` lists which of the two engines' files the bundle holds ("ort-training":
the first four files above; "portable": the portable_* files, whose graph inputs and outputs
``portable`` records by role); masks and the prefix model serve both.

The manifest names the current checkpoint file. Updating a bundle in place writes a new
checkpoint file, then replaces the manifest atomically, then deletes the old checkpoint, so a
crash at any point leaves a manifest that names a complete, checksummed checkpoint.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import math
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema

from .atomic import STAGE_MARKER, atomic_write_json, directory_lock, sweep_stale_stages

log = logging.getLogger(__name__)

__all__ = [
    "SCHEMA_VERSION",
    "MANIFEST_NAME",
    "LOSSES",
    "OPTIMIZERS",
    "BATCHNORM_MODES",
    "PARAMETER_MODES",
    "BundleError",
    "TensorSpec",
    "ParameterEntry",
    "Manifest",
    "sha256_file",
    "read_manifest",
    "write_manifest",
    "verify_checksums",
    "member_path",
    "check_member_name",
    "file_size_limits",
    "contract_digest",
    "CONTRACT_KEY",
    "sweep_orphans",
    "bundle_lock",
    "MAX_LR",
    "BACKENDS",
    "BACKEND_FILE_ROLES",
    "PORTABLE_GRAPH_ROLES",
    "MAX_MANIFEST_BYTES",
    "MAX_MANIFEST_DEPTH",
    "MAX_TOTAL_NUMEL",
    "MANIFEST_DIGEST_KEY",
    "manifest_digest",
]


SCHEMA_VERSION = 1
MANIFEST_NAME = "manifest.json"
# The manifest's vocabulary, spelled once: the exporter, the runner and the CLI use these.
LOSSES = ("cross_entropy", "mse", "bce_with_logits", "entropy")
OPTIMIZERS = ("adamw", "sgd")
BATCHNORM_MODES = ("frozen", "batch")
# = the values of edgeadapt.sched.policy.Mode (kept here: the device side does not import sched; a test
# holds the two equal).
PARAMETER_MODES = ("frozen", "bias", "full", "channels")
FILE_ROLES = ("training_model", "eval_model", "optimizer_model", "checkpoint", "masks")
# Present iff the plan caches the frozen prefix's features (plan.cut >= 0 and plan.cache_features).
OPTIONAL_FILE_ROLES = ("prefix_model",)
# The training engines a bundle can hold, and the files each one needs besides the shared ones
# (masks, prefix_model). "portable": step graphs in standard ONNX ops for stock onnxruntime;
# portable_stats is present iff batchnorm == "batch" and the model has BatchNorm running
# statistics (its train graph returns "stat:" outputs).
BACKENDS = ("ort-training", "portable")
BACKEND_FILE_ROLES = {
    "ort-training": ("training_model", "eval_model", "optimizer_model", "checkpoint"),
    "portable": ("portable_train", "portable_eval", "portable_optimizer", "portable_state"),
}
PORTABLE_STATS_ROLE = "portable_stats"
SHARED_FILE_ROLES = ("masks", "prefix_model")
# The portable graphs' inputs and outputs, by role: a tensor role is "<kind>:<onnx name>".
PORTABLE_GRAPH_ROLES = ("portable_train", "portable_eval", PORTABLE_STATS_ROLE, "portable_optimizer")
PORTABLE_IO_PLAIN = ("data", "labels", "weights", "loss", "output", "head_features", "decay", "step_size",
                     "bias_correction2_sqrt", "lr")
PORTABLE_IO_KINDS = ("param", "grad", "stat", "exp_avg", "exp_avg_sq")
DTYPES = ("float32", "float64", "int64", "int32")

# Bounds on what a manifest may carry: a bundle is untrusted input (see docs/bundle-trust.md).
MAX_LR = 10.0
# A manifest of the largest reference model with its plan and graph is ~100 KiB: 16 MiB leaves
# room for models of thousands of ops and bounds the parse to well under a second.
MAX_MANIFEST_BYTES = 16 << 20
# Nesting depth of the manifest's JSON (exported ones reach ~8): checked on the raw text, before
# the parser or the schema validator recurse.
MAX_MANIFEST_DEPTH = 32
# Parameter elements a bundle may declare in all (1 GiB of float32, far beyond a device model):
# the file-size limits derive from this count, so an absurd claim is refused before any file is
# hashed.
MAX_TOTAL_NUMEL = 1 << 28
# The manifest's own digest (see manifest_digest), a top-level key of manifest.json.
MANIFEST_DIGEST_KEY = "manifest_sha256"
_MAX_DIM = 1 << 31
_MAX_COUNT = 1 << 62
# Largest step or epoch counter a loaded manifest may carry: far beyond any run, and far enough
# below _MAX_COUNT (the bound at save) that adapting a loaded bundle can always be saved.
_MAX_LOADED_COUNT = 1 << 53
# A member name is one plain file name: no directories, no "..", nothing hidden.
_MEMBER_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+-]{0,199}")
# ONNX metadata key under which the exporter stores :func:`contract_digest` in every graph.
CONTRACT_KEY = "edgeadapt.contract_sha256"


class BundleError(ValueError):
    """A bundle is missing, malformed, or fails its checksums; the message says which file and why."""


_TENSOR_SCHEMA = {
    "type": "object",
    "required": ["name", "shape", "dtype"],
    "properties": {
        "name": {"type": "string"},
        "shape": {"type": "array", "maxItems": 8,
                  "items": {"type": ["integer", "null"], "minimum": 1, "maximum": _MAX_DIM}},
        "dtype": {"enum": list(DTYPES)},
    },
}
_UNIT = {"type": "number", "minimum": 0, "maximum": 1}
_IO_LIST = {
    "type": "array", "maxItems": 1 << 16,
    "items": {"type": "array", "minItems": 2, "maxItems": 2, "prefixItems": [
        {"type": "string", "maxLength": 1024,
         "pattern": "^((" + "|".join(PORTABLE_IO_KINDS) + "):.+|" + "|".join(PORTABLE_IO_PLAIN) + ")$"},
        {"type": "string", "maxLength": 1024}]},
}
_PORTABLE_SCHEMA = {
    "type": "object",
    "required": ["opset", "graphs"],
    "additionalProperties": False,
    "properties": {
        "opset": {"type": "integer", "minimum": 1, "maximum": 1000},
        "graphs": {
            "type": "object",
            "propertyNames": {"enum": list(PORTABLE_GRAPH_ROLES)},
            "additionalProperties": {"type": "object", "required": ["inputs", "outputs"], "additionalProperties": False,
                                     "properties": {"inputs": _IO_LIST, "outputs": _IO_LIST}},
        },
        # Whether the train graph carries out the plan's recomputed activations (false: it keeps
        # every activation the backward reads; the plan's recompute applies to ort-training only).
        "recompute": {"type": "boolean"},
    },
}

MANIFEST_SCHEMA: dict[str, Any] = {
    "type": "object",
    "not": {"required": ["backend", "backends"]},
    "additionalProperties": False,
    "required": [
        "schema_version", "format", "files", "sha256", "input", "output", "label",
        "loss", "optimizer", "batchnorm", "policy", "parameters", "versions", "session", "state",
    ],
    "properties": {
        "schema_version": {"const": SCHEMA_VERSION},
        MANIFEST_DIGEST_KEY: {"type": "string", "pattern": "^[0-9a-f]{64}$"},
        "format": {"const": "edgeadapt.bundle"},
        # Bundles written before the portable backend carry "backend": "ort-training" and no
        # "backends"; newer ones list the engines they hold (Manifest.backends).
        "backend": {"enum": ["ort-training"]},
        "backends": {"type": "array", "minItems": 1, "uniqueItems": True, "items": {"enum": list(BACKENDS)}},
        "portable": _PORTABLE_SCHEMA,
        "files": {
            "type": "object",
            "required": ["masks"],
            "propertyNames": {"enum": [*FILE_ROLES, *OPTIONAL_FILE_ROLES, *BACKEND_FILE_ROLES["portable"],
                                       PORTABLE_STATS_ROLE]},
            "additionalProperties": {"type": "string"},
        },
        "sha256": {"type": "object", "additionalProperties": {"type": "string", "pattern": "^[0-9a-f]{64}$"}},
        "input": _TENSOR_SCHEMA,
        "output": _TENSOR_SCHEMA,
        "label": {
            "oneOf": [
                {"type": "null"},
                {
                    "type": "object",
                    "required": ["name", "shape", "dtype", "n_classes"],
                    "properties": {
                        **_TENSOR_SCHEMA["properties"],
                        "n_classes": {"type": ["integer", "null"], "minimum": 1, "maximum": _MAX_DIM},
                    },
                },
            ]
        },
        "loss": {"enum": list(LOSSES)},
        "optimizer": {
            "type": "object",
            "required": ["name", "lr"],
            "properties": {
                "name": {"enum": list(OPTIMIZERS)},
                "lr": {"type": "number", "exclusiveMinimum": 0, "maximum": MAX_LR},
                "weight_decay": _UNIT,
                "betas": {"type": "array", "minItems": 2, "maxItems": 2,
                          "items": {"type": "number", "minimum": 0, "exclusiveMaximum": 1}},
                "eps": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
            },
        },
        "batchnorm": {"enum": list(BATCHNORM_MODES)},
        "policy": {"type": "object"},
        "parameters": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["name", "shape", "mode", "onnx_names", "trainable_numel"],
                "properties": {
                    "name": {"type": "string"},
                    "shape": {"type": "array", "maxItems": 8,
                              "items": {"type": "integer", "minimum": 0, "maximum": _MAX_DIM}},
                    "mode": {"enum": list(PARAMETER_MODES)},
                    "onnx_names": {"type": "object", "additionalProperties": {"type": "string"}},
                    "trainable_numel": {"type": "integer", "minimum": 0, "maximum": _MAX_COUNT},
                },
            },
        },
        "versions": {"type": "object", "additionalProperties": {"type": "string"}},
        "session": {
            "type": "object",
            "required": ["enable_mem_pattern"],
            "properties": {"enable_mem_pattern": {"type": "boolean"}},
        },
        # Optional (bundles written before the scheduler lack them): the sched Plan.to_dict() plus
        # "predicted_peak_bytes", and the sched Graph.to_dict() of the whole exported model.
        "plan": {"type": "object", "required": ["plan_version", "params", "cut"],
                 "properties": {"micro_batch_windows": {"type": ["integer", "null"], "minimum": 1,
                                                        "maximum": _MAX_DIM},
                                "params": {"type": "array", "items": {"type": "object"}}}},
        "graph": {"type": "object", "required": ["ops", "params", "input_bytes"]},
        # Optional (bundles written before it lack it): the linear head whose input every eval
        # graph also returns (runtime.head_features.HEAD_FEATURES_OUTPUT), by tensor name.
        "head": {"type": "object", "additionalProperties": False, "required": ["weight", "bias", "transposed"],
                 "properties": {"weight": {"type": "string"}, "bias": {"type": ["string", "null"]},
                                "transposed": {"type": "boolean"}}},
        "state": {
            "type": "object",
            "required": ["epoch", "step"],
            "properties": {"epoch": {"type": "integer", "minimum": 0, "maximum": _MAX_COUNT},
                           "step": {"type": "integer", "minimum": 0, "maximum": _MAX_COUNT}},
        },
    },
}


@functools.cache
def _validator() -> jsonschema.protocols.Validator:
    # Built once: jsonschema.validate() re-checks the schema itself on every call (~0.4 s).
    cls = jsonschema.validators.validator_for(MANIFEST_SCHEMA)
    cls.check_schema(MANIFEST_SCHEMA)
    return cls(MANIFEST_SCHEMA)


def _validate(d: Any) -> None:
    """Raise the most relevant :class:`jsonschema.ValidationError` of ``d``, as jsonschema.validate does."""
    error = jsonschema.exceptions.best_match(_validator().iter_errors(d))
    if error is not None:
        raise error


@dataclass(frozen=True)
class TensorSpec:
    """Name, shape (``None`` for a dynamic axis) and dtype of a model input, output or label."""

    name: str
    shape: tuple[int | None, ...]
    dtype: str

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {DTYPES}")

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TensorSpec:
        return cls(d["name"], tuple(d["shape"]), d["dtype"])


@dataclass(frozen=True)
class ParameterEntry:
    """One parameter of the source model and how it is laid out in the training graph.

    Attributes:
        name: the torch parameter name (``blocks.0.conv.weight``).
        shape: its full shape.
        mode: ``frozen``, ``bias``, ``full`` or ``channels``.
        onnx_names: the graph initializers holding it: ``{"value": n}`` for an unsplit tensor, or
            ``{"trained": n1, "frozen": n2, "index": n3}`` for a channel-split one, where the
            full tensor is ``concat([trained, frozen])[index]`` along axis 0; empty for a
            parameter the forward pass never uses (it is not in the graph).
        trainable_numel: elements that the optimizer may change.
    """

    name: str
    shape: tuple[int, ...]
    mode: str
    onnx_names: dict[str, str]
    trainable_numel: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "shape": list(self.shape),
            "mode": self.mode,
            "onnx_names": dict(self.onnx_names),
            "trainable_numel": self.trainable_numel,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ParameterEntry:
        return cls(d["name"], tuple(d["shape"]), d["mode"], dict(d["onnx_names"]), d["trainable_numel"])

    @property
    def is_split(self) -> bool:
        return "trained" in self.onnx_names


@dataclass(frozen=True)
class Manifest:
    """The parsed, schema-validated ``manifest.json`` of a bundle."""

    files: dict[str, str]
    sha256: dict[str, str]
    input: TensorSpec
    output: TensorSpec
    label: dict[str, Any] | None
    loss: str
    optimizer: dict[str, Any]
    batchnorm: str
    policy: dict[str, Any]
    parameters: tuple[ParameterEntry, ...]
    versions: dict[str, str]
    state: dict[str, Any] = field(default_factory=lambda: {"epoch": 0, "step": 0})
    session: dict[str, Any] = field(default_factory=lambda: {"enable_mem_pattern": True})
    plan: dict[str, Any] | None = None
    graph: dict[str, Any] | None = None
    backends: tuple[str, ...] = ("ort-training",)
    portable: dict[str, Any] | None = None
    head: dict[str, Any] | None = None
    # Written before bundles listed their backends ("backend": "ort-training"): serialised and
    # digested as it was written, so its graphs' contract stamps still match.
    legacy_backend_key: bool = False

    def __post_init__(self) -> None:
        # Runs on every construction and dataclasses.replace(): a manifest naming a path outside
        # its bundle cannot be built, so neither load nor save can follow one.
        for role, name in self.files.items():
            check_member_name(name, f"files.{role}")
        for name in self.sha256:
            check_member_name(name, "a sha256 key")
        if MANIFEST_NAME in self.files.values():
            raise BundleError(f"manifest.json: files may not name {MANIFEST_NAME} itself")
        if len(set(self.files.values())) != len(self.files):
            raise BundleError(f"manifest.json: two file roles name the same file: {self.files}")
        names = [p.name for p in self.parameters]
        if len(set(names)) != len(names):
            raise BundleError("manifest.json: parameter names repeat")
        self._check_backend_files()
        if (total := self.total_numel) > MAX_TOTAL_NUMEL:
            raise BundleError(f"manifest.json: the parameters hold {total} elements in all, more than a bundle may "
                              f"({MAX_TOTAL_NUMEL}); the manifest was edited or damaged - re-export the bundle")
        for p in self.parameters:
            if p.trainable_numel > math.prod(p.shape):
                raise BundleError(
                    f"manifest.json: parameter {p.name} has trainable_numel {p.trainable_numel} > its "
                    f"{math.prod(p.shape)} elements"
                )
            if p.mode == "frozen" and p.trainable_numel:
                raise BundleError(f"manifest.json: parameter {p.name} is frozen but has trainable elements")

    def _check_backend_files(self) -> None:
        """Each listed backend's files are present, no other backend's are, and a portable
        bundle records its graphs' interfaces."""
        if not self.backends or len(set(self.backends)) != len(self.backends) or set(self.backends) - set(BACKENDS):
            raise BundleError(f"manifest.json: backends {list(self.backends)} must be distinct values of "
                              f"{list(BACKENDS)}")
        if self.legacy_backend_key and tuple(self.backends) != ("ort-training",):
            raise BundleError("manifest.json: a bundle with the old 'backend' key holds only the ort-training backend")
        want = {role for b in self.backends for role in BACKEND_FILE_ROLES[b]}
        if "portable" in self.backends and self.batch_statistics and self._portable_running_statistics():
            want.add(PORTABLE_STATS_ROLE)
        allowed = want | set(SHARED_FILE_ROLES)
        missing, extra = sorted(want - set(self.files)), sorted(set(self.files) - allowed)
        if missing or extra or "masks" not in self.files:
            raise BundleError(
                f"manifest.json: backends {list(self.backends)} need files {sorted(want | {'masks'})}"
                f"{f', missing {missing}' if missing else ''}{f', not expected {extra}' if extra else ''}; "
                "the manifest was edited or damaged - re-export the bundle")
        if ("portable" in self.backends) != (self.portable is not None):
            raise BundleError("manifest.json: 'portable' (the portable graphs' interfaces) must be present exactly "
                              "when backends lists portable; re-export the bundle")
        if self.portable is not None:
            graphs = set(self.portable["graphs"])
            need = {r for r in PORTABLE_GRAPH_ROLES if r in self.files}
            if graphs != need:
                raise BundleError(f"manifest.json: portable.graphs describes {sorted(graphs)}, the files are "
                                  f"{sorted(need)}; re-export the bundle")

    def _portable_running_statistics(self) -> bool:
        """Whether the portable train graph updates running statistics (``stat:`` outputs); a
        model without BatchNorm has none, in either BatchNorm mode."""
        train = ((self.portable or {}).get("graphs") or {}).get("portable_train") or {}
        return any(role.startswith("stat:") for role, _ in train.get("outputs", ()))

    def to_dict(self) -> dict[str, Any]:
        backends = ({"backend": "ort-training"} if self.legacy_backend_key
                    else {"backends": list(self.backends),
                          **({"portable": self.portable} if self.portable is not None else {})})
        return {
            "schema_version": SCHEMA_VERSION,
            "format": "edgeadapt.bundle",
            **backends,
            "files": dict(self.files),
            "sha256": dict(self.sha256),
            "input": self.input.to_dict(),
            "output": self.output.to_dict(),
            "label": self.label,
            "loss": self.loss,
            "optimizer": dict(self.optimizer),
            "batchnorm": self.batchnorm,
            "policy": self.policy,
            "parameters": [p.to_dict() for p in self.parameters],
            "versions": dict(self.versions),
            "session": dict(self.session),
            "state": dict(self.state),
            **({"plan": self.plan} if self.plan is not None else {}),
            **({"graph": self.graph} if self.graph is not None else {}),
            **({"head": self.head} if self.head is not None else {}),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Manifest:
        try:
            _validate(d)
        except jsonschema.ValidationError as e:
            where = "/".join(str(p) for p in e.absolute_path) or "<root>"
            message = e.message if len(e.message) <= 300 else e.message[:300] + "..."
            raise BundleError(f"manifest.json is invalid at {where}: {message}") from None
        return cls(
            files=d["files"],
            sha256=d["sha256"],
            input=TensorSpec.from_dict(d["input"]),
            output=TensorSpec.from_dict(d["output"]),
            label=d["label"],
            loss=d["loss"],
            optimizer=d["optimizer"],
            batchnorm=d["batchnorm"],
            policy=d["policy"],
            parameters=tuple(ParameterEntry.from_dict(p) for p in d["parameters"]),
            versions=d["versions"],
            state=d["state"],
            session=d["session"],
            plan=d.get("plan"),
            graph=d.get("graph"),
            backends=tuple(d.get("backends", ["ort-training"])),
            portable=d.get("portable"),
            head=d.get("head"),
            legacy_backend_key="backends" not in d,
        )

    def has_backend(self, backend: str) -> bool:
        """Whether the bundle holds the graphs and state of ``backend`` (one of :data:`BACKENDS`)."""
        return backend in self.backends

    @property
    def has_prefix(self) -> bool:
        """Whether the bundle runs a frozen prefix model in front of its training graphs."""
        return "prefix_model" in self.files

    @property
    def trainable_numel(self) -> int:
        return sum(p.trainable_numel for p in self.parameters)

    @property
    def total_numel(self) -> int:
        return sum(math.prod(p.shape) for p in self.parameters)

    @property
    def batch_statistics(self) -> bool:
        """True when the training graph normalises with batch statistics (``batchnorm="batch"``):
        a step then depends on the whole batch, so it cannot be split into micro-batches."""
        return self.batchnorm == BATCHNORM_MODES[1]

    @property
    def optimizer_state_numel(self) -> int:
        """Elements of optimizer state: AdamW keeps two moments per trained element, SGD none."""
        return 2 * self.trainable_numel if self.optimizer["name"] == "adamw" else 0


def sha256_file(path: str | os.PathLike, chunk_bytes: int = 1 << 20) -> str:
    """Hex sha256 of a file, read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            h.update(chunk)
    return h.hexdigest()


def check_member_name(name: str, where: str = "a file name") -> None:
    """Raise :class:`BundleError` unless ``name`` is one plain file name inside a bundle.

    Refused: absolute paths, anything with a directory part or ``..``, hidden names and
    characters outside ``[A-Za-z0-9_.+-]`` (a manifest may only name files beside itself).
    """
    if not isinstance(name, str) or not _MEMBER_NAME.fullmatch(name) or name in (".", ".."):
        raise BundleError(
            f"manifest.json: {where} is {name!r}, which is not a plain file name inside the bundle "
            "(absolute paths, directories and '..' are refused); the manifest was edited or damaged - "
            "re-export the bundle"
        )


def member_path(bundle_dir: str | os.PathLike, name: str, where: str = "a file name") -> Path:
    """The path of bundle member ``name``, refused if it is not a plain name or resolves
    (through a symbolic link) outside ``bundle_dir``.

    Raises:
        BundleError: naming the member and the reason.
    """
    check_member_name(name, where)
    bundle_dir = Path(bundle_dir)
    path = bundle_dir / name
    try:
        root = bundle_dir.resolve()
        resolved = path.resolve()
    except (RuntimeError, OSError) as e:  # a symbolic link loop (RuntimeError in Python < 3.13), ELOOP
        raise BundleError(f"{path}: {where} cannot be resolved ({str(e)[:120]}: a symbolic link loop?); "
                          "a bundle's files must be plain files in its own directory") from None
    if resolved.parent != root:
        raise BundleError(
            f"{path}: {where} resolves to {resolved}, outside the bundle {root} (a symbolic link?); "
            "a bundle's files must lie in its own directory"
        )
    return path


def file_size_limits(manifest: Manifest) -> dict[str, int]:
    """Largest plausible size in bytes of each file the manifest lists, from the model's size.

    A file larger than this is refused before it is read (a checkpoint needs at most the
    parameters plus optimizer state; generous margins allow for names and container overhead).
    """
    params_bytes = 8 * manifest.total_numel  # float64 at most
    limits = {}
    for name in manifest.sha256:
        limits[name] = (64 << 20) + 2 * params_bytes
    files = manifest.files
    for role in ("checkpoint", "portable_state"):
        if role in files:
            limits[files[role]] = (1 << 20) + 2 * 8 * (manifest.total_numel + manifest.optimizer_state_numel)
    limits[files["masks"]] = (64 << 10) + sum(512 + (p.shape[0] if p.shape else 1) for p in manifest.parameters)
    return limits


def _reject_constant(token: str) -> float:
    raise ValueError(f"{token} is not a JSON number")


_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')


def _nesting_depth(raw: bytes) -> int:
    """Deepest nesting of ``[``/``{`` in JSON text, brackets inside strings not counted; linear
    and non-recursive, so it is safe to run before the parser."""
    import numpy as np

    codes = np.frombuffer(_JSON_STRING.sub(b'""', raw), dtype=np.uint8)
    steps = (codes == ord("[")).astype(np.int64) + (codes == ord("{")) - (codes == ord("]")) - (codes == ord("}"))
    return int(steps.cumsum().max(initial=0))


def _manifest_text(path: Path) -> str:
    size = path.stat().st_size
    if size > MAX_MANIFEST_BYTES:
        raise BundleError(f"{path} is {size} bytes, more than any manifest needs ({MAX_MANIFEST_BYTES}); "
                          "the bundle is damaged")
    raw = path.read_bytes()
    if len(raw) > MAX_MANIFEST_BYTES:  # grew after stat
        raise BundleError(f"{path} is larger than any manifest needs ({MAX_MANIFEST_BYTES} bytes); "
                          "the bundle is damaged")
    if (depth := _nesting_depth(raw)) > MAX_MANIFEST_DEPTH:
        raise BundleError(f"{path} nests {depth} levels deep, more than any manifest needs ({MAX_MANIFEST_DEPTH}); "
                          "the bundle is damaged - re-export it or restore a copy")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BundleError(f"{path} is not UTF-8 text (byte {e.start}); the bundle is damaged - "
                          "re-export it or restore a copy") from None


def manifest_digest(d: dict[str, Any]) -> str:
    """sha256 of a manifest's canonical JSON (keys sorted, no spaces, ASCII), its own
    :data:`MANIFEST_DIGEST_KEY` left out.

    :func:`write_manifest` stores it in the manifest, :func:`read_manifest` recomputes it, so any
    change to ``manifest.json`` after it was written (damage, or an edit by hand) is refused. It
    proves integrity, not authorship: whoever edits the manifest can recompute it (see
    ``docs/bundle-trust.md``).
    """
    rest = {k: v for k, v in d.items() if k != MANIFEST_DIGEST_KEY}
    text = json.dumps(rest, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()


def read_manifest(bundle_dir: str | os.PathLike, *, verify: bool = True) -> Manifest:
    """Load and validate ``manifest.json``; with ``verify`` also check every file's sha256.

    The text is bounded (size, nesting depth) before it is parsed; its own digest
    (:func:`manifest_digest`) is checked before any field is used. A manifest without a digest
    (written before manifests carried one) is accepted.

    Raises:
        BundleError: the directory is not a bundle, the manifest is too large, too deep,
            malformed, altered after it was written, or names a file outside the bundle, a
            file is missing or too large, or a checksum does not match.
    """
    bundle_dir = Path(bundle_dir)
    path = bundle_dir / MANIFEST_NAME
    if not path.is_file():
        raise BundleError(
            f"{bundle_dir} is not an edgeadapt bundle: {MANIFEST_NAME} is missing "
            "(create one with `edgeadapt export`)"
        )
    path = member_path(bundle_dir, MANIFEST_NAME, MANIFEST_NAME)
    try:
        raw = json.loads(_manifest_text(path), parse_constant=_reject_constant)
    except json.JSONDecodeError as e:
        raise BundleError(f"{path} is not valid JSON: {e}") from None
    except (ValueError, RecursionError) as e:
        raise BundleError(f"{path} is not valid JSON: {e}") from None
    if isinstance(raw, dict) and raw.get("schema_version") not in (None, SCHEMA_VERSION):
        raise BundleError(
            f"{path} has schema_version {str(raw.get('schema_version'))[:40]}, this edgeadapt reads "
            f"{SCHEMA_VERSION}; re-export the bundle with this version"
        )
    if isinstance(raw, dict) and MANIFEST_DIGEST_KEY in raw:
        try:
            digest = manifest_digest(raw)
        except ValueError as e:  # a float too large for JSON (1e400 parses as inf)
            raise BundleError(f"{path} is not valid JSON: {e}") from None
        if raw[MANIFEST_DIGEST_KEY] != digest:
            raise BundleError(
                f"{path} was changed after it was written (its {MANIFEST_DIGEST_KEY} is "
                f"{str(raw[MANIFEST_DIGEST_KEY])[:12]}..., its content hashes to {digest[:12]}...); the bundle "
                "was modified or damaged - re-export it or restore a copy"
            )
    elif isinstance(raw, dict):
        log.info("%s: written before manifests carried their own digest; damage to it cannot be detected", path)
    manifest = Manifest.from_dict(raw)
    for key in ("step", "epoch"):
        if manifest.state[key] > _MAX_LOADED_COUNT:
            raise BundleError(f"{path}: state.{key} is {manifest.state[key]}, beyond any real run (at most "
                              f"{_MAX_LOADED_COUNT}); the bundle is damaged - re-export it or restore a copy")
    resolved: dict[Path, str] = {}
    for role, name in manifest.files.items():
        target = member_path(bundle_dir, name, f"files.{role}").resolve()
        if target in resolved:
            raise BundleError(f"{bundle_dir}: files.{role} ({name}) and files.{resolved[target]} are the same file "
                              f"{target.name} (a symbolic link?); every file of a bundle is its own")
        resolved[target] = role
    if verify:
        verify_checksums(bundle_dir, manifest)
    return manifest


def verify_checksums(bundle_dir: str | os.PathLike, manifest: Manifest) -> None:
    """Raise :class:`BundleError` naming every file that is missing, too large, outside the
    bundle, or whose sha256 differs. Sizes are checked before any file is read."""
    bundle_dir = Path(bundle_dir)
    problems = []
    for role, name in manifest.files.items():
        if name not in manifest.sha256:
            problems.append(f"{name} ({role}) has no checksum in the manifest")
    limits = file_size_limits(manifest)
    for name, want in manifest.sha256.items():
        f = member_path(bundle_dir, name, "a sha256 key")
        if not f.is_file():
            problems.append(f"{name} is missing")
        elif (size := f.stat().st_size) > limits[name]:
            problems.append(f"{name} is {size} bytes, far more than this model needs (at most {limits[name]}); "
                            "it was not read")
        elif (got := sha256_file(f)) != want:
            problems.append(f"{name} has sha256 {got[:12]}..., manifest says {want[:12]}...")
    if problems:
        raise BundleError(
            f"bundle {bundle_dir} failed verification: " + "; ".join(problems)
            + ". The bundle was modified or damaged; re-export it or restore a copy."
        )


_MUTABLE_FIELDS = ("sha256", "state", "versions")


def contract_digest(manifest: Manifest) -> str:
    """sha256 of the manifest's fixed fields: everything an export decides (specs, loss,
    optimizer settings, learning rate, policy, parameters, session, plan), nothing a save
    changes (state, the checkpoint file, checksums).

    The exporter stores it in every ONNX graph's metadata (:data:`CONTRACT_KEY`), which the
    sha256 of the graphs covers; the runner recomputes it, so an edit of those fields in
    ``manifest.json`` alone is refused.

    A bundle that lists its backends leaves out what a save by one backend changes when it drops
    the other's files: ``backends``, ``portable`` and the backends' own file roles (the runner
    checks each graph's interface against the manifest at load instead). A bundle written before
    that (``"backend": "ort-training"``) is digested as it always was.
    """
    d = manifest.to_dict()
    for key in _MUTABLE_FIELDS:
        d.pop(key, None)
    if manifest.legacy_backend_key:
        d["files"] = {role: name for role, name in d["files"].items() if role != "checkpoint"}
    else:
        d.pop("backends")
        d.pop("portable", None)
        d["files"] = {role: name for role, name in d["files"].items() if role in SHARED_FILE_ROLES}
    return hashlib.sha256(json.dumps(d, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


# Files a save writes besides the manifest's members: checkpoints, portable states, the temp
# files of edgeadapt.atomic (".<name>.<random>.tmp"), the graphs of a backend a save dropped, and
# the staging marker (a save into a new folder killed between the rename into place and the
# marker's removal leaves it in the finished bundle).
_STATE_FILE = r"(checkpoint|portable_state)(-\d+-[0-9a-f]+)?(\.npz)?"
_ORPHAN_FILE = re.compile(
    rf"{_STATE_FILE}|\.({_STATE_FILE}|manifest\.json)\.\w+\.tmp"
    r"|(training|eval|optimizer)_model\.onnx|portable_(train|eval|stats|optimizer)\.onnx"
    rf"|{re.escape(STAGE_MARKER)}")


def sweep_orphans(bundle_dir: str | os.PathLike, manifest: Manifest) -> list[str]:
    """Remove what interrupted saves left in a bundle: unreferenced checkpoints, temp files,
    and abandoned ``.<name>.*.partial`` staging folders beside it. Call with the bundle locked
    (:func:`bundle_lock`, exclusive). Returns the names removed."""
    bundle_dir = Path(bundle_dir)
    keep = set(manifest.files.values()) | set(manifest.sha256)
    removed = []
    for f in bundle_dir.iterdir():
        if f.name not in keep and _ORPHAN_FILE.fullmatch(f.name) and not f.is_dir():
            f.unlink(missing_ok=True)
            removed.append(f.name)
    removed += sweep_stale_stages(bundle_dir)
    return removed


@contextlib.contextmanager
def bundle_lock(bundle_dir: str | os.PathLike, *, exclusive: bool, blocking: bool = True) -> Iterator[bool]:
    """Hold an advisory lock on a bundle directory: exclusive to update it, shared to read it.

    Yields:
        Whether the lock is held (always ``True`` when ``blocking``).
    """
    with directory_lock(bundle_dir, exclusive=exclusive, blocking=blocking) as held:
        yield held


def write_manifest(bundle_dir: str | os.PathLike, manifest: Manifest) -> None:
    """Validate and write ``manifest.json`` atomically."""
    d = manifest.to_dict()
    try:
        _validate(d)
    except jsonschema.ValidationError as e:
        where = "/".join(str(p) for p in e.absolute_path) or "<root>"
        raise BundleError(f"{Path(bundle_dir) / MANIFEST_NAME}: not written, the manifest would be invalid at "
                          f"{where}: {e.message[:300]}") from None
    d[MANIFEST_DIGEST_KEY] = manifest_digest(d)
    atomic_write_json(Path(bundle_dir) / MANIFEST_NAME, d)
