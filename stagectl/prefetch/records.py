"""What the async prefetcher makes and what it calls: a rollout as a checkpoint saves it, a ready pack, the
fenced source of rollouts, a built rollout, and the thread's counters."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Protocol, cast

from stagectl.collate import PackedBatch, Segment
from stagectl.detection.stats import RolloutStats
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
    """Where bursts come from (`learner.rollouts.ServerRollouts`)."""

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
