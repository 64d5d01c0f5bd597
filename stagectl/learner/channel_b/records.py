"""What the async prefetcher makes and what it calls (a rollout as a checkpoint saves it, a ready pack, the
fenced source of rollouts, a built rollout, the thread's counters), and its checkpoint state (lossless
resume) as plain data: its layout, and rebuilding saved rollouts into segments and ready packs. No threads, no locks: `Prefetcher.snapshot` and
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

from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol, cast

from stagectl.collate import PackedBatch, Segment
from stagectl.detection.stats import RolloutStats
from stagectl.learner.channel_b.packs import PackBuilder
from stagectl.models.generate import FinishReason, Generation


class PrefetchError(RuntimeError):
    """The prefetcher stopped on an error (kept as `__cause__`); raised in the learner."""


@dataclass(frozen=True)
class Rollout:
    """One B-stream sample's rollout: which sample, where in the rank's B stream, and what was generated
    (its segment is a pure function of these, so a checkpoint saves this and rebuilds the segment)."""

    sample: int  # index in the data set
    stream_pos: int  # position in this rank's B stream (from 0, across epochs)
    token_ids: list[int]
    finish_reason: str

    def generation(self) -> Generation:
        """The rollout as the server returned it (what the segment and the Channel-B gallery rebuild from)."""
        return Generation(list(self.token_ids), cast(FinishReason, self.finish_reason))


@dataclass
class ReadyPack:
    """One packed micro-batch of Channel-B segments, all from rollouts of weight version `ver`."""

    batch: PackedBatch
    num_segments: int
    stats: RolloutStats  # of the rollouts whose segments are in this pack
    ver: int
    rollouts: list[Rollout] = field(default_factory=list)  # one per segment, in segment order


class Section(Protocol):
    """Rollouts inside one fenced section: all of one policy version, `ver`."""

    ver: int

    def rollout(self, indices: Sequence[int], seed: int) -> list[Generation]: ...


class VersionedSource(Protocol):
    """Where bursts come from (`rollouts.ServerRollouts`)."""

    def section(self) -> AbstractContextManager[Section]:
        """A fenced section that stays closed (no weight sync) until the `with` block ends."""
        ...


Built = tuple[Rollout, Segment, RolloutStats]


@dataclass
class PrefetchCounters:
    success_total: int = 0  # bursts turned into packs
    fail_total: int = 0
    produced_packs: int = 0
    rollouts_total: int = 0  # rollouts requested and received
    segments_total: int = 0  # of them, turned into segments (too-long ones are dropped)
    carry_dropped_total: int = 0  # segments left over by a burst whose version moved on before the next
    lost_total: int = 0  # B-stream samples taken by a burst that failed (never trained)
    cut_short_total: int = 0  # bursts that skipped their top-ups because a weight sync was waiting
    refused_total: int = 0  # calls refused for a version swapped out since (`in_flight_sync`; samples kept)
    requests_total: int = 0  # rollout requests (`section.rollout` calls; a burst makes 1..MAX_ROUNDS)
    request_s: float = 0.0  # of busy_s, waiting for the server's answers to them
    busy_s: float = 0.0  # time spent waiting on rollouts + building packs
    build_s: float = 0.0  # of it, turning rollouts into segments (parse, match, targets, encode)
    collate_s: float = 0.0  # of it, packing and collating segments into micro-batches
    last_error: str = ""


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
