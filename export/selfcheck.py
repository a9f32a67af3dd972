"""Check the generated training graph against torch autograd before a bundle is written.

Every export runs one training step of the ONNX Runtime session on the example batch and
compares its loss, its output and the gradient of every trained tensor with torch on the same
(prepared) model. This catches ONNX Runtime defects for the model actually exported; two were
found this way: wrong grouped-conv input gradients (worked around in ``graph.py``) and, with
some graphs and one setting of the memory-pattern planner, a train step that returns zeros as
its loss and output. The check therefore also picks that setting: off where correct (its peak
memory is lower), else on; the choice is recorded in the manifest's ``session``.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..bundle import Manifest, ParameterEntry
from .objectives import torch_loss

__all__ = ["SelfCheckError", "choose_session", "RTOL", "ATOL"]

log = logging.getLogger(__name__)

# float32 kernels sum in different orders; scaled by the largest magnitude of each compared tensor.
RTOL, ATOL = 1e-3, 1e-5


class SelfCheckError(RuntimeError):
    """ONNX Runtime's training step disagrees with torch on the exported model."""


def _labels(manifest: Manifest, n: int) -> np.ndarray | None:
    spec = manifest.label
    if spec is None:
        return None
    if manifest.loss == "cross_entropy":
        return (np.arange(n) % spec["n_classes"]).astype(np.int64)
    return np.full([n, *spec["shape"][1:]], 0.25, dtype=np.float32)


def _close(a: np.ndarray, b: np.ndarray) -> float:
    """Largest deviation as a fraction of the tolerance (<= 1 passes)."""
    scale = max(float(np.abs(b).max()), 1.0)
    return float(np.abs(a - b).max()) / (ATOL + RTOL * scale)


def _torch_reference(module: nn.Module, batchnorm: str, x: np.ndarray, y: np.ndarray | None, loss: str,
                     torch_names: list[str]) -> tuple[float, np.ndarray, dict[str, np.ndarray]]:
    model = copy.deepcopy(module).eval()
    if batchnorm == "batch":  # ONNX Runtime trains BatchNormalization with batch statistics
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.train()
    params = dict(model.named_parameters())
    for p in params.values():
        p.requires_grad_(False)
    for n in torch_names:
        params[n].requires_grad_(True)
    out = model(torch.from_numpy(x))
    value = torch_loss(loss, out, None if y is None else torch.from_numpy(y))
    value.backward()
    return value.item(), out.detach().numpy(), {n: params[n].grad.numpy() for n in torch_names}


def choose_session(stage: Path, manifest: Manifest, module: nn.Module, torch_entries: tuple[ParameterEntry, ...],
                   example: np.ndarray) -> dict:
    """Return the ``session`` settings under which ORT matches torch on ``example``.

    Args:
        stage: directory holding the generated artifacts.
        manifest: the bundle's manifest (its ``session`` is what is being chosen).
        module: the prepared torch model that was exported.
        torch_entries: the parameter entries with *torch* tensor names, in the order of
            ``manifest.parameters`` (which holds the graph names).
        example: an input batch.

    Raises:
        SelfCheckError: no setting reproduces torch; the message has the worst deviation.
    """
    from ..runtime.backend import OrtTrainingBackend

    pairs = []
    for graph_e, torch_e in zip(manifest.parameters, torch_entries):
        if graph_e.trainable_numel:
            role = "trained" if graph_e.is_split else "value"
            pairs.append((graph_e.onnx_names[role], torch_e.onnx_names[role]))
    # Two batch sizes: planner defects can depend on shapes.
    batches = [example, np.concatenate([example, example[:1]])]
    references = [(x, _labels(manifest, len(x))) for x in batches]
    references = [(x, y, *_torch_reference(module, manifest.batchnorm, x, y, manifest.loss, [t for _, t in pairs]))
                  for x, y in references]
    failures = []
    for mem_pattern in (False, True):
        candidate = replace(manifest, session={"enable_mem_pattern": mem_pattern})
        worst, what = 0.0, ""
        for x, y, ref_loss, ref_out, ref_grads in references:
            backend = OrtTrainingBackend(stage, candidate, device="cpu")
            loss, out = backend.train_step(x, y)
            checks = [("loss", np.array(loss), np.array(ref_loss)), ("output", out, ref_out)]
            checks += [(f"gradient of {g}", backend.get_gradient(g), ref_grads[t]) for g, t in pairs]
            for name, got, want in checks:
                dev = _close(got, want)
                if dev > worst:
                    worst, what = dev, f"{name} (batch {len(x)})"
        if worst <= 1.0:
            log.debug("self-check passed with enable_mem_pattern=%s (worst %.2f of tolerance)", mem_pattern, worst)
            return {"enable_mem_pattern": mem_pattern}
        failures.append(f"enable_mem_pattern={mem_pattern}: {what} off by {worst:.1f}x the tolerance")
        log.debug("self-check failed with enable_mem_pattern=%s: %s", mem_pattern, failures[-1])
    raise SelfCheckError(
        "ONNX Runtime's training step does not reproduce torch on this model (" + "; ".join(failures)
        + f"; tolerance {ATOL} + {RTOL} x magnitude). The bundle was not written. Please report the model; "
        "freezing the layers where it differs may avoid the defective kernel"
    )
