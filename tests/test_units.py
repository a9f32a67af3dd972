"""Byte sizes: the one parser and formatter every module uses (edgeadapt.units)."""

from __future__ import annotations

import pytest

from edgeadapt.units import format_bytes, parse_bytes


@pytest.mark.parametrize("text, expected", [
    (4096, 4096), ("512KiB", 512 * 2**10), ("2 GiB", 2 * 2**30), ("1.5MB", 1_500_000), ("64mib", 64 * 2**20),
    ("100", 100), ("3kb", 3000), (" 7 B ", 7),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["", "12 parsecs", "-1KiB", 0, -5, True, "0.0001B", 1.5, -2.0, float("nan")])
def test_parse_bytes_refuses_what_is_not_a_positive_size(bad):
    with pytest.raises(ValueError, match="memory size"):
        parse_bytes(bad)


@pytest.mark.parametrize("n, text", [
    (0, "0 B"), (1023, "1023 B"), (1024, "1.00 KiB"), (1536, "1.50 KiB"), (3 * 2**20, "3.00 MiB"),
    (5 * 2**30 // 2, "2.50 GiB"), (512.0, "512 B"), (None, "-"),
])
def test_format_bytes(n, text):
    assert format_bytes(n) == text


def test_a_whole_float_is_a_number_of_bytes():
    assert parse_bytes(4096.0) == 4096


def test_format_then_parse_round_trips_whole_units():
    for n in (2**10, 7 * 2**20, 3 * 2**30):
        assert parse_bytes(format_bytes(n).replace(" ", "")) == n
