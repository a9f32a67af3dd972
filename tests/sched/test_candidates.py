"""Structured candidate policies: every shape listed once, each resolving over the graph."""

import random

import numpy as np
import pytest

from edgeadapt.sched.candidates import structured_policies, trainable_modules
from edgeadapt.sched.resolve import resolve_params

from .sched_testgraphs import conv_graph


def _trained(graph, policy):
    weights = {p.name: np.random.default_rng(0).standard_normal(p.shape) for p in graph.params}
    return frozenset((pp.name, pp.channels) for pp in resolve_params(graph, policy, weights) if pp.trains)


@pytest.mark.parametrize("seed", range(5))
def test_every_shape_once_and_each_resolves(seed):
    graph = conv_graph(random.Random(seed), n_blocks=1 + seed % 4)
    modules = trainable_modules(graph)
    assert modules[-1] == "head" and modules[0] == "b0.conv"
    policies = structured_policies(graph, channel_ratio=0.25)
    trained = {label: _trained(graph, p) for label, p in policies.items()}
    assert len(set(trained.values())) == len(trained)  # no two candidates train the same thing
    for m in modules:
        only = trained[f"only:{m}"]
        assert {graph.param(n).module for n, _ in only} == {m}
    everything = trained[f"from:{modules[0]}"]
    assert {n for n, _ in everything} == {p.name for p in graph.params}
    for label, t in trained.items():
        if label.startswith("last+") and "@" in label:
            module = label[len("last+"):label.index("@")]
            weight = next(p for p in graph.params if p.module == module and len(p.shape) >= 2)
            assert weight.out_channels >= 16
            (channels,) = [c for n, c in t if n == weight.name]
            assert len(channels) == int(np.ceil(0.25 * weight.out_channels))
        if label.startswith("last+"):
            assert {("head.weight", None), ("head.bias", None)} <= t


def test_channel_ratio_must_be_a_fraction():
    graph = conv_graph(random.Random(0), n_blocks=2)
    for bad in (0.0, 1.0, 1.5):
        with pytest.raises(ValueError, match="channel_ratio"):
            structured_policies(graph, channel_ratio=bad)
