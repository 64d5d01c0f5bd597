"""Exact ratios from config text: `b_ratio: 0.7` means 7/10, never the float nearest to it."""

from __future__ import annotations

from fractions import Fraction


def as_fraction(b_ratio: float | int | str | Fraction) -> Fraction:
    """Exact value of `b_ratio`: `0.7` -> 7/10 (from its shortest decimal text), `"1/3"` -> 1/3."""
    if isinstance(b_ratio, Fraction):
        return b_ratio
    if isinstance(b_ratio, bool):
        raise ValueError(f"b_ratio must be a number or a fraction text like '1/3', got {b_ratio!r}")
    if isinstance(b_ratio, int | float):
        # repr() gives the shortest decimal text that round-trips, i.e. what the user wrote.
        return Fraction(repr(float(b_ratio)))
    try:
        return Fraction(b_ratio.strip())
    except (ValueError, ZeroDivisionError) as exc:
        raise ValueError(f"b_ratio must be a number or a fraction text like '1/3', got {b_ratio!r}") from exc
