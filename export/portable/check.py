"""The export self-check of the portable graphs: the portable train and optimizer graphs on the
example batch (and the example plus one row), run by the device runtime's
:class:`~edgeadapt.runtime.portable.PortableBackend` through the prefix model when there is one,
against torch autograd on the prepared model, with the criteria and tolerances of
:mod:`export.selfcheck` (loss, output, every trained gradient, one optimizer step), and the eval
graph's loss and output against the model in eval mode."""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ...bundle import Manifest, ParameterEntry
from ..objectives import torch_loss
from ..selfcheck import (LOSS_ATOL, OUTPUT_RTOL, STEP_RTOL, Deviation, SelfCheckError, _labels, _torch_reference,
                         compare_loss, compare_tensor, compare_training_step)

__all__ = ["check_portable"]

log = logging.getLogger(__name__)


def _torch_eval(module: nn.Module, x: np.ndarray, y: np.ndarray | None, loss: str) -> tuple[float, np.ndarray]:
    """The eval graph's reference: the prepared model in eval mode (running statistics), float64."""
    model = copy.deepcopy(module).double().eval()
    with torch.no_grad():
        out = model(torch.from_numpy(x).double())
        labels = None if y is None else torch.from_numpy(y)
        if labels is not None and labels.is_floating_point():
            labels = labels.double()
        return torch_loss(loss, out, labels).item(), out.numpy()


def _check_batch(stage: Path, manifest: Manifest, module: nn.Module, pairs: list[tuple[str, str]], x: np.ndarray,
                 y: np.ndarray | None,
                 ref_loss: float, ref_out: np.ndarray, ref_grads: dict, spread: dict, bounds: dict,
                 allowance: dict) -> list[Deviation]:
    from ...runtime.features import open_prefix, suffix_inputs
    from ...runtime.portable import PortableBackend

    backend = PortableBackend(stage, manifest, device="cpu", threads=1)
    suffix = f" (portable, batch {len(x)})"
    features = suffix_inputs(open_prefix(stage, manifest), x, len(x))
    eval_loss, eval_out = _torch_eval(module, x, y, manifest.loss)
    loss, out = backend.forward(features, y)
    checks = [compare_loss(f"eval loss{suffix}", loss, eval_loss, manifest.loss, eval_out, y),
              compare_tensor(f"eval output{suffix}", out, eval_out, OUTPUT_RTOL, LOSS_ATOL)]
    checks += compare_training_step(backend, manifest, pairs, features, y, ref_loss, ref_out, ref_grads, spread,
                                    bounds, suffix, allowance)
    backend.close()
    return checks


def check_portable(stage: Path, manifest: Manifest, module: nn.Module, torch_entries: tuple[ParameterEntry, ...],
                   example: np.ndarray) -> list[Deviation]:
    """Run the check; returns every comparison made.

    Args:
        stage: the staged bundle holding the portable files.
        manifest: its (draft) manifest, listing the portable backend.
        module: the prepared torch model that was exported.
        torch_entries: the parameter entries with torch tensor names, in ``manifest.parameters`` order.
        example: an input batch of the model.

    Raises:
        SelfCheckError: the portable graphs do not reproduce torch; names every tensor that differs.
    """
    pairs = [(g.onnx_names["trained" if g.is_split else "value"], t.onnx_names["trained" if t.is_split else "value"])
             for g, t in zip(manifest.parameters, torch_entries) if g.trainable_numel]
    checks = []
    for x in (example, np.concatenate([example, example[:1]])):
        y = _labels(manifest, len(x))
        reference = _torch_reference(module, manifest.batchnorm, x, y, manifest.loss, [t for _, t in pairs])
        checks += _check_batch(stage, manifest, module, pairs, x, y, *reference)
    failed = [d for d in checks if not d.passed]
    if failed:
        failed.sort(key=lambda d: -d.ratio)
        shown = "; ".join(d.describe() for d in failed[:5])
        raise SelfCheckError(
            f"the portable step graphs do not reproduce torch on this model ({len(failed)} of {len(checks)} checks "
            f"fail: {shown}; gradients must agree to within float32 rounding of their reductions, optimizer steps "
            f"to {STEP_RTOL} of the step). The bundle was not written. Please report the model; "
            "--backend ort-training exports without the portable graphs")
    log.debug("portable self-check passed (worst: %s)", max(checks, key=lambda d: d.ratio).describe())
    return checks
