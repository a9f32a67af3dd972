"""Recompute in the trained part: rewrite a training graph so chosen forward nodes run twice.

ONNX Runtime's training graph (``training_model.onnx``) holds forward, loss and backward as
plain nodes, and a forward output that a gradient node reads stays alive from its forward
producer until that gradient node runs. For each node the plan marks "recompute", this module
inserts a copy of the node (same op, attributes and inputs, outputs renamed ``<name>__recompute``)
and points every *backward* reader of its outputs at the copy. The original's outputs are then
freed after their last forward reader; the copy recreates them when the backward needs them,
from inputs that are kept anyway (a convolution's input, saved for its own gradient). The copy
is placed just before its first backward reader; ONNX Runtime's default execution order also
runs it there.

Two session settings matter:

* common subexpression elimination would merge a copy back into its original (same op, same
  inputs), undoing the saving: a bundle with recomputed nodes carries ``"disable_cse": true`` in
  its manifest's ``session``, and the runner turns that optimizer off;
* keep ONNX Runtime's default execution order (the priority-based one follows the node list,
  where the gradient builder places the BatchNorm parameter gradients late, which eats the
  saving).

Recompute changes memory, not results: loss and gradients stay bit-identical (tested).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import onnx

__all__ = ["RECOMPUTE_SUFFIX", "backward_nodes", "recompute_nodes"]

log = logging.getLogger(__name__)

RECOMPUTE_SUFFIX = "__recompute"
# Ops that must not run twice: they update state (running statistics) or draw random numbers.
NOT_RECOMPUTABLE = frozenset({"BatchNormInternal", "BatchNormalization", "Dropout", "BitmaskDropout"})


def backward_nodes(graph: onnx.GraphProto) -> set[int]:
    """Indices of the nodes that depend on the loss gradient (the backward pass).

    The gradient builder seeds the backward with ``<loss>_grad`` (the first graph output is the
    loss); every node reachable from it through data flow is part of the backward.
    """
    seed = f"{graph.output[0].name}_grad"
    tainted, out = {seed}, set()
    for i, node in enumerate(graph.node):
        if any(name in tainted for name in node.input):
            out.add(i)
            tainted.update(o for o in node.output if o)
    return out


def recompute_nodes(model: onnx.ModelProto, node_names: Iterable[str]) -> list[str]:
    """Duplicate each named forward node in front of its backward readers (in place).

    Args:
        model: a training model (``training_model.onnx`` as ONNX Runtime's artifact generator
            writes it).
        node_names: forward node names to recompute. A name that is not a forward node, or
            whose outputs no backward node reads (nothing is saved for it), is skipped with a
            debug log line.

    Returns:
        The names of the nodes that were duplicated.

    Raises:
        ValueError: a name is not a node of the graph.
    """
    g = model.graph
    wanted = list(dict.fromkeys(node_names))
    by_name = {n.name: i for i, n in enumerate(g.node)}
    unknown = [n for n in wanted if n not in by_name]
    if unknown:
        raise ValueError(f"recompute: no node named {unknown} in the training graph; "
                         "the plan's activation names must be the exported graph's node names")
    backward = backward_nodes(g)
    insert_before: dict[int, list[onnx.NodeProto]] = {}
    done = []
    for name in wanted:
        idx = by_name[name]
        if idx in backward:
            log.debug("recompute: %s is a backward node; skipped", name)
            continue
        node = g.node[idx]
        if node.op_type in NOT_RECOMPUTABLE:
            log.warning("recompute: %s (%s) updates state or is random and must not run twice; kept", name, node.op_type)
            continue
        outputs = {o for o in node.output if o}
        readers = [i for i in sorted(backward) if outputs & set(g.node[i].input)]
        if not readers:
            log.debug("recompute: no backward node reads the outputs of %s; skipped", name)
            continue
        copy = onnx.NodeProto()
        copy.CopyFrom(node)
        copy.name = node.name + RECOMPUTE_SUFFIX
        del copy.output[:]
        # Every output is renamed (required outputs cannot be dropped); those no reader takes are
        # freed as soon as the copy has run.
        read_by_backward = {o for i in readers for o in g.node[i].input} & outputs
        copy.output.extend(o + RECOMPUTE_SUFFIX if o else "" for o in node.output)
        for i in readers:
            reader = g.node[i]
            for k, inp in enumerate(reader.input):
                if inp in read_by_backward:
                    reader.input[k] = inp + RECOMPUTE_SUFFIX
        insert_before.setdefault(readers[0], []).append(copy)
        done.append(name)
    if insert_before:
        nodes = []
        for i, node in enumerate(g.node):
            nodes.extend(insert_before.get(i, ()))
            nodes.append(node)
        del g.node[:]
        g.node.extend(nodes)
    return done
