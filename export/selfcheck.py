"""Check the generated training graph against torch autograd before a bundle is written.

Every export runs ONNX Runtime's training step on the example batch (and on the example plus one
row: planner defects can depend on shapes) and compares it with torch on the same (prepared)
model: the loss, the output, the gradient of every trained tensor, and one optimizer step. This
catches ONNX Runtime defects for the model actually exported; two were found this way: wrong
grouped-conv input gradients (worked around in ``op_rewrites.py``) and, with some graphs and one
setting of the memory-pattern planner, a train step that returns zeros as its loss and output.
The check therefore also picks that setting: off where correct (its peak memory is lower), else
on; the choice is recorded in the manifest's ``session``. Defects this strict check refuses that
a looser one let through (ONNX Runtime 1.19.2): MobileNet trained with its depthwise convs and
stem but a frozen expand conv (stem gradient ~98% wrong, norm below the old 1e-3 floor), and
MobileNet at 8 x 1024 with a 2-3 window example batch (gradients 0.08-0.2% off a float64
reference on tensors where torch's float32 is within 1e-6).

The gradient tolerance is derived, not fitted: the rounding bound of each gradient's final
reduction (:mod:`.reduction_noise`), which holds for any summation order, so machines whose
kernels sum differently are not refused for cancellation noise. Noise measured for the other
tolerances (ONNX Runtime vs float64 torch; reference models cnn / mobilenet / transformer, full
update, frozen and batch-statistics BatchNorm, 8 x 256 at batch 2 and 8, 8 x 1024 at batch 32):
loss 1.5e-7; output 5.4e-7; optimizer step at most 0.10 of its allowance. (Gradients on this
project's 2-core AMD EPYC machine: at most 0.32 of the new allowance, MobileNet at 8 x 1024 with
batch statistics and a 9-window batch, where ORT and torch's float32 are both 1-7% off float64.)

Criteria (each tensor against its own scale, never against a floor that small tensors hide
under):

* **Gradients.** For each trained tensor, with ``g`` torch's gradient in float64, ``s`` the
  distance of torch's float32 gradient from it, ``b`` the element-wise float32 rounding bound of
  the gradient's final reduction (:mod:`.reduction_noise`: ``(n + 3) u sum|terms|`` per element,
  which follows the reduction's conditioning: the sum of the terms' magnitudes, not the
  magnitude of their sum) and ``h`` ONNX Runtime's:
  ``||h - g|| <= REDUCTION_FACTOR * ||b|| + GRAD_ATOL * G + SPREAD_FACTOR * s`` and, where
  ``||g||`` exceeds that allowance's first two terms, ``cos(h, g) >= 1 - max(COSINE_EPS, 2 (a /
  ||g||)^2)`` with ``a = REDUCTION_FACTOR * ||b|| + SPREAD_FACTOR * s``. ``G`` is the largest
  gradient norm of the model's trained tensors; ``GRAD_ATOL * G`` is where a gradient counts as
  numerically zero (the transformer's key biases: softmax is shift-invariant, their gradient is
  ~1e-9 of ``G``); ``s`` is what float32 cannot resolve in this very tensor (see
  :func:`_torch_reference`). ``||b||`` is a bound for any summation order, so a machine whose
  kernels sum in another order than this one's is not refused for it (a bias gradient of 6,400
  terms with cancellation was 2.2e-3 of its norm off float64 on one such machine, above the
  former ``N eps / 4`` of the norm). An all-zero ``h`` fails for every tensor whose torch gradient
  is above the allowance (all of the CNN's and MobileNet's: ``||b||`` is below 1e-2 of their
  norm at the test sizes), a gradient ~1% wrong wherever the reduction is better conditioned
  than that.
* **Optimizer step.** The exported optimizer (AdamW or SGD, with the manifest's hyper-parameters
  and learning rate) is applied once to ONNX Runtime's own gradients, and torch's optimizer is
  applied to the same parameters with the same gradients: ``||p_ort - p_torch|| <= STEP_RTOL *
  ||p_torch - p0|| + STEP_ULPS * eps32 * ||p_torch||`` per tensor (the second term allows the
  last-bit rounding of the parameters themselves). Feeding the same gradients to both isolates
  the optimizer graph from gradient noise, which Adam amplifies for near-zero gradients.
* **Loss and output.** ``|l_ort - l_torch| <= LOSS_RTOL * |l_torch| + LOSS_ATOL + b`` (``b`` the
  float32 rounding bound of the loss value, :func:`.loss_noise.loss_value_bound`) and
  ``||o_ort - o_torch|| <= OUTPUT_RTOL * ||o_torch|| + LOSS_ATOL``.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import onnx
import torch
from torch import nn

from ..bundle import BundleError, Manifest, ParameterEntry
from .unsupported import unsupported_from_ort_error
from .objectives import torch_loss
from .kink_noise import KinkAllowance
from .loss_noise import loss_rounding_allowance, loss_value_bound, output_gradient_bound
from .reduction_noise import ReductionBounds, reduction_allowance

__all__ = [
    "SelfCheckError",
    "Deviation",
    "choose_session",
    "compare_gradients",
    "compare_loss",
    "compare_tensor",
    "torch_optimizer_step",
    "GRAD_ATOL",
    "SPREAD_FACTOR",
    "REDUCTION_FACTOR",
    "COSINE_EPS",
    "STEP_RTOL",
    "STEP_ULPS",
    "LOSS_RTOL",
    "LOSS_ATOL",
    "OUTPUT_RTOL",
    "check_batch",
]

log = logging.getLogger(__name__)

#: Below ``GRAD_ATOL`` times the model's largest gradient norm a gradient counts as zero.
GRAD_ATOL = 1e-7
#: Multiple of torch's own float32 error (per tensor) that ONNX Runtime may add: float32 engines
#: differ in summation order, so one's error can be a few times another's. Measured: MobileNet
#: 8 x 1024, ``blocks.2.expand.conv.weight`` (1.4e-4 of ``G``): torch 4.8e-4, ORT 5.8e-4 relative.
SPREAD_FACTOR = 3.0
#: Multiple of the final reduction's rounding bound allowed (:mod:`.reduction_noise`): the terms'
#: factors are themselves float32 results of shorter reductions (a conv's input gradient sums
#: ``C_out * k`` terms, the final one ``batch * positions``), allowed as much again.
REDUCTION_FACTOR = 2.0
#: Cosine similarity must be at least ``1 - COSINE_EPS`` (for gradients above the zero level).
COSINE_EPS = 1e-6
#: Relative error allowed on one optimizer step, beside ``STEP_ULPS`` (measured: <= 0.1 of the sum).
STEP_RTOL = 1e-4
#: Units in the last place of the parameters allowed on top (both sides round ``p0 + step``).
STEP_ULPS = 4
#: Loss: relative and absolute tolerance (measured: at most 1.5e-7 relative).
LOSS_RTOL, LOSS_ATOL = 1e-5, 1e-7
#: Output (logits) relative to their norm (measured: at most 5.4e-7).
OUTPUT_RTOL = 1e-5

_EPS32 = float(np.finfo(np.float32).eps)


def _norm(a: np.ndarray) -> float:
    """L2 norm in float64 (elementwise, without BLAS: its threads stall on a busy machine)."""
    a = np.asarray(a, dtype=np.float64)
    return math.sqrt(float(np.square(a).sum()))


class SelfCheckError(RuntimeError):
    """ONNX Runtime's training step disagrees with torch on the exported model."""


@dataclass(frozen=True)
class Deviation:
    """How far one ONNX Runtime tensor is from torch's.

    Attributes:
        what: what was compared (``"gradient of conv1.weight (batch 2)"``).
        error_norm: ``||got - want||`` (L2, float64).
        reference_norm: ``||want||`` (for an optimizer step: ``||want - before||``).
        allowed_norm: the largest ``error_norm`` that passes.
        cosine: cosine similarity of got and want; 1.0 where it is not checked.
        cosine_checked: whether the cosine criterion applies.
        cosine_min: the smallest cosine that passes.
    """

    what: str
    error_norm: float
    reference_norm: float
    allowed_norm: float
    cosine: float = 1.0
    cosine_checked: bool = False
    cosine_min: float = 1.0 - COSINE_EPS

    @property
    def ratio(self) -> float:
        """``error_norm / allowed_norm`` (<= 1 passes the norm criterion)."""
        if self.allowed_norm > 0:
            return self.error_norm / self.allowed_norm
        return 0.0 if self.error_norm == 0 else math.inf

    @property
    def relative_error(self) -> float:
        """``error_norm / reference_norm``."""
        if self.reference_norm > 0:
            return self.error_norm / self.reference_norm
        return 0.0 if self.error_norm == 0 else math.inf

    @property
    def passed(self) -> bool:
        return self.ratio <= 1.0 and (not self.cosine_checked or self.cosine >= self.cosine_min)

    def describe(self) -> str:
        text = (f"{self.what}: error {self.error_norm:.3g} vs norm {self.reference_norm:.3g} "
                f"(relative {self.relative_error:.3g}, allowed {self.allowed_norm:.3g})")
        if self.cosine_checked:
            text += f", cosine {self.cosine:.9f}"
        return text


def compare_tensor(what: str, got: np.ndarray, want: np.ndarray, rtol: float, atol: float,
                   cosine_above: float | None = None, cosine_eps: float = COSINE_EPS) -> Deviation:
    """Compare ``got`` with ``want`` in L2 norm: passes if ``||got - want|| <= rtol * ||want|| + atol``.

    Args:
        what: a name for messages.
        got: ONNX Runtime's value.
        want: torch's value (same shape).
        rtol: relative tolerance on the norm.
        atol: absolute tolerance on the norm.
        cosine_above: also require ``cos(got, want) >= 1 - cosine_eps`` where ``||want||`` exceeds it.
        cosine_eps: see ``cosine_above``.
    """
    got64 = np.asarray(got, dtype=np.float64).ravel()
    want64 = np.asarray(want, dtype=np.float64).ravel()
    if got64.shape != want64.shape:
        return Deviation(f"{what} (shape {np.shape(got)} instead of {np.shape(want)})", math.inf, 0.0, 0.0)
    if not np.isfinite(got64).all():
        return Deviation(f"{what} (not finite)", math.inf, _norm(want64), 0.0)
    err = _norm(got64 - want64)
    ref = _norm(want64)
    checked = cosine_above is not None and ref > cosine_above
    cosine = 1.0
    if checked:
        norms = _norm(got64) * ref
        cosine = float((got64 * want64).sum()) / norms if norms > 0 else 0.0
    return Deviation(what, err, ref, rtol * ref + atol, cosine, checked, 1.0 - cosine_eps)


def compare_loss(what: str, got: float, want: float, loss: str, output: np.ndarray,
                 labels: np.ndarray | None) -> Deviation:
    """Compare a loss value with the reference's: ``|got - want| <= LOSS_RTOL |want| + LOSS_ATOL + b``,
    ``b`` the float32 rounding bound of ``loss`` at the reference's ``output``
    (:func:`.loss_noise.loss_value_bound`)."""
    return compare_tensor(what, np.array(got), np.array(want), LOSS_RTOL,
                          LOSS_ATOL + loss_value_bound(loss, output, labels))


def compare_gradients(got: dict[str, np.ndarray], want: dict[str, np.ndarray], bounds: dict[str, np.ndarray],
                      suffix: str = "", spread: dict[str, float] | None = None,
                      allowance: dict[str, float] | None = None) -> list[Deviation]:
    """Compare gradients tensor by tensor (see the module docstring for the criterion). The one
    gradient criterion of the project: the export self-check and the parity tests use it.

    Args:
        got: ONNX Runtime's gradients by name.
        want: torch's gradients by the same names (float64 where available).
        bounds: per name, the element-wise float32 rounding bound of the gradient's final
            reduction (:class:`~.reduction_noise.ReductionBounds`, same shape as ``want``).
        suffix: appended to each description (e.g. the batch size).
        spread: per name, how far torch's own float32 gradient is from ``want`` (its norm); it
            is added to the allowance, since a float32 engine cannot be asked to do better.
        allowance: per name, a further allowed error norm: the gradient's change were every
            activation element within float32 rounding of a kink on the other side
            (:mod:`.kink_noise`), plus the float32 rounding of the loss's own gradient carried to
            the parameter (:mod:`.loss_noise`).
    """
    scale = max((_norm(g) for g in want.values()), default=0.0)
    zero_level = GRAD_ATOL * scale
    out = []
    for name, g in want.items():
        rounding = REDUCTION_FACTOR * reduction_allowance(bounds[name])
        extra = rounding + SPREAD_FACTOR * (spread or {}).get(name, 0.0) + (allowance or {}).get(name, 0.0)
        ref = _norm(g)
        # The cosine criterion follows the allowance: an error e at norm r allows 1 - cos ~ (e/r)^2 / 2.
        eps = max(COSINE_EPS, 2.0 * (extra / ref) ** 2) if ref > 0 else COSINE_EPS
        out.append(compare_tensor(f"gradient of {name}{suffix}", got[name], g, 0.0, zero_level + extra,
                                  cosine_above=zero_level + rounding, cosine_eps=eps))
    return out


def torch_optimizer_step(params: dict[str, np.ndarray], grads: dict[str, np.ndarray], optimizer: dict,
                         lr: float | None = None) -> dict[str, np.ndarray]:
    """One step of torch's optimizer with a manifest's hyper-parameters, from numpy values.

    Args:
        params: parameter values before the step.
        grads: their gradients.
        optimizer: the manifest's ``optimizer`` (``name``, ``lr``, ``weight_decay``, ``betas``, ``eps``).
        lr: learning rate (default: the manifest's).

    Returns:
        The parameters after one step (float32).
    """
    tensors = {n: torch.tensor(np.array(v, dtype=np.float32), requires_grad=True) for n, v in params.items()}
    for n, t in tensors.items():
        t.grad = torch.tensor(np.array(grads[n], dtype=np.float32))
    step_lr = float(optimizer["lr"] if lr is None else lr)
    if optimizer["name"] == "adamw":
        opt = torch.optim.AdamW(list(tensors.values()), lr=step_lr, betas=tuple(optimizer["betas"]),
                                eps=float(optimizer["eps"]), weight_decay=float(optimizer["weight_decay"]))
    elif optimizer["name"] == "sgd":
        opt = torch.optim.SGD(list(tensors.values()), lr=step_lr)
    else:
        raise ValueError(f"unknown optimizer {optimizer['name']!r}")
    opt.step()
    return {n: t.detach().numpy().copy() for n, t in tensors.items()}


def compare_step(before: dict[str, np.ndarray], got: dict[str, np.ndarray], want: dict[str, np.ndarray],
                 suffix: str = "") -> list[Deviation]:
    """Compare parameters after one optimizer step (criterion in the module docstring)."""
    out = []
    for name, w in want.items():
        step_norm = _norm(np.asarray(w, np.float64) - np.asarray(before[name], np.float64))
        ulps = STEP_ULPS * _EPS32 * _norm(w)
        d = compare_tensor(f"optimizer step of {name}{suffix}", got[name], w, 0.0, STEP_RTOL * step_norm + ulps)
        out.append(replace(d, reference_norm=step_norm))
    return out


def check_batch(example: np.ndarray, seed: int = 0) -> np.ndarray:
    """The batch the self-checks run on: the example input, unless every value in it is the same.

    A constant example (``torch.zeros(...)`` is a common one) checks nothing worth checking and
    makes some checks meaningless: a batch-statistics BatchNorm normalises a channel of zero
    variance, so its output and every gradient through it are float32 rounding amplified by
    ``1 / sqrt(eps)``, noise no engine reproduces (true gradients ~1e-15, float32 ~1e-7). Such an
    example is replaced by seeded windows of the same shape that vary: standard normal around a
    zero constant, the constant times ``exp(N(0, 1/4))`` otherwise (its sign kept, so a model of
    a positive input still gets one).
    """
    example = np.asarray(example)
    if example.size == 0 or not np.issubdtype(example.dtype, np.floating):
        return example
    first = example.flat[0]
    if not (np.isfinite(first) and (example == first).all()):
        return example
    rng = np.random.default_rng(seed)
    if first == 0:
        varied = rng.standard_normal(example.shape)
    else:
        varied = float(first) * np.exp(0.5 * rng.standard_normal(example.shape))
    log.info("the example input is constant (%g everywhere): the self-check runs on seeded windows of its shape "
             "that vary", float(first))
    return varied.astype(example.dtype)


def _labels(manifest: Manifest, n: int) -> np.ndarray | None:
    spec = manifest.label
    if spec is None:
        return None
    if manifest.loss == "cross_entropy":
        return (np.arange(n) % spec["n_classes"]).astype(np.int64)
    return np.full([n, *spec["shape"][1:]], 0.25, dtype=np.float32)


def _torch_reference(module: nn.Module, batchnorm: str, x: np.ndarray, y: np.ndarray | None, loss: str,
                     torch_names: list[str]) -> tuple[float, np.ndarray, dict[str, np.ndarray], dict[str, float],
                                                      dict[str, np.ndarray], dict[str, float]]:
    """Loss, output and gradients of the prepared model in float64 (where the model allows it),
    per gradient how far torch's float32 result is from it, per gradient the float32 rounding
    bound of its final reduction (:mod:`.reduction_noise`, from the same pass), and per gradient
    the further allowance for activations at a kink (:mod:`.kink_noise`) and for the rounding of
    the loss's own gradient (:mod:`.loss_noise`), from the same pass.

    Against a float64 reference ONNX Runtime's own float32 error is what is measured; torch's
    float32 kernels are themselves off by up to ~2e-4 of a gradient's norm in some shapes (the
    reference CNN, one thread, 8 x 1024), and small gradients that are sums of large terms of
    both signs are off in any float32 engine (MobileNet 8 x 1024: ~5e-4 for a tensor 1.4e-4 of
    the largest). That float32 spread is measured per tensor and allowed (``SPREAD_FACTOR`` x) on
    top.
    """
    try:
        loss64, out64, grads64, bounds64, allowance64 = _torch_pass(module, batchnorm, x, y, loss, torch_names,
                                                                torch.float64, instrument=True)
    except RuntimeError as e:  # e.g. a float32 constant created inside forward()
        log.debug("float64 torch reference failed (%s); comparing with float32 torch", e)
        loss32, out32, grads32, bounds32, allowance32 = _torch_pass(module, batchnorm, x, y, loss, torch_names,
                                                                torch.float32, instrument=True)
        return loss32, out32, grads32, {n: 0.0 for n in torch_names}, bounds32, allowance32
    # torch's own float32 gradients: only their distance from float64 is used
    _, _, grads32, _, _ = _torch_pass(module, batchnorm, x, y, loss, torch_names, torch.float32, instrument=False)
    spread = {n: _norm(np.asarray(grads32[n], np.float64) - grads64[n]) for n in torch_names}
    return loss64, out64, grads64, spread, bounds64, allowance64


def _torch_pass(module: nn.Module, batchnorm: str, x: np.ndarray, y: np.ndarray | None, loss: str,
                torch_names: list[str], dtype: torch.dtype, *,
                instrument: bool) -> tuple[float, np.ndarray, dict[str, np.ndarray], dict[str, np.ndarray] | None,
                                           dict[str, float] | None]:
    """One forward and backward pass of the prepared model in ``dtype``; ``instrument``: also the
    reduction bounds and the kink allowance of its gradients (else ``None`` for both)."""
    model = copy.deepcopy(module).to(dtype).eval()
    if batchnorm == "batch":  # ONNX Runtime trains BatchNormalization with batch statistics
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.train()
    params = dict(model.named_parameters())
    for p in params.values():
        p.requires_grad_(False)
    for n in torch_names:
        params[n].requires_grad_(True)
    bounds = ReductionBounds(model, torch_names) if instrument else contextlib.nullcontext()
    kinks = KinkAllowance({n: params[n] for n in torch_names}) if instrument else contextlib.nullcontext()
    with bounds:
        with kinks:
            out = model(torch.from_numpy(x).to(dtype))
            labels = None if y is None else torch.from_numpy(y)
            if labels is not None and labels.is_floating_point():
                labels = labels.to(dtype)
            value = torch_loss(loss, out, labels)
        if instrument:
            out.retain_grad()
        value.backward(retain_graph=instrument)  # the allowances' vector-Jacobian products run on the same graph
    grads = {n: params[n].grad.numpy().copy() for n in torch_names}
    if not instrument:
        return value.item(), out.detach().numpy(), grads, None, None
    # the further allowance per gradient: activations at a kink, and the rounding of the loss's own gradient
    at_kinks = kinks.allowance()
    from_loss = loss_rounding_allowance(out, {n: params[n] for n in torch_names},
                                        output_gradient_bound(loss, out, labels), out.grad)
    allowance = {n: at_kinks.get(n, 0.0) + from_loss[n] for n in torch_names}
    return value.item(), out.detach().numpy(), grads, bounds.bounds(), allowance


def _check_once(stage: Path, manifest: Manifest, pairs: list[tuple[str, str]], x: np.ndarray, y: np.ndarray | None,
                ref_loss: float, ref_out: np.ndarray, ref_grads: dict[str, np.ndarray],
                spread: dict[str, float], bounds: dict[str, np.ndarray],
                allowance: dict[str, float]) -> list[Deviation]:
    from ..runtime.backend import OrtTrainingBackend
    from ..runtime.features import open_prefix, suffix_inputs

    backend = OrtTrainingBackend(stage, manifest, device="cpu")
    # With a prefix model the training graph takes its features: the whole chain is compared.
    features = suffix_inputs(open_prefix(stage, manifest), x, len(x))
    return compare_training_step(backend, manifest, pairs, features, y, ref_loss, ref_out, ref_grads, spread, bounds,
                                 f" (batch {len(x)})", allowance)


def compare_training_step(backend, manifest: Manifest, pairs: list[tuple[str, str]], features: np.ndarray,
                          y: np.ndarray | None, ref_loss: float, ref_out: np.ndarray,
                          ref_grads: dict[str, np.ndarray], spread: dict[str, float],
                          bounds: dict[str, np.ndarray], suffix: str,
                          allowance: dict[str, float] | None = None) -> list[Deviation]:
    """One training step of ``backend`` (a :class:`~edgeadapt.runtime.backend.TrainingBackend`)
    against the torch reference: loss, output, every trained gradient (``pairs``: backend name,
    torch name), then one optimizer step against torch's update of the same gradients."""
    loss, out = backend.train_step(features, y)
    checks = [compare_loss(f"loss{suffix}", loss, ref_loss, manifest.loss, ref_out, y),
              compare_tensor(f"output{suffix}", out, ref_out, OUTPUT_RTOL, LOSS_ATOL)]
    grads = {g: backend.get_gradient(g) for g, _ in pairs}
    checks += compare_gradients(grads, {g: ref_grads[t] for g, t in pairs}, {g: bounds[t] for g, t in pairs},
                                suffix, spread={g: spread[t] for g, t in pairs},
                                allowance={g: (allowance or {}).get(t, 0.0) for g, t in pairs})
    before = {g: backend.get_tensor(g) for g, _ in pairs}
    backend.apply_update(float(manifest.optimizer["lr"]))
    after = {g: backend.get_tensor(g) for g, _ in pairs}
    checks += compare_step(before, after, torch_optimizer_step(before, grads, manifest.optimizer), suffix)
    return checks


def _checked_once(stage: Path, manifest: Manifest, pairs: list[tuple[str, str]], reference: tuple) -> list[Deviation]:
    """:func:`_check_once`, with ONNX Runtime failing on one op of the model (no kernel for its
    gradient when the session is built, a gradient kernel that fails at the train step) reported
    as :class:`UnsupportedOpError` naming the op and module, not as a damaged bundle."""
    try:
        return _check_once(stage, manifest, pairs, *reference)
    except (BundleError, RuntimeError, *_ort_errors()) as e:
        training = onnx.load(stage / manifest.files["training_model"], load_external_data=False)
        building = isinstance(e, BundleError)
        stage_text = ("ONNX Runtime cannot build the training session for it" if building
                      else "ONNX Runtime's training step fails on it")
        # the session-build BundleError wraps ONNX Runtime's own error (raised "from None")
        original = e.__context__ if building and e.__context__ is not None else e
        unsupported = unsupported_from_ort_error(original, training, stage_text)
        if unsupported is None:
            raise
        raise unsupported from None


def _ort_errors() -> tuple[type[BaseException], ...]:
    """The exception types ONNX Runtime's Python binding raises (``Fail``, ``RuntimeException``, ...)."""
    try:
        from onnxruntime.capi import onnxruntime_pybind11_state as state
    except ImportError:
        return ()
    return tuple(t for t in vars(state).values()
                 if isinstance(t, type) and issubclass(t, Exception) and t.__module__ == state.__name__)


def choose_session(stage: Path, manifest: Manifest, module: nn.Module, torch_entries: tuple[ParameterEntry, ...],
                   example: np.ndarray) -> dict:
    """Return the ``session`` settings under which ORT matches torch on ``example``.

    Args:
        stage: directory holding the generated artifacts.
        manifest: the bundle's manifest (its ``session`` is what is being chosen; other keys of
            ``manifest.session`` are kept).
        module: the prepared torch model that was exported (the whole model; with a prefix
            model the check runs the chain prefix -> training graph against it).
        torch_entries: the parameter entries with *torch* tensor names, in the order of
            ``manifest.parameters`` (which holds the graph names).
        example: an input batch of the model.

    Raises:
        SelfCheckError: no setting reproduces torch; the message names every tensor that differs.
        UnsupportedOpError: ONNX Runtime cannot build the training session or run the train step
            because of one op of the model (names the op and its module).
    """
    pairs = []
    for graph_e, torch_e in zip(manifest.parameters, torch_entries):
        if graph_e.trainable_numel:
            role = "trained" if graph_e.is_split else "value"
            pairs.append((graph_e.onnx_names[role], torch_e.onnx_names[role]))
    batches = [example, np.concatenate([example, example[:1]])]
    references = [(x, _labels(manifest, len(x))) for x in batches]
    references = [(x, y, *_torch_reference(module, manifest.batchnorm, x, y, manifest.loss, [t for _, t in pairs]))
                  for x, y in references]
    failures = []
    for mem_pattern in (False, True):
        session = {**manifest.session, "enable_mem_pattern": mem_pattern}
        candidate = replace(manifest, session=session)
        checks = [d for ref in references for d in _checked_once(stage, candidate, pairs, ref)]
        failed = [d for d in checks if not d.passed]
        worst = max(checks, key=lambda d: d.ratio)
        if not failed:
            log.debug("self-check passed with enable_mem_pattern=%s (worst: %s)", mem_pattern, worst.describe())
            return session
        # Causal order (a wrong loss explains wrong gradients, which explain wrong steps), worst first.
        kinds = ("loss", "output", "gradient", "optimizer")
        failed.sort(key=lambda d: (next(i for i, k in enumerate(kinds) if d.what.startswith(k)), -d.ratio))
        shown = "; ".join(d.describe() for d in failed[:5])
        more = f" and {len(failed) - 5} more" if len(failed) > 5 else ""
        failures.append(f"enable_mem_pattern={mem_pattern}: {len(failed)} of {len(checks)} checks fail: {shown}{more}")
        log.debug("self-check failed: %s", failures[-1])
    raise SelfCheckError(
        "ONNX Runtime's training step does not reproduce torch on this model ("
        + " | ".join(failures)
        + "; gradients must agree to within float32 rounding of their reductions, "
        + f"optimizer steps to {STEP_RTOL} of the step). "
        "The bundle was not written. Please report the model; freezing the layers where it differs "
        "may avoid the defective kernel"
    )
