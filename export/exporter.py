"""``export_bundle``: a torch model and an example input -> an on-device training bundle."""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import inspect
import logging
import os
import re
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
import torch
from torch import nn

from ..atomic import staged_directory
from ..bundle import Manifest, TensorSpec, sha256_file, write_manifest
from ..onnx_guard import stamp_contract
from ..progress import Stages
from ..runtime.head_features import LinearHead, add_head_output
from ..sched import CostModel, refit
from ..sched.ir import Graph
from ..sched.plan import Plan
from ..sched.policy import UpdatePolicy
from ..sched.resolve import resolve_last_layer
from ..units import parse_bytes
from ..versions import package_versions
from .onnx_export import MAX_IR_VERSION, to_onnx
from .op_rewrites import check_grouped_conv_grads
from .unsupported import UnsupportedOpError, module_of_node, unsupported_from_ort_error
from .objectives import LOSSES, OptimizerConfig, loss_block, optimizer_block, use_torch_adamw
from .planning import check_entries, cut_model, manifest_plan, node_groups, plan_export, policy_of_plan
from .prepare import channel_masks, prepare_from_plan, prepare_model
from .selfcheck import SelfCheckError, check_batch, choose_session
from .portable.check import check_portable
from .portable.recurrent import RECURRENT_OPS
from .portable.writer import example_labels, write_portable

__all__ = ["export_bundle", "plan_cost", "REWRITE_TOLERANCE", "EXPORT_STAGES"]

log = logging.getLogger(__name__)

# The prepared (rewritten) model must reproduce the original's eval output to this tolerance.
REWRITE_TOLERANCE = 1e-4
INPUT_NAME, OUTPUT_NAME = "input", "output"
# What an export does, in order (each may take seconds on a large model): the progress it reports.
EXPORT_STAGES = ("tracing", "planning", "ONNX export", "training artifacts", "self-check")
PREFIX_FILE = "prefix_model.onnx"
# What the onnxruntime-training engine adds to a bundle (artifacts and its checkpoint), by manifest role.
ORT_TRAINING_FILES = {"training_model": "training_model.onnx", "eval_model": "eval_model.onnx",
                      "optimizer_model": "optimizer_model.onnx", "checkpoint": "checkpoint"}
# export_bundle(backend=...): "auto" = both where onnxruntime.training is importable, else portable.
BACKEND_CHOICES = ("auto", "portable", "ort-training", "both")


#: What a bundle's model input can be (:func:`_check_one_input`).
_ONE_INPUT = ("the exporter supports models with one input: a float32 tensor of shape (batch, ...), e.g. "
              "(batch, channels, time steps)")


def _check_one_input(model: nn.Module, example_input: object) -> None:
    """Refuse more than one input before any work: an example given as several tensors, or a
    model whose ``forward`` needs more than one argument (a bundle has one input, ``input``)."""
    fix = ("combine the inputs into one tensor (e.g. concatenate them along the channel axis) and split it "
           "inside forward, or wrap the model in a module whose forward(x) takes that one tensor")
    if isinstance(example_input, (tuple, list)):
        raise ValueError(f"example_input holds {len(example_input)} inputs; {_ONE_INPUT}: {fix}")
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (AttributeError, TypeError, ValueError):  # no signature to read: the call below tells
        return
    needed = [p.name for p in params if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if len(needed) > 1:
        raise ValueError(f"{type(model).__name__}.forward takes {len(needed)} inputs ({', '.join(needed)}); "
                         f"{_ONE_INPUT}: {fix}")


def _label_spec(loss: str, output_shape: tuple[int, ...]) -> dict | None:
    if loss == "entropy":
        return None
    if loss == "cross_entropy":
        if len(output_shape) != 2:
            raise ValueError(
                f"cross_entropy needs logits of shape (batch, classes); the model returns {list(output_shape)}"
            )
        return {"name": "labels", "shape": [None], "dtype": "int64", "n_classes": int(output_shape[1])}
    return {"name": "labels", "shape": [None, *output_shape[1:]], "dtype": "float32", "n_classes": None}


@contextlib.contextmanager
def _native_stderr_to_log():
    """Route what ONNX Runtime's C++ code prints on file descriptor 2 into this module's debug log.

    The gradient-graph builder logs every graph transformer at info level straight to stderr,
    bypassing Python; a user should see our progress and errors, not hundreds of those lines.
    """
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            text = sink.read().decode(errors="replace")
            if text:
                log.debug("onnxruntime native output:\n%s", text)


def _generate(model_proto: onnx.ModelProto, entries, loss: str, opt: OptimizerConfig, directory: Path) -> None:
    from onnxruntime.training import artifacts

    trainable = [n for e in entries if e.trainable_numel for n in
                 ([e.onnx_names["trained"]] if e.is_split else [e.onnx_names["value"]])]
    frozen = [i.name for i in model_proto.graph.initializer if i.name not in set(trainable)]
    try:
        with _native_stderr_to_log():
            artifacts.generate_artifacts(
                model_proto, requires_grad=trainable, frozen_params=frozen, loss=loss_block(loss),
                optimizer=optimizer_block(opt), artifact_directory=directory,
                additional_output_names=[OUTPUT_NAME],
            )
    except RuntimeError as e:
        m = re.search(r"has not been registered: (\w+) for node (\S+)", str(e))
        if m:  # every module using the op, not only the first ONNX Runtime met
            op = m.group(1)
            modules = sorted({module_of_node(n.name) for n in model_proto.graph.node if n.op_type == op})
            raise UnsupportedOpError(op, modules, "ONNX Runtime has no gradient for it") from None
        # e.g. a gradient builder that emits an invalid node for this op
        unsupported = unsupported_from_ort_error(e, model_proto, "ONNX Runtime cannot build its gradient")
        if unsupported is None:
            raise
        raise unsupported from None


def _last_layer_without_graph(model: nn.Module, policy: UpdatePolicy) -> UpdatePolicy:
    """The last-layer rule where the model's graph IR (which finds the last layer) cannot be
    built: the module named ``head`` if there is one, else an error naming the rule to write."""
    if not policy.names_last_layer:
        return policy
    if "head" in dict(model.named_modules()):
        return policy.with_last_layer("head")
    raise ValueError("the last-layer policy finds the model's last layer in its graph IR, which cannot be built "
                     "for this model; name the layer to train, e.g. --policy 'classifier=full'")


def _bake_recompute(training_path: Path, model_proto: onnx.ModelProto, graph: Graph,
                    plan: Plan, cost: CostModel) -> tuple[Plan, list[str]]:
    """Rebuild the saved tensors of the plan's recomputed ops in the backward of the training graph.

    The saved tensors are found in the graph ONNX Runtime trains (its artifact generator fuses
    nodes of the exported model, see :mod:`.recompute`), by the op of the exported model that
    produces them; consecutive recomputed ops form one run, rebuilt together.

    Returns:
        The plan carried out and the rebuilt tensors. An op whose tensors cannot be rebuilt (it
        would run a node twice that updates state or draws random numbers) keeps them instead,
        with a warning: the planner plans again with those ops kept (:func:`edgeadapt.sched.refit`),
        which may recompute other ops or take a smaller micro-batch.

    Raises:
        edgeadapt.sched.NoFeasiblePlan: no plan that keeps those ops fits the budget.
    """
    from .recompute import recompute_tensors, saved_tensors_by_op, unrecomputable

    model = onnx.load(training_path)
    tensor_ops = {t: op for op, nodes in node_groups(model_proto, graph).items() for n in nodes for t in n.output if t}
    order = [op.name for op in graph.ops]
    saved = saved_tensors_by_op(model, tensor_ops, order)
    for name in sorted(set(plan.recomputed) - saved.keys(), key=order.index):
        log.info("recompute: %s keeps nothing in the training graph (its saved tensors are graph inputs or "
                 "internal to a node ONNX Runtime fused); nothing to rebuild", name)
    kept: set[str] = set()
    while True:
        recomputed = set(plan.recomputed)
        runs: list[list[str]] = [[]]
        for op in graph.ops:  # a kept op with saved tensors ends a run
            if op.name in saved:
                if op.name in recomputed:
                    runs[-1].extend(saved[op.name])
                elif runs[-1]:
                    runs.append([])
        blocked = unrecomputable(model, runs)
        if not blocked:
            break
        owners = {op for op, tensors in saved.items() if blocked.keys() & set(tensors)}
        log.warning("recompute: keeping %s: rebuilding %s would run %s twice (state update or random draw); "
                    "planning again with them kept", sorted(owners), sorted(blocked), sorted(set(blocked.values())))
        kept |= owners
        plan = refit(graph, plan, keep_activations=kept, cost=cost)
    done = recompute_tensors(model, runs)
    if done:
        onnx.save(model, training_path)
    log.info("recompute: %d saved tensors of %d ops rebuilt in the backward of the training graph",
             len(done), len(recomputed & saved.keys()))
    return plan, done


def resolve_backends(backend: str) -> tuple[str, ...]:
    """The training engines an export writes for ``backend`` (one of :data:`BACKEND_CHOICES`).

    Raises:
        ValueError: an unknown choice, or ``ort-training`` / ``both`` where onnxruntime.training
            is not installed.
    """
    if backend not in BACKEND_CHOICES:
        raise ValueError(f"backend must be one of {BACKEND_CHOICES}, got {backend!r}")
    try:
        has_training = importlib.util.find_spec("onnxruntime.training") is not None
    except (ImportError, ValueError):
        has_training = False
    if backend == "auto":
        return ("ort-training", "portable") if has_training else ("portable",)
    wanted = ("ort-training", "portable") if backend == "both" else (backend,)
    if "ort-training" in wanted and not has_training:
        raise ValueError(f"backend {backend!r} needs onnxruntime-training, which is not installed here (it exists "
                         "for x86_64 with Python <= 3.12); export with backend='portable'")
    return wanted


def _check_portable_budget(trained_model: onnx.ModelProto, backends: tuple[str, ...]) -> None:
    """Refuse a budget the portable engine cannot be held to: its step graph unrolls a recurrent
    op over the time steps (thousands of nodes, whose session state no cost model term counts:
    a GRU over 32 steps held ~30 MiB for 1.1k parameters)."""
    recurrent = sorted({module_of_node(n.name) for n in trained_model.graph.node if n.op_type in RECURRENT_OPS})
    if recurrent:
        raise ValueError(
            f"the memory budget cannot be kept on the portable engine: {', '.join(recurrent)} is a recurrent layer "
            "in the trained part of the model, which its step graph unrolls over every time step. Export with "
            "backend='ort-training' (x86_64, Python <= 3.12), freeze the layer and everything before it so its "
            "features are cached, or export without a memory budget"
            + ("" if backends == ("portable",) else f" (this export writes {list(backends)})"))


def plan_cost(backend: str = "auto") -> CostModel:
    """The cost constants an export with ``backend`` plans with: the device may run any engine
    the bundle holds, so each constant is the largest of those engines' measured ones
    (:meth:`edgeadapt.sched.CostModel.bounding`). Use it to predict or size budgets for such a
    bundle (``minimum_budget(..., cost=plan_cost())``)."""
    return CostModel.bounding(resolve_backends(backend))


def _suffix_example(split, example_input: torch.Tensor) -> np.ndarray:
    """The example batch as the trained graph takes it: the prefix model's features when there is one."""
    if split is None:
        return example_input.numpy()
    session = onnxruntime.InferenceSession(split.prefix.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {INPUT_NAME: example_input.numpy()})[0]


def _draft_manifest(stage: Path, entries, loss: str, opt: OptimizerConfig, batchnorm: str, label,
                    example_input: torch.Tensor, output: torch.Tensor, policy: UpdatePolicy,
                    plan: dict | None = None, graph: dict | None = None, backends: tuple[str, ...] = ("ort-training",),
                    portable_files: dict | None = None, portable: dict | None = None,
                    head: LinearHead | None = None) -> Manifest:
    files = {"masks": "masks.npz"}
    if "ort-training" in backends:
        files.update(ORT_TRAINING_FILES)
    files.update(portable_files or {})
    if (stage / PREFIX_FILE).exists():
        files["prefix_model"] = PREFIX_FILE
    return Manifest(
        files=files,
        sha256={name: sha256_file(stage / name) for name in files.values()},
        input=TensorSpec(INPUT_NAME, (None, *example_input.shape[1:]), "float32"),
        output=TensorSpec(OUTPUT_NAME, (None, *output.shape[1:]), "float32"),
        label=label, loss=loss, optimizer=opt.to_dict(), batchnorm=batchnorm,
        policy=policy.to_dict(), parameters=entries, versions=package_versions(),
        state={"epoch": 0, "step": 0}, plan=plan, graph=graph, backends=backends, portable=portable,
        head=None if head is None else head.to_dict(),
    )


def _eval_head(path: Path, entries) -> LinearHead | None:
    """Make the eval graph at ``path`` also return its linear head's input (rewritten in place);
    the head, or ``None`` when the model ends in no linear head (label-free prototypes then build
    a session of their own)."""
    model = onnx.load(path)
    head = add_head_output(model, {n for e in entries for n in e.onnx_names.values()}, OUTPUT_NAME)
    if head is not None:
        onnx.save(model, path)
    return head


def _common_head(heads: dict[str, LinearHead | None], backends: tuple[str, ...]) -> LinearHead | None:
    """The head every engine in ``backends`` found in its eval graph, if they agree."""
    found = {heads.get(b) for b in backends}
    return found.pop() if len(found) == 1 else None


def export_bundle(
    model: nn.Module,
    example_input: torch.Tensor,
    out_dir: str | Path,
    *,
    policy: UpdatePolicy | None = None,
    loss: str = "cross_entropy",
    optimizer: str | OptimizerConfig = "adamw",
    batchnorm: str = "frozen",
    memory_budget: int | str | None = None,
    n_windows: int = 128,
    batch_windows: int = 32,
    importance: dict[str, float] | None = None,
    cache_features: bool | None = None,
    recompute: bool = False,
    progress: bool = False,
    backend: str = "auto",
) -> Manifest:
    """Export ``model`` to an on-device training bundle at ``out_dir``.

    Args:
        model: the source model; it is deep-copied and never modified.
        example_input: one batch, float32, shape (batch, ...); axis 0 becomes dynamic.
        out_dir: the bundle directory to create; it must not exist. Written atomically: on any
            error nothing is left at ``out_dir``.
        policy: which parameters / biases / channels train; default: the model's last layer only
            (``UpdatePolicy.last_layer()``: the module whose parameters lie nearest the output).
        loss: one of ``cross_entropy``, ``mse``, ``bce_with_logits``, ``entropy`` (label-free).
        optimizer: ``"adamw"``, ``"sgd"`` or an :class:`OptimizerConfig`.
        batchnorm: ``"frozen"`` (running statistics fixed; default) or ``"batch"`` (ONNX Runtime
            trains with batch statistics and updates the running ones).
        memory_budget: bound on the peak memory of one whole ``Runner.adapt`` call over
            ``n_windows`` windows (bytes, or a string such as ``"512KiB"``). With ``policy`` the
            policy is checked (and micro-batching, feature caching and recompute chosen to fit
            it); without, the planner picks what trains. ``None``: no bound.
        n_windows: adaptation windows the plan is made for (the size of the feature cache).
        batch_windows: windows per optimizer step the plan is made for.
        importance: for a budget without a policy: importance per parameter name (higher trains
            first); default: measured on ``example_input``.
        cache_features: without a budget, force (True) or forbid (False) running the frozen
            prefix once per ``adapt`` call with its features cached; ``None``: when the
            predicted peak is lower.
        recompute: with a budget, let the planner recompute saved activations in the backward
            instead of keeping them. Off by default: measured with ONNX Runtime 1.19.2, the
            recomputed graph keeps fewer bytes for the backward but ONNX Runtime's buffer reuse
            often holds the freed buffers anyway, so the step's peak did not reliably fall
            (docs/scheduler.md).
        backend: which training engines the bundle holds: ``"ort-training"`` (ONNX Runtime
            training artifacts), ``"portable"`` (step graphs in standard ONNX ops for stock
            onnxruntime: :mod:`.portable`), ``"both"``, or ``"auto"``: both where
            onnxruntime.training is installed, portable alone where not (nothing from
            onnxruntime.training is imported then). The portable graphs keep every activation
            the backward reads: a plan's recompute is carried out by the ort-training graphs only
            (``manifest.portable["recompute"]`` is false), and a portable-only export is planned
            without recompute.
        progress: show the export's stages (:data:`EXPORT_STAGES`) as a tqdm bar on stderr; each
            stage's time is logged at INFO either way.

    Returns:
        The manifest written into the bundle.

    The manifest records the plan (``plan``, with ``predicted_peak_bytes``: the predicted peak of
    a whole ``adapt`` call over ``n_windows`` windows) and the graph IR of the model (``graph``).
    When the plan caches the frozen prefix's features, the bundle holds ``prefix_model.onnx``
    (``input`` -> ``features``) and its training and eval models take ``features``. The plan's
    recomputed activations are rebuilt in the training graph's backward (:mod:`.recompute`);
    where ONNX Runtime cannot carry that out (a rebuild would rerun a state update, or its
    training step with the rebuilt tensors stops reproducing torch), those activations are kept,
    with a warning, and the planner plans again under that constraint
    (:func:`edgeadapt.sched.refit`: another micro-batch or other recomputed ops may fit the
    budget). The exporter never edits a plan: every plan it records was made and verified by
    :mod:`edgeadapt.sched`.

    Raises:
        UnsupportedOpError: an op cannot be exported or differentiated (names op and module).
        ValueError: bad arguments (a model whose forward takes more than one input among them),
            with the fix in the message.
        FileExistsError: ``out_dir`` exists.
        edgeadapt.sched.NoFeasiblePlan: no plan fits ``memory_budget``; names the smallest budget
            that would.
        edgeadapt.sched.BudgetExceeded: ``policy`` does not fit ``memory_budget``, with the numbers.
    """
    budget_bytes = None if memory_budget is None else parse_bytes(memory_budget)
    given_policy = policy
    opt = OptimizerConfig(optimizer) if isinstance(optimizer, str) else optimizer
    if loss not in LOSSES:
        raise ValueError(f"loss must be one of {LOSSES}, got {loss!r}")
    _check_one_input(model, example_input)
    if not isinstance(example_input, torch.Tensor) or example_input.dtype != torch.float32 or example_input.dim() < 2:
        raise ValueError("example_input must be a float32 torch.Tensor of shape (batch, ...)")
    if Path(out_dir).exists():
        raise FileExistsError(f"{out_dir} already exists; choose a new bundle directory or remove it")
    backends = resolve_backends(backend)
    with Stages("export", len(EXPORT_STAGES), progress=progress) as stages:
        return _export(model, example_input, out_dir, given_policy=given_policy, loss=loss, opt=opt,
                       batchnorm=batchnorm, budget_bytes=budget_bytes, n_windows=n_windows,
                       batch_windows=batch_windows, importance=importance, cache_features=cache_features,
                       recompute=recompute, stages=stages, backends=backends, auto=backend == "auto")


def _export(model: nn.Module, example_input: torch.Tensor, out_dir: str | Path, *, given_policy: UpdatePolicy | None,
            loss: str, opt: OptimizerConfig, batchnorm: str, budget_bytes: int | None, n_windows: int,
            batch_windows: int, importance: dict[str, float] | None, cache_features: bool | None, recompute: bool,
            stages: Stages, backends: tuple[str, ...], auto: bool = False) -> Manifest:
    """:func:`export_bundle` once its arguments are checked, reporting :data:`EXPORT_STAGES` to ``stages``."""
    stages.start(EXPORT_STAGES[0])
    try:
        with torch.no_grad():
            reference = copy.deepcopy(model).eval()(example_input)  # never flip the caller's mode
    except TypeError as e:  # e.g. forward(*inputs) wanting two
        raise ValueError(f"calling the model on the example input (one tensor of shape {list(example_input.shape)}) "
                         f"raised TypeError: {e}; if it takes more than one input: {_ONE_INPUT}") from e
    if not isinstance(reference, torch.Tensor):
        raise ValueError("the model must return a single tensor (logits or regression output)")
    label = _label_spec(loss, tuple(reference.shape))

    # Only the ort-training graphs rebuild activations: a portable-only bundle is planned without recompute.
    recompute = recompute and "ort-training" in backends
    cost = CostModel.bounding(backends)
    planned = plan_export(model, example_input, policy=given_policy, budget_bytes=budget_bytes, batchnorm=batchnorm,
                          optimizer=opt.name, n_windows=n_windows, batch_windows=batch_windows, importance=importance,
                          cache_features=cache_features, loss=loss, recompute=recompute, cost=cost,
                          on_stage=stages.start)
    plan, graph = planned.plan, planned.graph
    policy = given_policy
    if plan is None:  # no graph IR for this model: the policy as given, no plan recorded
        policy = _last_layer_without_graph(model, policy or UpdatePolicy.last_layer())
        prepared = prepare_model(model, policy, batchnorm)
    else:
        if policy is None:  # recorded for reports; the plan in the manifest is what the bundle carries out
            policy = policy_of_plan(graph, plan)
        policy = resolve_last_layer(graph, policy)
        prepared = prepare_from_plan(model, plan, batchnorm)
        check_entries(plan, prepared.entries)
    with torch.no_grad():
        output = prepared.module(example_input)
    gap = float((output - reference).abs().max())
    if gap > REWRITE_TOLERANCE:
        raise RuntimeError(f"internal: the rewritten model differs from the original by {gap:.3g}")

    stages.start(EXPORT_STAGES[2])
    model_proto, entries = to_onnx(prepared.module, example_input, prepared.entries, INPUT_NAME, OUTPUT_NAME)
    split, plan = (None, None) if plan is None else cut_model(model_proto, graph, plan, entries, batchnorm,
                                                              allow_remat=recompute, cost=cost)
    onnxruntime.set_default_logger_severity(3)
    stages.start(EXPORT_STAGES[3])
    if budget_bytes is not None and "portable" in backends:
        _check_portable_budget(model_proto if split is None else split.suffix, backends)
    with staged_directory(out_dir) as stage:
        if split is not None:
            onnx.save(split.prefix, stage / PREFIX_FILE)
        trained_model = model_proto if split is None else split.suffix
        plain_training, recomputed = b"", []
        heads: dict[str, LinearHead | None] = {}  # per engine: the head its eval graph also returns
        training_path = stage / ORT_TRAINING_FILES["training_model"]
        if "ort-training" in backends:
            _generate(trained_model, entries, loss, opt, stage)
            check_grouped_conv_grads(onnx.load(training_path, load_external_data=False))
            opt_path = stage / "optimizer_model.onnx"
            opt_model = onnx.load(opt_path)
            if use_torch_adamw(opt_model):
                onnx.save(opt_model, opt_path)
            heads["ort-training"] = _eval_head(stage / ORT_TRAINING_FILES["eval_model"], entries)
            if plan is not None and plan.recomputed:
                plain_training = training_path.read_bytes()
                plan, recomputed = _bake_recompute(training_path, model_proto, graph, plan, cost)
            for f in (*(ORT_TRAINING_FILES[r] for r in ("training_model", "eval_model", "optimizer_model")),
                      *([PREFIX_FILE] if split else [])):
                ir = onnx.load(stage / f, load_external_data=False).ir_version
                if ir > MAX_IR_VERSION:
                    raise RuntimeError(
                        f"{f} has ONNX IR version {ir}; ONNX Runtime 1.19.2 loads <= {MAX_IR_VERSION}. "
                        "Install onnx==1.17.0 (pip install \".[server]\" in an edgeadapt checkout)"
                    )
            if label is not None:  # ORT's loss blocks name their label input ("labels" or "target"): record theirs
                train_inputs = onnx.load(training_path, load_external_data=False).graph.input
                label = {**label, "name": train_inputs[1].name}
        np.savez(stage / "masks.npz", **channel_masks(entries, prepared.trained_channels))
        portable = None
        if "portable" in backends:
            portable = write_portable(stage, trained_model, entries, loss, batchnorm, opt.to_dict(),
                                      _suffix_example(split, example_input),
                                      example_labels(loss, label, len(example_input)))
            heads["portable"] = portable.head

        def draft_for(plan: Plan | None, recomputed: bool) -> Manifest:
            draft = _draft_manifest(stage, entries, loss, opt, batchnorm, label, example_input, output, policy,
                                    plan=None if plan is None else manifest_plan(plan, batchnorm, graph, backends),
                                    graph=None if graph is None else graph.to_dict(), backends=backends,
                                    portable_files=None if portable is None else portable.files,
                                    portable=None if portable is None else portable.portable,
                                    head=_common_head(heads, backends))
            if recomputed:  # ORT's common subexpression elimination would merge the copies back
                draft = replace(draft, session={**draft.session, "disable_cse": True})
            return draft

        draft = draft_for(plan, bool(recomputed))
        stages.start(EXPORT_STAGES[4])
        checked_example = check_batch(example_input.numpy())
        manifest = draft
        if "ort-training" in backends:
            try:
                try:
                    session = choose_session(stage, draft, prepared.module, prepared.entries, checked_example)
                except SelfCheckError as e:
                    if not recomputed:
                        raise
                    # ONNX Runtime miscomputes some rewritten graphs (a grouped ConvGrad overwrites a
                    # gradient buffer another branch still reads, depending on the execution order). The
                    # graph without the copies is checked first: if it fails too, the model is the cause.
                    training_path.write_bytes(plain_training)
                    draft = draft_for(plan, False)
                    session = choose_session(stage, draft, prepared.module, prepared.entries, checked_example)
                    log.warning("recompute: ONNX Runtime's training step with the rebuilt tensors does not reproduce "
                                "torch, without them it does; exporting without recompute, planned again (%s)",
                                str(e).splitlines()[0])
                    plan = refit(graph, plan, allow_remat=False, cost=cost)
                    draft = draft_for(plan, False)
                manifest = replace(draft, session=session)
            except SelfCheckError as e:
                if not (auto and portable is not None):
                    raise
                # backend="auto" asks for what works: the portable graphs are checked against torch
                # below on their own; ONNX Runtime's training kernels (e.g. its BatchNorm gradient on
                # inputs with a large offset) are left out.
                log.warning("ONNX Runtime's training engine does not reproduce torch on this model; the bundle "
                            "holds the portable engine only (%s)", str(e).splitlines()[0][:300])
                for f in ORT_TRAINING_FILES.values():
                    (stage / f).unlink(missing_ok=True)
                backends = ("portable",)
                if plan is not None and plan.recomputed:  # only the training engine rebuilds activations
                    plan = refit(graph, plan, allow_remat=False, cost=cost)
                manifest = draft_for(plan, False)
        if portable is not None:
            check_portable(stage, manifest, prepared.module, prepared.entries, checked_example)
        manifest = stamp_contract(stage, manifest)  # last: the graphs record the final settings
        write_manifest(stage, manifest)
    log.info("exported bundle to %s: %d of %d parameter elements train",
             out_dir, manifest.trainable_numel, manifest.total_numel)
    return manifest

