"""Small helpers over metric rows (pure): numeric lookups that tolerate missing keys and nulls.

The metrics writers turn non-finite floats into null and add keys over time (B-only, async-only),
so every lookup here answers None for "not there" instead of raising.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

Row = dict[str, Any]


def number(row: Row, key: str) -> float | None:
    """`row[key]` as a finite float, or None (missing, null, bool, text, NaN)."""
    value = row.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def series(rows: Sequence[Row], key: str, x_key: str = "step") -> tuple[list[float], list[float]]:
    """(x, y) over the rows where both `x_key` and `key` are numbers."""
    xs: list[float] = []
    ys: list[float] = []
    for row in rows:
        x, y = number(row, x_key), number(row, key)
        if x is not None and y is not None:
            xs.append(x)
            ys.append(y)
    return xs, ys


def last_number(rows: Sequence[Row], key: str) -> float | None:
    """The value of `key` in the last row that has it (running totals are read this way)."""
    for row in reversed(rows):
        value = number(row, key)
        if value is not None:
            return value
    return None


def mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def ratio(num: float, den: float) -> float | None:
    return num / den if den else None
