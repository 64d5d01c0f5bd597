"""The norm-1000 codec and the coordinate token lookup."""

from __future__ import annotations

import pytest

from stagectl.detection.coords import (
    COORD_TOKENS,
    CoordTokenIds,
    bin_of_coord_token,
    bins_to_box,
    box_to_bins,
    coord_token,
    from_bin,
    to_bin,
)
from tests.unit.helpers import toy_tokenizer


@pytest.mark.parametrize("size", [2, 3, 100, 640, 999, 1000, 1001, 4096])
def test_bins_cover_the_axis_and_round_trip_within_half_a_bin(size: int) -> None:
    assert to_bin(0, size) == 0 and to_bin(size - 1, size) == 999
    assert to_bin(-5, size) == 0 and to_bin(size + 50, size) == 999  # clamped
    step = (size - 1) / 999  # pixels per bin
    for x in [0.0, 0.4, 1.0, (size - 1) / 3, (size - 1) / 2, size - 1.5, size - 1.0]:
        assert abs(from_bin(to_bin(x, size), size) - x) <= step / 2 + 1e-9
    assert from_bin(0, size) == 0.0 and from_bin(999, size) == pytest.approx(size - 1)


def test_formula_and_boxes() -> None:
    assert to_bin(320, 641) == round(999 * 320 / 640) == 500
    assert to_bin(7, 1) == 0  # a 1-pixel axis
    assert box_to_bins((0, 0, 639, 479), 640, 480) == (0, 0, 999, 999)
    assert bins_to_box((0, 0, 999, 999), 640, 480) == pytest.approx((0, 0, 639, 479))
    with pytest.raises(ValueError, match="axis size"):
        to_bin(1, 0)


def test_coordinate_tokens() -> None:
    assert coord_token(12) == "<|coord_12|>" and len(set(COORD_TOKENS)) == 1000
    assert COORD_TOKENS[0] == "<|coord_0|>" and COORD_TOKENS[-1] == "<|coord_999|>"
    assert [bin_of_coord_token(t) for t in COORD_TOKENS] == list(range(1000))
    for bad in ["<|coord_012|>", "<|coord_1000|>", " <|coord_1|>", "<|coord_-1|>", "coord_1", "<|coord_|>"]:
        assert bin_of_coord_token(bad) is None
    with pytest.raises(ValueError):
        coord_token(1000)


def test_ids_from_a_table() -> None:
    tok = toy_tokenizer()
    ids = CoordTokenIds.from_table(tok.table)
    assert [tok.table[i] for i in ids.ids] == [t.encode() for t in COORD_TOKENS]
    assert all(ids.bin_of_id[i] == b for b, i in enumerate(ids.ids))
    with pytest.raises(ValueError, match="lacks 1000 coordinate tokens"):
        CoordTokenIds.from_table([bytes([b]) for b in range(256)])
    with pytest.raises(ValueError, match="distinct"):
        CoordTokenIds.from_ids([5] * 1000)
