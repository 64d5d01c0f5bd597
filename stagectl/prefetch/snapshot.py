"""The async prefetcher's checkpoint state (lossless resume) as plain data: its layout, and rebuilding
saved rollouts into segments and ready packs. No threads, no locks: `Prefetcher.snapshot` and
`Prefetcher.restore` call these under the thread's lock.

- The *commit point* (`commit_point`): the B-stream position, seed counter, tokens-per-rollout estimate
  and counters after the last finished burst (its packs queued, its leftovers carried). The thread
  publishes it at the end of every burst.
- The snapshot (`snapshot_state`): the commit point, the carried leftovers and every queued pack with
  its version and rollouts, read under the same lock, so a checkpoint never sees half a burst: the
  samples of a burst still in flight lie past the saved stream position and are generated again after a
  resume.
- Restore (`rebuild_segments`, `rebuild_packs`): the saved packs and leftovers are rebuilt from their
  rollouts (token ids; the segments are a pure function of them) and queued under the staleness rule
  of an uninterrupted run.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from stagectl.detection.stats import RolloutStats
from stagectl.learner.b_packs import PackBuilder
from stagectl.models.generate import Generation
from stagectl.prefetch.records import Built, PrefetchCounters, ReadyPack, Rollout


def commit_point(
    stream_pos: int, num_chunks: int, tokens_per_rollout: float, counters: PrefetchCounters
) -> dict[str, Any]:
    """The state after the last finished burst, as the snapshot saves it."""
    return {
        "stream_pos": stream_pos,
        "num_chunks": num_chunks,
        "tokens_per_rollout": tokens_per_rollout,
        "counters": asdict(counters),
    }


def snapshot_state(
    committed: dict[str, Any],
    carry: list[Built],
    carry_ver: int,
    entries: list[tuple[int, ReadyPack]],
    queue_counters: dict[str, int],
    shared: dict[int, int] | None,
) -> dict[str, Any]:
    """The rank's async state (ints, floats, strings, lists, dicts): the commit point, the carried
    leftovers and every queued pack (`entries`: (ver, pack) in queue order) with its rollouts."""
    return {
        **committed,
        "carry_ver": carry_ver,
        "carry": [asdict(r) for r, _, _ in carry],
        "packs": [
            {
                "ver": ver,
                "stats": pack.stats.as_list(),
                "rollouts": [asdict(r) for r in pack.rollouts],
            }
            for ver, pack in entries
        ],
        "queue_counters": queue_counters,
        "shared": None if shared is None else sorted(shared.items()),
    }


def rebuild_segments(packs: PackBuilder, rollouts: list[Rollout]) -> list[Built]:
    """The segments of saved rollouts (a pure function of the sample and its tokens)."""
    generations = [Generation(list(r.token_ids), r.finish_reason) for r in rollouts]  # type: ignore[arg-type]
    kept, _ = packs.segments([r.sample for r in rollouts], generations)
    if len(kept) != len(rollouts):
        lost = sorted(set(range(len(rollouts))) - {offset for offset, _, _ in kept})
        raise ValueError(
            f"checkpoint async state: the saved rollouts of samples {[rollouts[k].sample for k in lost]} "
            "no longer make a segment that fits global_max_length (was it lowered?); resume with the "
            "checkpoint's global_max_length"
        )
    return [(rollouts[offset], segment, stats) for offset, segment, stats in kept]


def rebuild_packs(saved_packs: list[dict[str, Any]], packs: PackBuilder) -> list[tuple[int, ReadyPack]]:
    """The snapshot's queued packs as (ver, pack), rebuilt from their rollouts, in saved order."""
    out = []
    for saved in saved_packs:
        built = rebuild_segments(packs, [Rollout(**r) for r in saved["rollouts"]])
        batch = packs.collate([segment for _, segment, _ in built])
        stats = RolloutStats.from_list(saved["stats"])
        ver = int(saved["ver"])
        out.append((ver, ReadyPack(batch, len(built), stats, ver, [r for r, _, _ in built])))
    return out
