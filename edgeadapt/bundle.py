"""The artifact bundle: file layout, ``manifest.json`` schema, checksums.

Torch-free: both the exporter and the on-device runner use it. A bundle is a directory::

    manifest.json          schema version, tensor specs, loss, optimizer, policy, sha256 of every file
    training_model.onnx    forward + loss + backward (ONNX Runtime training artifact)
    eval_model.onnx        forward + loss
    optimizer_model.onnx   the optimizer update
    checkpoint[.stepN]     parameter values (+ optimizer state once adapted)
    masks.npz              per-parameter bool masks over output channels (True = may change)
    prefix_model.onnx      optional: the frozen prefix up to the plan's cut as a plain inference
                           model (``input`` -> ``features``); the training and eval models then
                           take ``features`` as their input

The manifest names the current checkpoint file. Updating a bundle in place writes a new
checkpoint file, then replaces the manifest atomically, then deletes the old checkpoint, so a
crash at any point leaves a manifest that names a complete, checksummed checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema

from .atomic import atomic_write_json

__all__ = [
    "SCHEMA_VERSION",
    "MANIFEST_NAME",
    "BundleError",
    "TensorSpec",
    "ParameterEntry",
    "Manifest",
    "sha256_file",
    "read_manifest",
    "write_manifest",
    "verify_checksums",
]


SCHEMA_VERSION = 1
MANIFEST_NAME = "manifest.json"
FILE_ROLES = ("training_model", "eval_model", "optimizer_model", "checkpoint", "masks")
# Present iff the plan caches the frozen prefix's features (plan.cut >= 0 and plan.cache_features).
OPTIONAL_FILE_ROLES = ("prefix_model",)
DTYPES = ("float32", "float64", "int64", "int32")


class BundleError(ValueError):
    """A bundle is missing, malformed, or fails its checksums; the message says which file and why."""


_TENSOR_SCHEMA = {
    "type": "object",
    "required": ["name", "shape", "dtype"],
    "properties": {
        "name": {"type": "string"},
        "shape": {"type": "array", "items": {"type": ["integer", "null"]}},
        "dtype": {"enum": list(DTYPES)},
    },
}

MANIFEST_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": [
        "schema_version", "format", "backend", "files", "sha256", "input", "output", "label",
        "loss", "optimizer", "batchnorm", "policy", "parameters", "versions", "session", "state",
    ],
    "properties": {
        "schema_version": {"const": SCHEMA_VERSION},
        "format": {"const": "edgeadapt.bundle"},
        "backend": {"enum": ["ort-training"]},
        "files": {
            "type": "object",
            "required": list(FILE_ROLES),
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
                        "n_classes": {"type": ["integer", "null"], "minimum": 1},
                    },
                },
            ]
        },
        "loss": {"enum": ["cross_entropy", "mse", "bce_with_logits", "entropy"]},
        "optimizer": {
            "type": "object",
            "required": ["name", "lr"],
            "properties": {"name": {"enum": ["adamw", "sgd"]}, "lr": {"type": "number", "exclusiveMinimum": 0}},
        },
        "batchnorm": {"enum": ["frozen", "batch"]},
        "policy": {"type": "object"},
        "parameters": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["name", "shape", "mode", "onnx_names", "trainable_numel"],
                "properties": {
                    "name": {"type": "string"},
                    "shape": {"type": "array", "items": {"type": "integer", "minimum": 0}},
                    "mode": {"enum": ["frozen", "bias", "full", "channels"]},
                    "onnx_names": {"type": "object", "additionalProperties": {"type": "string"}},
                    "trainable_numel": {"type": "integer", "minimum": 0},
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
        "plan": {"type": "object", "required": ["plan_version", "params", "cut"]},
        "graph": {"type": "object", "required": ["ops", "params", "input_bytes"]},
        "state": {
            "type": "object",
            "required": ["epoch", "step"],
            "properties": {"epoch": {"type": "integer", "minimum": 0}, "step": {"type": "integer", "minimum": 0}},
        },
    },
}


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
    backend: str = "ort-training"
    plan: dict[str, Any] | None = None
    graph: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "format": "edgeadapt.bundle",
            "backend": self.backend,
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
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Manifest:
        try:
            jsonschema.validate(d, MANIFEST_SCHEMA)
        except jsonschema.ValidationError as e:
            where = "/".join(str(p) for p in e.absolute_path) or "<root>"
            raise BundleError(f"manifest.json is invalid at {where}: {e.message}") from None
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
            backend=d["backend"],
            plan=d.get("plan"),
            graph=d.get("graph"),
        )

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


def read_manifest(bundle_dir: str | os.PathLike, *, verify: bool = True) -> Manifest:
    """Load and validate ``manifest.json``; with ``verify`` also check every file's sha256.

    Raises:
        BundleError: the directory is not a bundle, the manifest is malformed, a file is
            missing, or a checksum does not match.
    """
    bundle_dir = Path(bundle_dir)
    path = bundle_dir / MANIFEST_NAME
    if not path.is_file():
        raise BundleError(
            f"{bundle_dir} is not an edgeadapt bundle: {MANIFEST_NAME} is missing "
            "(create one with `edgeadapt export`)"
        )
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise BundleError(f"{path} is not valid JSON: {e}") from None
    if isinstance(raw, dict) and raw.get("schema_version") not in (None, SCHEMA_VERSION):
        raise BundleError(
            f"{path} has schema_version {raw.get('schema_version')}, this edgeadapt reads "
            f"{SCHEMA_VERSION}; re-export the bundle with this version"
        )
    manifest = Manifest.from_dict(raw)
    if verify:
        verify_checksums(bundle_dir, manifest)
    return manifest


def verify_checksums(bundle_dir: str | os.PathLike, manifest: Manifest) -> None:
    """Raise :class:`BundleError` naming every file that is missing or whose sha256 differs."""
    bundle_dir = Path(bundle_dir)
    problems = []
    for role, name in manifest.files.items():
        if name not in manifest.sha256:
            problems.append(f"{name} ({role}) has no checksum in the manifest")
    for name, want in manifest.sha256.items():
        f = bundle_dir / name
        if not f.is_file():
            problems.append(f"{name} is missing")
        elif (got := sha256_file(f)) != want:
            problems.append(f"{name} has sha256 {got[:12]}..., manifest says {want[:12]}...")
    if problems:
        raise BundleError(
            f"bundle {bundle_dir} failed verification: " + "; ".join(problems)
            + ". The bundle was modified or damaged; re-export it or restore a copy."
        )


def write_manifest(bundle_dir: str | os.PathLike, manifest: Manifest) -> None:
    """Validate and write ``manifest.json`` atomically."""
    d = manifest.to_dict()
    jsonschema.validate(d, MANIFEST_SCHEMA)
    atomic_write_json(Path(bundle_dir) / MANIFEST_NAME, d)
