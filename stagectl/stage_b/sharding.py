"""Ticket-parallel batching (pure): the per-epoch order, global batches, and each rank's shard.

A global batch holds `per_rank x world_size` tickets of the epoch order (only the last batch of an
epoch may be smaller). Rank r takes the contiguous shard `[start, start + count)` of it with
`base, rem = divmod(n, world_size)`, `start = r*base + min(r, rem)`, `count = base + (r < rem)`, so
shards differ in size by at most one, never exceed `per_rank`, and concatenated in rank order give
back the batch in order (rank 0 can rebuild the batch order from a plain gather).
"""

from __future__ import annotations

import random


def shard_bounds(n: int, world_size: int, rank: int) -> tuple[int, int]:
    """(start, count) of rank `rank`'s contiguous share of `n` items."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    base, rem = divmod(n, world_size)
    return rank * base + min(rank, rem), base + (rank < rem)


def global_batches(num_items: int, per_rank: int, world_size: int) -> list[tuple[int, int]]:
    """[start, end) ranges of the global batches over `num_items` ordered items."""
    if per_rank < 1 or world_size < 1:
        raise ValueError(f"per_rank and world_size must be >= 1, got {per_rank}, {world_size}")
    size = per_rank * world_size
    return [(start, min(start + size, num_items)) for start in range(0, num_items, size)]


def epoch_order(num_items: int, seed: int, epoch: int) -> list[int]:
    """A seeded permutation of `range(num_items)`, different per epoch, identical across runs."""
    order = list(range(num_items))
    random.Random(f"stage_b:{seed}:{epoch}").shuffle(order)
    return order
