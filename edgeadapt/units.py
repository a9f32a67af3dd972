"""Byte sizes, parsed and printed in one place.

:func:`parse_bytes` reads what a user types (``"512KiB"``, ``"2 GiB"``, ``"1.5MB"`` or an int);
:func:`format_bytes` prints a size the one way the project shows sizes (``"1.50 KiB"``). Standard
library only: the torch-free runtime, the planner and the command line all import it.
"""

from __future__ import annotations

import re

__all__ = ["parse_bytes", "format_bytes"]

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_bytes(value: int | str) -> int:
    """Bytes from an int or a string such as ``"512KiB"``, ``"2 GiB"``, ``"1.5MB"``.

    Raises:
        ValueError: not a positive size; the message shows accepted forms.
    """
    if isinstance(value, bool):
        raise ValueError(f"a memory size must be an int or a string like '512KiB', got {value!r}")
    if isinstance(value, int):
        n = value
    elif isinstance(value, float):
        if not (value.is_integer() and value > 0):
            raise ValueError(f"a memory size in bytes must be a whole number > 0, got {value!r}; "
                             "or give a string like '1.5MiB'")
        n = int(value)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMgG]i?[bB]|[bB])?\s*", str(value))
        if not m:
            raise ValueError(f"memory size {value!r} is not understood; use bytes or e.g. '512KiB', '64MiB', '2GiB'")
        n = int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])
    if n <= 0:
        raise ValueError(f"memory size must be > 0 bytes, got {value!r}")
    return n


def format_bytes(n: int | float | None) -> str:
    """``1536`` -> ``"1.50 KiB"``; exact bytes below 1 KiB; ``None`` (not measured) -> ``"-"``."""
    if n is None:
        return "-"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B" if isinstance(n, float) else f"{n} B"
