"""The predicted peak of a label-free adaptation call (``Runner.adapt_unlabeled``, ``adapt_stream``).

Label-free adaptation (:mod:`edgeadapt.runtime.unlabeled`) opens no training session unless it
takes entropy steps. Over the windows it runs passes of three kinds:

* **statistics** passes: the training graph's forward with batch statistics, in a session of its
  own opened on first use and kept open (``statistics_session_bytes`` + ``statistics_op_bytes``
  per op of the training graph), over at most ``stats_windows`` windows (activations scaled by
  ``statistics_activation_factor``);
* **inference** passes through the eval session the runner already holds, over at most
  ``pass_windows`` windows: logits, the head's features, and the safety gate's augmented views,
  built one pass at a time (``view_bytes_per_window`` of temporaries per window while they are
  built, the float32 views alive during the pass);

each session keeps the buffers of its largest pass once it has run one, so from the statistics
passes on both sessions' largest passes stay alive together;
* with entropy steps, optimizer steps as the bundle's plan makes them (:func:`~.cost.predict`).

What the adapter holds throughout (source copies of the tensors it may change, fixed-size sums,
the gate's held-back windows) the caller counts exactly and passes as ``held_bytes``.
Activations of a pass are the graph's largest forward live bytes per window over the whole model
(a prefix model included), with the inference overheads of :meth:`CostModel.activation_bytes`.
"""

from __future__ import annotations

import math

from .cost import CostModel, live_bytes, predict
from .ir import Graph
from .plan import Peak, Plan

__all__ = ["predict_label_free"]


def predict_label_free(graph: Graph, plan: Plan, cost: CostModel, *, held_bytes: int, pass_windows: int,
                       stats_windows: int | None, view_bytes_per_window: int, entropy_steps: bool = False) -> Peak:
    """Predicted peak of one label-free call over the loaded runner (see the module docstring).

    Args:
        graph, plan: the bundle's graph IR and plan.
        cost: the constants of the engine that runs the call.
        held_bytes: what the adapter holds for the whole call.
        pass_windows: windows per inference pass.
        stats_windows: windows per statistics pass (``None``: no statistics passes).
        view_bytes_per_window: temporaries per window while a pass's augmented views are built.
        entropy_steps: the call takes optimizer steps (the plan's training session and steps).
    """
    live = max(live_bytes(graph), default=0)
    # Each session keeps the buffers of its largest pass (its arena) once it has run one: the
    # eval session from the first inference pass on (before any statistics pass), the statistics
    # session from its first pass on. So every phase holds both sessions' largest passes.
    inference = cost.activation_bytes(pass_windows, live, inference=True)
    statistics = 0
    if stats_windows is not None:
        statistics = (cost.statistics_session_bytes + cost.statistics_op_bytes * len(graph.ops)
                      + math.ceil(cost.statistics_activation_factor * stats_windows * live))
    held = held_bytes + inference + statistics
    phases: list[tuple[str, int, str]] = []
    if stats_windows is not None:
        phases.append(("statistics", held, "statistics"))
    # building a pass's augmented views (numpy temporaries), or the float32 views a pass reads
    phases.append(("inference", held + pass_windows * max(view_bytes_per_window, graph.input_bytes), "inference"))
    if entropy_steps:
        step = predict(graph, plan, cost)
        phases.append(("entropy", held + step.peak_bytes, f"entropy:{step.where}"))
    peak, where = max(((v, w) for _, v, w in phases), key=lambda t: t[0])
    return Peak(peak, where, {name: v for name, v, _ in phases})
