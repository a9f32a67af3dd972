"""Update policies: parsing, validation, JSON round trip."""

from __future__ import annotations

import numpy as np
import pytest

from edgeadapt.sched.policy import Mode, Rule, UpdatePolicy, resolve_channels


def test_parse_and_round_trip():
    p = UpdatePolicy.parse("head=full, blocks.3.conv=channels:0.25, blocks.2.conv=channels:1+4, *=bias")
    assert p.default is Mode.BIAS
    assert p.rules == (Rule("head", "full"), Rule("blocks.3.conv", "channels", ratio=0.25),
                       Rule("blocks.2.conv", "channels", indices=(1, 4)))
    assert UpdatePolicy.from_dict(p.to_dict()) == p
    assert UpdatePolicy.parse("last-layer") == UpdatePolicy.last_layer()


def test_first_matching_rule_wins_and_types_filter():
    p = UpdatePolicy(rules=(Rule("blocks.0.*", "frozen"), Rule("*", "full", types=("BatchNorm1d",))), default="bias")
    assert p.rule_for("blocks.0.bn", "BatchNorm1d").mode is Mode.FROZEN
    assert p.rule_for("blocks.1.bn", "BatchNorm1d").mode is Mode.FULL
    assert p.rule_for("blocks.1.conv", "Conv1d") is None


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(pattern="a", mode="channels"), "exactly one of indices= or ratio="),
        (dict(pattern="a", mode="channels", ratio=0.0), r"ratio must be in \(0, 1\]"),
        (dict(pattern="a", mode="full", ratio=0.5), "only apply to mode 'channels'"),
        (dict(pattern="a", mode="sometimes"), "not a valid Mode"),
    ],
)
def test_invalid_rules(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Rule(**kwargs)


def test_parse_errors():
    with pytest.raises(ValueError, match="not pattern=mode"):
        UpdatePolicy.parse("head")
    with pytest.raises(ValueError, match="default mode cannot be 'channels'"):
        UpdatePolicy(default="channels")


def test_resolve_channels_by_index_and_ratio():
    w = np.zeros((6, 2))
    w[4] = 3.0
    w[1] = 2.0
    assert resolve_channels(Rule("m", "channels", ratio=0.3), "m", w) == (1, 4)
    assert resolve_channels(Rule("m", "channels", indices=(5, 0, 5)), "m", w) == (0, 5)
    with pytest.raises(ValueError, match=r"channels \[7\] out of range for m which has 6"):
        resolve_channels(Rule("m", "channels", indices=(7,)), "m", w)
