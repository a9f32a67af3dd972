"""Recompute in the trained part: rewrite a training graph so chosen saved tensors are rebuilt.

ONNX Runtime's training graph (``training_model.onnx``) holds forward, loss and backward as
plain nodes. A forward tensor that a gradient node reads is *kept*: it stays alive from its
forward producer until that gradient node runs. Recomputing a kept tensor means its backward
readers read a copy instead, rebuilt in the backward by copies of the forward nodes that
produce it (same op, attributes and inputs, outputs renamed ``<name>__recompute<k>``), walking
back until tensors that are kept anyway (or graph inputs and parameters). The original is then
freed after its last forward reader.

Names come from the graph ONNX Runtime actually trains, not from the exported model: the
artifact generator optimizes the forward before building the gradient (it fuses, e.g., an
exported GELU's ``Div/Erf/Add/Mul/Mul`` into one ``Gelu`` node and a LayerNorm written with
``Pow`` into ``LayerNormalization``), so node names and internal tensors of the exported model
may be gone. A fused node keeps the name of the pattern's final output tensor, and gradient
nodes are named ``<forward node>_Grad/...``; :func:`saved_tensors_by_op` uses both to say which
kept tensors belong to which op of the scheduler's graph. (The session fuses more when it opens,
``MatMul`` + ``Transpose`` into ``FusedMatMul`` for one; that happens after this rewrite, to
originals and copies alike.)

The scheduler recomputes a *run* of consecutive recomputed ops at once: the copies of one run
are shared by its tensors (each copy placed just before its first backward reader), and no
copy is shared between runs, so a copy never outlives its run's backward.

Two session settings matter:

* common subexpression elimination would merge a copy back into its original (same op, same
  inputs), undoing the saving: a bundle with recomputed tensors carries ``"disable_cse": true``
  in its manifest's ``session``, and the runner turns that optimizer off;
* keep ONNX Runtime's default execution order (the priority-based one follows the node list,
  where the gradient builder places the BatchNorm parameter gradients late, which eats the
  saving).

Recompute changes memory, not results: loss and gradients stay bit-identical (tested), except
where ONNX Runtime miscomputes the rewritten graph (a grouped ConvGrad that overwrites a shared
gradient buffer in the new execution order): the export self-check refuses that, and the exporter
then exports without recompute. Whether a step's measured peak falls by the bytes no longer kept
depends on ONNX Runtime's allocation planner (docs/ort_notes.md).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence

import onnx

__all__ = ["RECOMPUTE_SUFFIX", "NOT_RECOMPUTABLE", "backward_nodes", "kept_tensors", "saved_tensors_by_op",
           "unrecomputable", "recompute_tensors"]

log = logging.getLogger(__name__)

RECOMPUTE_SUFFIX = "__recompute"
# Ops that must not run twice: they update state (running statistics) or draw random numbers.
NOT_RECOMPUTABLE = frozenset({
    "BatchNormInternal", "BatchNormalization", "Dropout", "BitmaskDropout", "RandomNormal", "RandomNormalLike",
    "RandomUniform", "RandomUniformLike", "Multinomial", "Bernoulli",
})
# Readers that take only a tensor's shape or size: they re-read no values.
_SHAPE_READERS = frozenset({"Shape", "Size"})
_GRAD_SEPARATOR = "_Grad/"  # ONNX Runtime names gradient nodes "<forward node>_Grad/<op>_<k>"


def backward_nodes(graph: onnx.GraphProto) -> set[int]:
    """Indices of the nodes of the backward pass: every node the forward does not need.

    The forward is what computes the graph outputs that are not gradients (the loss, first, and
    the user outputs): those outputs and everything they depend on. The gradient builder seeds
    the backward with ``<loss>_grad``; nodes reachable from it are backward, and so are helper
    nodes that read only forward tensors for a gradient (the ``Shape``/``Size`` of a saved
    input, a ``Reshape`` of it for a ``Gemm``): ONNX Runtime may run those late, so a tensor
    they read is kept for the backward like one a gradient node reads.
    """
    tainted = {f"{graph.output[0].name}_grad"}
    producer: dict[str, int] = {}
    for i, node in enumerate(graph.node):
        if any(name in tainted for name in node.input):
            tainted.update(o for o in node.output if o)
        for o in node.output:
            if o:
                producer[o] = i
    forward: set[int] = set()
    stack = [producer[o.name] for o in graph.output if o.name in producer and o.name not in tainted]
    while stack:
        i = stack.pop()
        if i not in forward:
            forward.add(i)
            stack.extend(producer[t] for t in graph.node[i].input if t in producer)
    return set(range(len(graph.node))) - forward


def _forward_producers(graph: onnx.GraphProto, backward: set[int]) -> dict[str, int]:
    return {t: i for i, n in enumerate(graph.node) if i not in backward for t in n.output if t}


def kept_tensors(graph: onnx.GraphProto) -> dict[str, list[int]]:
    """Tensors a forward node produces and a backward node reads, with those readers' indices
    (ascending): what the training step keeps from its forward for its backward. Shapes and
    sizes (outputs of ``Shape``/``Size``, a few bytes) are left out: they are never rebuilt."""
    backward = backward_nodes(graph)
    produced = {t: i for t, i in _forward_producers(graph, backward).items()
                if graph.node[i].op_type not in _SHAPE_READERS}
    kept: dict[str, list[int]] = {}
    for i in sorted(backward):
        for t in dict.fromkeys(graph.node[i].input):
            if t in produced:
                kept.setdefault(t, []).append(i)
    return kept


def saved_tensors_by_op(model: onnx.ModelProto, tensor_ops: Mapping[str, str],
                        op_order: Sequence[str]) -> dict[str, list[str]]:
    """The kept tensors of a training graph, by the scheduler op that saves them.

    The scheduler's rule (:mod:`.sched_graph`): a saved tensor belongs to the last op whose
    backward re-reads it. Here, on the graph ONNX Runtime trains:

    * each forward node gets the op of a tensor it produces (``tensor_ops``, from the exported
      model: a fused node carries its pattern's final output name); a node producing only new
      tensors gets the op of its first consumer (in ``op_order``);
    * each gradient node gets the op of its forward node (by its name, ``<forward>_Grad/...``);
    * a kept tensor belongs to the last op (in ``op_order``) with a gradient node reading it;
      when no reader resolves, to the last op reading it in the forward, else its producer's.

    Only activations count: tensors computed from the data input (``graph.input[0]``) that the
    backward reads for their values (not a weight's transpose, not a tensor whose only backward
    readers take its shape).

    Args:
        model: the training model.
        tensor_ops: tensor name -> op name, for the tensors the ops of the exported model produce.
        op_order: op names in execution order.

    Returns:
        op name -> its kept tensors (in graph order); ops keeping nothing are absent.
    """
    g = model.graph
    rank = {name: k for k, name in enumerate(op_order)}
    backward = backward_nodes(g)
    forward = [i for i in range(len(g.node)) if i not in backward]
    node_op: dict[int, str] = {}
    for i in forward:
        ops = [tensor_ops[t] for t in g.node[i].output if t in tensor_ops]
        if ops:
            node_op[i] = max(ops, key=rank.__getitem__)
    readers: dict[str, list[int]] = {}
    for i in forward:
        for t in g.node[i].input:
            readers.setdefault(t, []).append(i)
    for i in reversed(forward):  # new tensors (a fusion's intermediates): the op of their consumer
        if i not in node_op:
            ops = [node_op[j] for t in g.node[i].output for j in readers.get(t, ()) if j in node_op]
            if ops:
                node_op[i] = min(ops, key=rank.__getitem__)
    op_of_name = {g.node[i].name: op for i, op in node_op.items() if g.node[i].name}

    def last(ops: Iterable[str | None]) -> str | None:
        return max((op for op in ops if op is not None), key=rank.__getitem__, default=None)

    produced = _forward_producers(g, backward)
    per_window = {g.input[0].name}
    for i in forward:
        if any(t in per_window for t in g.node[i].input):
            per_window.update(t for t in g.node[i].output if t)
    by_op: dict[str, list[str]] = {}
    for t, grad_readers in kept_tensors(g).items():
        if t not in per_window or all(g.node[i].op_type in _SHAPE_READERS for i in grad_readers):
            continue  # a parameter's transform, or read for its shape only: not an activation to free
        owner = last(op_of_name.get(g.node[i].name.rpartition(_GRAD_SEPARATOR)[0]) for i in grad_readers
                     if _GRAD_SEPARATOR in g.node[i].name)
        owner = owner or last(node_op.get(i) for i in readers.get(t, ())
                              if g.node[i].op_type not in _SHAPE_READERS)
        owner = owner or node_op.get(produced[t])
        if owner is None:
            log.debug("recompute: kept tensor %s belongs to no op of the plan's graph", t)
            continue
        by_op.setdefault(owner, []).append(t)
    return by_op


class _Rebuild:
    """The forward nodes that rebuild each run's tensors in the backward (no graph change)."""

    def __init__(self, graph: onnx.GraphProto, runs: Sequence[Sequence[str]]):
        self.graph = graph
        self.backward = backward_nodes(graph)
        self.producer = _forward_producers(graph, self.backward)
        self.kept = kept_tensors(graph)
        # A run's tensor that the backward does not read (or a graph input) is freed anyway; one it
        # reads only for its shape stays kept: rebuilding it would cost its forward for a shape.
        self.runs = [[t for t in dict.fromkeys(run) if t in self.kept and not self._shape_only(t)] for run in runs]
        self.dropped = {t for run in self.runs for t in run}
        self.needed: list[list[int]] = []  # per run, the forward nodes to copy (ascending)
        self.blocked: dict[str, str] = {}  # tensor -> node that must not run twice
        self._blocker: dict[int, str | None] = {}
        for run in self.runs:
            nodes: set[int] = set()
            for target in run:
                blocker = self.blocker(self.producer[target])
                if blocker is not None:
                    self.blocked[target] = blocker
                    continue
                stack = [self.producer[target]]
                while stack:
                    p = stack.pop()
                    if p not in nodes:
                        nodes.add(p)
                        stack.extend(self._inputs_to_rebuild(p))
            self.needed.append(sorted(nodes))

    def _inputs_to_rebuild(self, node: int) -> list[int]:
        return [self.producer[t] for t in self.graph.node[node].input if not self.available(t)]

    def blocker(self, node: int) -> str | None:
        """A node that must not run twice among those rebuilding ``node``'s outputs, or ``None``."""
        stack = [node]
        while stack:  # post-order: a node is decided once the nodes it reads from are
            i = stack[-1]
            if i in self._blocker:
                stack.pop()
                continue
            n = self.graph.node[i]
            if n.op_type in NOT_RECOMPUTABLE:
                self._blocker[i] = n.name or n.op_type
                stack.pop()
                continue
            todo = [j for j in self._inputs_to_rebuild(i) if j not in self._blocker]
            if todo:
                stack.extend(todo)
                continue
            self._blocker[i] = next((b for j in self._inputs_to_rebuild(i) if (b := self._blocker[j])), None)
            stack.pop()
        return self._blocker[node]

    def _shape_only(self, tensor: str) -> bool:
        return all(self.graph.node[i].op_type in _SHAPE_READERS for i in self.kept[tensor])

    def available(self, tensor: str) -> bool:
        """Whether the backward has ``tensor`` without rebuilding it: a graph input or parameter,
        a kept tensor not dropped, or a shape or size (its original stays alive, a few bytes)."""
        if not tensor or tensor not in self.producer:
            return True
        if self.graph.node[self.producer[tensor]].op_type in _SHAPE_READERS:
            return True
        return tensor in self.kept and tensor not in self.dropped


def unrecomputable(model: onnx.ModelProto, runs: Sequence[Sequence[str]]) -> dict[str, str]:
    """The tensors of ``runs`` that cannot be rebuilt, each with the node in the way: rebuilding
    it would run a node twice that updates state or draws random numbers."""
    return _Rebuild(model.graph, runs).blocked


def recompute_tensors(model: onnx.ModelProto, runs: Sequence[Sequence[str]]) -> list[str]:
    """Rebuild the kept tensors of each run in the backward instead of keeping them (in place).

    Args:
        model: a training model (``training_model.onnx`` as ONNX Runtime's artifact generator
            writes it).
        runs: tensor names, grouped in runs: a run's tensors share their rebuilding copies. A
            name that no backward node reads, or that is a graph input, is already not kept: it
            is skipped.

    Returns:
        The tensors that are now rebuilt (graph order within each run).

    Raises:
        ValueError: rebuilding a tensor needs a node that must not run twice (see
            :func:`unrecomputable`).
    """
    g = model.graph
    rebuild = _Rebuild(g, runs)
    if rebuild.blocked:
        raise ValueError("recompute: rebuilding " + ", ".join(f"{t} needs {n}" for t, n in rebuild.blocked.items())
                         + ", which must not run twice (it updates state or draws random numbers); keep them")
    insert_before: dict[int, list[onnx.NodeProto]] = {}
    done: list[str] = []
    for k, (run, needed) in enumerate(zip(rebuild.runs, rebuild.needed)):
        suffix = f"{RECOMPUTE_SUFFIX}{k}"
        targets = set(run)
        consumers: dict[str, list[int]] = {}
        for i in needed:
            for t in g.node[i].input:
                if not rebuild.available(t):
                    consumers.setdefault(t, []).append(i)
        first_use: dict[int, int] = {}
        for i in reversed(needed):  # a copy runs before its first reader, backward node or copy
            outs = [t for t in g.node[i].output if t]
            first_use[i] = min([rebuild.kept[t][0] for t in outs if t in targets]
                               + [first_use[j] for t in outs for j in consumers.get(t, ())])
        for i in needed:
            copy = onnx.NodeProto()
            copy.CopyFrom(g.node[i])
            copy.name = (copy.name or copy.op_type) + suffix
            for n, t in enumerate(copy.input):
                if not rebuild.available(t):
                    copy.input[n] = t + suffix
            for n, t in enumerate(copy.output):
                if t:
                    copy.output[n] = t + suffix
            insert_before.setdefault(first_use[i], []).append(copy)
        for t in run:
            for i in rebuild.kept[t]:
                reader = g.node[i]
                for n, name in enumerate(reader.input):
                    if name == t:
                        reader.input[n] = t + suffix
        done.extend(run)
        log.debug("recompute: run %d rebuilds %s with %d copied nodes", k, run, len(needed))
    if insert_before:
        nodes = []
        for i, node in enumerate(g.node):
            nodes.extend(insert_before.get(i, ()))
            nodes.append(node)
        del g.node[:]
        g.node.extend(nodes)
    return done
