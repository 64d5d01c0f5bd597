"""Stage-B sharding: every global batch splits exactly into contiguous per-rank shards."""

from __future__ import annotations

import pytest

from stagectl.stage_b.sharding import epoch_order, global_batches, shard_bounds


@pytest.mark.parametrize("world_size", range(1, 9))
def test_shards_partition_exactly(world_size: int) -> None:
    for n in range(51):
        bounds = [shard_bounds(n, world_size, r) for r in range(world_size)]
        covered = [i for start, count in bounds for i in range(start, start + count)]
        assert covered == list(range(n))  # contiguous, in rank order, no overlap, nothing missing
        counts = [count for _, count in bounds]
        assert max(counts) - min(counts) <= 1
        assert counts == sorted(counts, reverse=True)  # the remainder goes to the lowest ranks


def test_shard_formula() -> None:
    # n=10, W=4: base 2, rem 2 -> counts 3, 3, 2, 2
    assert [shard_bounds(10, 4, r) for r in range(4)] == [(0, 3), (3, 3), (6, 2), (8, 2)]
    assert [shard_bounds(2, 4, r) for r in range(4)] == [(0, 1), (1, 1), (2, 0), (2, 0)]


@pytest.mark.parametrize("per_rank", [1, 2, 3, 5])
@pytest.mark.parametrize("world_size", [1, 2, 3, 8])
def test_global_batches_and_shards_respect_per_rank(per_rank: int, world_size: int) -> None:
    for num_items in range(40):
        batches = global_batches(num_items, per_rank, world_size)
        assert [i for start, end in batches for i in range(start, end)] == list(range(num_items))
        for k, (start, end) in enumerate(batches):
            size = end - start
            if k < len(batches) - 1:
                assert size == per_rank * world_size  # only the final batch may be smaller
            assert 0 < size <= per_rank * world_size
            assert all(shard_bounds(size, world_size, r)[1] <= per_rank for r in range(world_size))


@pytest.mark.parametrize(("n", "world_size", "rank"), [(-1, 2, 0), (4, 0, 0), (4, 2, 2), (4, 2, -1)])
def test_shard_bounds_rejects_bad_arguments(n: int, world_size: int, rank: int) -> None:
    with pytest.raises(ValueError):
        shard_bounds(n, world_size, rank)


def test_epoch_order_is_a_seeded_permutation() -> None:
    order = epoch_order(20, seed=3, epoch=0)
    assert sorted(order) == list(range(20))
    assert order == epoch_order(20, seed=3, epoch=0)
    assert order != epoch_order(20, seed=3, epoch=1)
    assert order != epoch_order(20, seed=4, epoch=0)
