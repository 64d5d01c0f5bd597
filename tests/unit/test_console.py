"""The console's wording helpers."""

from __future__ import annotations

import pytest

from stagectl.console import plural


@pytest.mark.parametrize(
    ("count", "noun", "many", "expected"),
    [
        (1, "reflection", None, "1 reflection"),
        (0, "reflection", None, "0 reflections"),
        (2, "optimizer step", None, "2 optimizer steps"),
        (1, "global batch", "global batches", "1 global batch"),
        (3, "global batch", "global batches", "3 global batches"),
    ],
)
def test_plural(count: int, noun: str, many: str | None, expected: str) -> None:
    assert plural(count, noun, many) == expected
