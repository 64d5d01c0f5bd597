"""Pure packing math: pack_segments validity, determinism, quality vs bounds and the exact optimum."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stagectl.collate import CoordGroup, Segment, collate_padded
from stagectl.packing import (
    PackBuffer,
    _pack_evenly,
    pack_into,
    pack_segments,
    packing_lower_bound,
    select_pack,
)
from tests.helpers import fuzz_examples


def optimal_num_packs(lengths: list[int], packing_length: int) -> int:
    """Exact bin packing by DP over subsets: best[mask] = (packs used, fill of the open pack)."""
    n = len(lengths)
    best = [(n + 1, 0)] * (1 << n)
    best[0] = (1, 0)
    for mask in range(1 << n):
        packs, fill = best[mask]
        for i in range(n):
            if mask >> i & 1:
                continue
            nxt = (
                (packs, fill + lengths[i]) if fill + lengths[i] <= packing_length else (packs + 1, lengths[i])
            )
            best[mask | 1 << i] = min(best[mask | 1 << i], nxt)
    return best[-1][0]


@settings(max_examples=fuzz_examples(200), deadline=None)
@given(
    packing_length=st.integers(1, 300),
    data=st.data(),
)
def test_packs_are_valid_and_deterministic(packing_length: int, data: st.DataObject) -> None:
    lengths = data.draw(st.lists(st.integers(1, packing_length), max_size=40))
    packs = pack_segments(lengths, packing_length)
    flat = [i for pack in packs for i in pack]
    assert sorted(flat) == list(range(len(lengths)))  # every segment exactly once
    assert all(sum(lengths[i] for i in pack) <= packing_length for pack in packs)
    assert all(pack == sorted(pack) for pack in packs)
    assert [pack[0] for pack in packs] == sorted(pack[0] for pack in packs)
    assert len(packs) >= packing_lower_bound(lengths, packing_length)
    assert pack_segments(list(lengths), packing_length) == packs


def test_matches_the_exact_optimum_on_random_small_inputs() -> None:
    rng = random.Random(0)
    num_optimal = 0
    for trial in range(150):
        packing_length = rng.choice([100, 512, 1000])
        low = 1 if trial % 2 else packing_length // 5  # half the trials: only big items (hard case)
        lengths = [rng.randint(low, packing_length) for _ in range(rng.randint(1, 11))]
        opt = optimal_num_packs(lengths, packing_length)
        got = len(pack_segments(lengths, packing_length))
        assert opt <= got <= opt + 1
        num_optimal += got == opt
    assert num_optimal >= 145


def test_reaches_the_lower_bound_when_segments_are_small() -> None:
    rng = random.Random(1)
    hits = 0
    for _ in range(200):
        lengths = [rng.randint(1, 512) for _ in range(rng.randint(1, 80))]
        hits += len(pack_segments(lengths, 2048)) == packing_lower_bound(lengths, 2048)
    assert hits >= 195


def test_no_worse_than_the_binpacking_package() -> None:
    binpacking = pytest.importorskip("binpacking")
    rng = random.Random(2)
    for _ in range(100):
        lengths = [rng.randint(1, 1024) for _ in range(rng.randint(1, 60))]
        assert len(pack_segments(lengths, 1024)) <= len(binpacking.to_constant_volume(lengths, 1024))


@pytest.mark.parametrize(
    ("lengths", "packing_length", "expected"),
    [
        ([], 10, 0),
        ([10], 10, 1),
        ([6, 6, 6], 10, 3),  # three items longer than L/2
        ([5, 5, 5, 5], 10, 2),
        ([1, 1, 1], 10, 1),
        ([4, 4, 4, 4, 4], 10, 2),  # ceil(20/10)
    ],
)
def test_lower_bound(lengths: list[int], packing_length: int, expected: int) -> None:
    assert packing_lower_bound(lengths, packing_length) == expected


def test_known_packing() -> None:
    lengths = [7, 3, 5, 5, 2, 8]
    packs = pack_segments(lengths, 10)
    assert packs == [[0, 1], [2, 3], [4, 5]]
    assert len(packs) == packing_lower_bound(lengths, 10)


@pytest.mark.parametrize(
    ("lengths", "message"),
    [
        ([3, 11, 2], "segment 1 has length 11 > packing_length 10"),
        ([3, 0], "segment 1 has length 0"),
    ],
)
def test_bad_lengths_name_the_segment(lengths: list[int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        pack_segments(lengths, 10)


def _segment(ids: list[int], weights: list[float] | None = None) -> Segment:
    return Segment(
        input_ids=ids,
        ce_weights=weights if weights is not None else [0.0] + [1.0] * (len(ids) - 1),
        mm_token_type_ids=[0] * len(ids),
        pixel_values=None,
        image_grid_thw=None,
    )


def test_segment_validation() -> None:
    with pytest.raises(ValueError, match="ce_weights 2"):
        _segment([1, 2, 3], [0.0, 1.0])
    with pytest.raises(ValueError, match=r"ce_weights\[0\] must be 0"):
        _segment([1, 2], [1.0, 1.0])
    with pytest.raises(ValueError, match="outside"):
        Segment([1, 2, 3], [0.0, 1, 1], [0, 0, 0], None, None, [CoordGroup((0, 1, 2, 2), (1, 2, 3, 4))])


def test_collate_padded_shapes_and_offsets() -> None:
    a = _segment([5, 6, 7, 8, 9])
    a.coord_groups.append(CoordGroup((1, 2, 3, 4), (10, 20, 30, 40)))
    b = _segment([5, 6, 7])
    b.coord_groups.append(CoordGroup((1, 1, 2, 2), (1, 2, 3, 4)))
    batch = collate_padded([a, b], pad_token_id=0)
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 9], [5, 6, 7, 0, 0]]
    assert batch.attention_mask is not None
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]
    assert batch.ce_weights.tolist() == [[0, 1, 1, 1, 1], [0, 1, 1, 0, 0]]
    # Positions index the flattened (B * L) axis: segment b starts at 5.
    assert batch.coord_positions.tolist() == [[1, 2, 3, 4], [6, 6, 7, 7]]
    assert batch.coord_targets.dtype == torch.long
    assert "position_ids" not in batch.model_inputs()
    assert batch.num_tokens == 8


# ---------------------------------------------------------------- one pack at a time (Channel-A)


def test_select_pack_is_the_exact_best_subset_with_the_oldest_in() -> None:
    rng = random.Random(7)
    for _ in range(400):
        n = rng.randint(1, 9)
        capacity = rng.randint(20, 60)
        lengths = [rng.randint(1, 25) for _ in range(n)]
        if lengths[0] > capacity:
            continue
        chosen = select_pack(lengths, capacity)
        assert chosen[0] == 0 and chosen == sorted(set(chosen))
        best = max(
            lengths[0] + sum(c)
            for r in range(n)
            for c in itertools.combinations(lengths[1:], r)
            if lengths[0] + sum(c) <= capacity
        )
        assert sum(lengths[i] for i in chosen) == best
        assert select_pack(lengths, capacity) == chosen  # deterministic


def test_select_pack_prefers_older_items_among_equal_totals() -> None:
    assert select_pack([5, 3, 3, 3], 8) == [0, 1]
    with pytest.raises(ValueError, match="exceeds the pack capacity"):
        select_pack([9, 1], 8)


def test_pack_buffer_drains_oldest_first_and_fills_packs() -> None:
    buffer: PackBuffer[str] = PackBuffer(100)
    for name, length in [("a", 60), ("b", 50), ("c", 40), ("d", 30), ("e", 10)]:
        buffer.add(name, length)
    assert buffer.num_tokens == 190 and buffer.peek_fill() == 1.0
    assert [k for k, _ in buffer.pop_pack()] == ["a", "c"]  # 60 + 40 = 100
    assert [k for k, _ in buffer.pop_pack()] == ["b", "d", "e"]  # 50 + 30 + 10
    assert len(buffer) == 0
    with pytest.raises(ValueError, match="exceeds packing_length"):
        buffer.add("huge", 101)


def test_pack_into_packs_the_fullest_subsets_where_not_everything_fits() -> None:
    """A burst of the tiny async example (2 packs of 1024, 10 segments of 2096 tokens): the even spread
    packed 1780 tokens (0.87) and left 2 segments; filling one pack at a time with the fullest subset packs
    1947 (0.95) and leaves one."""
    lengths = [167, 209, 197, 209, 239, 239, 149, 239, 239, 209]
    groups, left = pack_into(lengths, 2, 1024)
    assert sum(lengths[i] for g in groups for i in g) == 1947 and left == [6]
    assert all(sum(lengths[i] for i in g) <= 1024 for g in groups)
    rng = random.Random(5)
    for _ in range(200):  # never fewer tokens than the even spread, every segment placed once
        lengths = [rng.randint(1, 400) for _ in range(rng.randint(0, 14))]
        groups, left = pack_into(lengths, 2, 1024)
        even, _ = _pack_evenly(lengths, 2, 1024)
        assert sum(lengths[i] for g in groups for i in g) >= sum(lengths[i] for g in even for i in g)
        assert sorted([i for g in groups for i in g] + left) == list(range(len(lengths)))


def test_pack_into_spreads_evenly_over_the_wanted_packs_and_never_makes_more() -> None:
    assert pack_into([10] * 36, 4, 100) == ([list(range(k, 36, 4)) for k in range(4)], [])  # 9 x 10 each
    assert pack_into([60, 60, 60], 1, 100) == ([[0]], [1, 2])  # too much for 1 pack: the rest is left
    assert pack_into([90, 20], 2, 100) == ([[0], [1]], [])
    assert pack_into([], 3, 100) == ([], [])
    groups, left = pack_into([30, 30, 30], 5, 100)  # more packs than segments: empty ones left out
    assert sorted(len(g) for g in groups) == [1, 1, 1] and left == []
    rng = random.Random(3)
    for _ in range(200):
        lengths = [rng.randint(1, 60) for _ in range(rng.randint(0, 20))]
        groups, left = pack_into(lengths, 3, 100)
        assert len(groups) <= 3 and all(sum(lengths[i] for i in g) <= 100 for g in groups)
        assert sorted([i for g in groups for i in g] + left) == list(range(len(lengths)))
