"""The steps of one prefetcher burst that need none of the thread's own state: one rollout request turned
into segments that remember their place in the B stream, and the burst's segments grouped into its packs.
How many rollouts to ask for is `pacing`; the rounds, the fence and the commit point are `prefetcher`."""

from __future__ import annotations

import time

from stagectl.detection.stats import RolloutStats
from stagectl.packing import pack_into
from stagectl.prefetch.records import BuildSegments, Built, PrefetchCounters, Rollout, Section


def request_rollouts(
    section: Section,
    build_segments: BuildSegments,
    indices: list[int],
    first_pos: int,
    seed: int,
    counters: PrefetchCounters,
) -> tuple[list[Built], RolloutStats]:
    """Roll out the samples `indices` (taken from the B stream at position `first_pos`) at `seed` and build
    their segments: (each kept rollout with its segment and stats, stats of the dropped ones). Timed and
    counted in `counters`."""
    count = len(indices)
    started = time.perf_counter()
    generations = section.rollout(indices, seed)
    counters.requests_total += 1
    counters.request_s += time.perf_counter() - started
    started = time.perf_counter()
    kept, lost = build_segments(indices, generations)
    counters.build_s += time.perf_counter() - started
    counters.rollouts_total += count
    counters.segments_total += len(kept)
    built = [
        (
            Rollout(indices[k], first_pos + k, list(generations[k].token_ids), generations[k].finish_reason),
            segment,
            stats,
        )
        for k, segment, stats in kept
    ]
    return built, lost


def pack_groups(
    lengths: list[int], num_packs: int, packing_length: int, segments_per_pack: int | None
) -> tuple[list[list[int]], list[int]]:
    """(the segment indices of each pack, the indices left over) for a burst of segments of `lengths`:
    at most `num_packs` packs, each at most `packing_length` tokens (`packing.pack_into`), or, under
    `training.packing: false`, of exactly `segments_per_pack` segments in order."""
    if segments_per_pack is None:
        return pack_into(lengths, num_packs, packing_length)
    size = segments_per_pack
    groups = [list(range(k * size, (k + 1) * size)) for k in range(min(num_packs, len(lengths) // size))]
    return groups, list(range(len(groups) * size, len(lengths)))
