"""The step of one prefetcher burst that needs none of the thread's own state: one rollout request turned
into segments that remember their place in the B stream (the grouping into packs is the `PackBuilder`'s).
How many rollouts to ask for is `pacing`; the rounds, the fence and the commit point are `prefetcher`."""

from __future__ import annotations

import time

from stagectl.detection.stats import RolloutStats
from stagectl.learner.b_packs import PackBuilder
from stagectl.prefetch.records import Built, PrefetchCounters, Rollout, Section


def request_rollouts(
    section: Section,
    packs: PackBuilder,
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
    kept, lost = packs.segments(indices, generations)
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
