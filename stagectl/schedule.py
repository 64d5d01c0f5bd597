"""The deterministic Channel-A / Channel-B schedule (Bresenham over exact fractions).

Optimizer step `s` (0-indexed, counting optimizer updates) is Channel-B iff
`floor((s + 1) * r) > floor(s * r)`. `r` is a `Fraction` built from the decimal text of `b_ratio`,
never a float: with floats, 0.7 picks a different channel at 16 of the first 1000 steps.
The count of B steps among the first n is therefore exactly `floor(n * r)`.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Literal

from stagectl.config.fractions import as_fraction

Channel = Literal["A", "B"]


def num_b_steps(num_steps: int, b_ratio: float | int | str | Fraction) -> int:
    """Number of Channel-B steps among the first `num_steps` optimizer steps: floor(n * r)."""
    r = as_fraction(b_ratio)
    return (num_steps * r.numerator) // r.denominator


def is_channel_b_step(step: int, b_ratio: float | int | str | Fraction) -> bool:
    """True iff 0-indexed optimizer step `step` is a Channel-B step."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return num_b_steps(step + 1, b_ratio) > num_b_steps(step, b_ratio)


def channel_for_step(step: int, b_ratio: float | int | str | Fraction) -> Channel:
    """ "A" or "B" for 0-indexed optimizer step `step`."""
    return "B" if is_channel_b_step(step, b_ratio) else "A"
