"""The channel schedule: exact Bresenham over fractions."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest

from stagectl.schedule import as_fraction, channel_for_step, is_channel_b_step, num_b_steps

RATIOS = [0, 1, 0.5, 0.05, 0.7, 0.875, "1/3", 0.25, 0.1]


@pytest.mark.parametrize("ratio", RATIOS)
def test_prefix_counts_are_exact_and_within_one(ratio: float | str) -> None:
    r = as_fraction(ratio)
    count = 0
    for n in range(1, 1001):
        count += is_channel_b_step(n - 1, ratio)
        assert count == math.floor(n * r)  # the exact integer formula
        assert abs(count - float(n * r)) < 1  # never drifts from r*n by a whole step
    assert count == num_b_steps(1000, ratio)


def test_fixed_ratios() -> None:
    assert [channel_for_step(s, 0.0) for s in range(6)] == ["A"] * 6
    assert [channel_for_step(s, 1.0) for s in range(6)] == ["B"] * 6
    assert [channel_for_step(s, 0.5) for s in range(4)] == ["A", "B", "A", "B"]
    assert [channel_for_step(s, 0.25) for s in range(8)] == ["A", "A", "A", "B"] * 2


def test_decimal_text_not_float_arithmetic() -> None:
    # Float arithmetic floor((s+1)*0.7) > floor(s*0.7) disagrees with the exact rule at some steps.
    float_counts = [math.floor(n * 0.7) for n in range(1, 1001)]
    exact_counts = [num_b_steps(n, 0.7) for n in range(1, 1001)]
    assert sum(a != b for a, b in zip(float_counts, exact_counts, strict=True)) == 16
    float_rule = [math.floor((s + 1) * 0.7) > math.floor(s * 0.7) for s in range(1000)]
    exact = [is_channel_b_step(s, 0.7) for s in range(1000)]
    assert float_rule != exact
    assert as_fraction(0.7) == Fraction(7, 10)


@pytest.mark.parametrize(
    ("value", "expected"),
    [(0.7, Fraction(7, 10)), ("1/3", Fraction(1, 3)), (1, Fraction(1)), (" 0.05 ", Fraction(1, 20))],
)
def test_as_fraction(value: float | str, expected: Fraction) -> None:
    assert as_fraction(value) == expected


@pytest.mark.parametrize("bad", ["abc", "1/0", True])
def test_as_fraction_rejects(bad: object) -> None:
    with pytest.raises(ValueError, match="b_ratio"):
        as_fraction(bad)  # type: ignore[arg-type]


def test_negative_step_rejected() -> None:
    with pytest.raises(ValueError):
        is_channel_b_step(-1, 0.5)
