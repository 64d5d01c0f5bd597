"""One prefetcher burst: what it is, the step of it that needs none of the thread's own state, and what the
learner may know about the burst in progress.

A burst: the thread asks `pacing` how many packs B steps will still train before the current version goes
stale, takes one B step's worth of them (`gas` packs: the nearest B step first, so it never waits for the
rollouts of a later one), requests the rollouts that fill them to `pack_tokens` each (split into requests
of `rollout_decode_batch_size` sent together; a first request for the whole estimated need, then top-ups
only while the estimate ran high, at most `MAX_ROUNDS` requests; rounded up to whole batches only when
pacing wants a next burst of the same version, which takes what does not fit, and never down:
`pacing.request_size`), and packs the burst's segments into that many packs at once
(`PackBuilder.groups`: `packing.pack_into`, as even as possible, or the fullest subsets where not all fit;
each at most `packing_length`). A burst never makes more packs than pacing asked for: segments that fit
nowhere (rollouts came out longer than estimated) start the next burst if the version has not moved, else
they are dropped and counted. Nothing else is held back, so neither a version change nor a slow server can
strand a pack's worth of rollouts. One request turned into segments that remember their place in the B
stream is `request_rollouts`; the burst's segments made into queued packs is `queue_packs`; the errors
that are server trouble (retried with back-off) are `SERVER_TROUBLE`; the rounds, the fence and the commit
point are `prefetcher`.

`BurstState`, the burst in progress as the learner sees it (`in_flight_sync`), has two spans, because they
answer different questions:
- *in a burst* (`begin` .. `end`): from before the section opens until the burst has queued its packs or
  failed. `wait` waits for it, counting ended bursts, so a waiter returns for the burst it saw even when
  the thread has begun the next one before the waiter wakes.
- *packs coming* (`set_coming` .. `queued`): from the section's start, when its version is known, until
  its packs are in the queue. `version`, `behind` (that version against the shared clock's) and
  `add_coming` read it: a pack is counted as coming or as queued, never both and never neither, because
  the queue's pushes and `queued` happen under the same lock the readers take.
- *the first burst* (from `start` until a burst has ended or the thread has found nothing to make):
  `wait_first` waits for it. The thread starts with the step loop, so a run's (or a resume's) first B
  step would otherwise race the rollouts of its own packs.

The state lives under the prefetcher's lock (passed in), the one its queue pushes and commit point take.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import httpx

from stagectl.detection.stats import RolloutStats
from stagectl.learner.channel_b.clock import VersionClock
from stagectl.learner.channel_b.packs import PackBuilder
from stagectl.learner.channel_b.queue import ReadyPackQueue
from stagectl.learner.channel_b.records import Built, PrefetchCounters, ReadyPack, Rollout, Section
from stagectl.wire.errors import RolloutServerError, WrongVersionError

# a burst that fails with one of these is server trouble: retried with back-off (`pacing.FailurePolicy`)
SERVER_TROUBLE = (RolloutServerError, WrongVersionError, httpx.TransportError, TimeoutError, ConnectionError)


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


def queue_packs(
    packs: PackBuilder,
    queue: ReadyPackQueue[ReadyPack],
    built: list[Built],
    dropped: RolloutStats,
    ver: int,
    num_packs: int,
    counters: PrefetchCounters,
) -> list[Built]:
    """Group the burst's segments `built` into at most `num_packs` packs of version `ver`, collate and queue
    them (the rollouts that made no segment, `dropped`, count in the first pack's stats); returns what fits
    no pack, for the next burst of this version (a burst never makes extra packs)."""
    started = time.perf_counter()
    lengths = [len(segment) for _, segment, _ in built]
    groups, left = packs.groups(lengths, num_packs)
    for k, group in enumerate(groups):
        stats = RolloutStats()
        if k == 0:
            stats.add(dropped)  # rollouts that made no segment still count in the step's metrics
        for i in group:
            stats.add(built[i][2])
        batch = packs.collate([built[i][1] for i in group])
        counters.collate_s += time.perf_counter() - started
        rollouts = [built[i][0] for i in group]
        queue.push(ReadyPack(batch, len(group), stats, ver, rollouts), ver, size=len(group))
        counters.produced_packs += 1
        started = time.perf_counter()
    return [built[i] for i in left]


class BurstState:
    def __init__(self, lock: threading.Lock, clock: VersionClock) -> None:
        self.lock = lock
        self.clock = clock
        self._done = threading.Condition(lock)
        self._in_burst = False
        self._num_ended = 0  # a waiter's mark: the next burst may begin before it wakes up
        self._coming: tuple[int, int] | None = None  # (version, packs) of the burst in progress
        self._idle = False  # the thread found nothing to make since its last burst began

    # the prefetcher's thread, each under `lock`

    def begin(self) -> None:
        self._in_burst = True
        self._idle = False

    def idle(self) -> None:
        """Pacing wants no packs now: a first burst may not come (a waiter for it goes on)."""
        if not self._idle:
            self._idle = True
            self._done.notify_all()

    def set_coming(self, ver: int, num_packs: int) -> None:
        self._coming = (ver, num_packs)

    def queued(self) -> None:
        """The burst's packs are in the queue: counted there from now on."""
        self._coming = None

    def end(self) -> None:
        """The burst has queued what it made, or failed (a second call for the same burst does nothing)."""
        if not self._in_burst:
            return
        self._in_burst = False
        self._coming = None
        self._num_ended += 1
        self._done.notify_all()

    def thread_ended(self) -> None:
        """The thread has ended (stopped or failed): every waiter re-checks its `give_up`."""
        self._done.notify_all()

    # readers (the learner)

    def version(self) -> int | None:
        """The version of the burst in progress, from its section's start until its packs are queued."""
        with self.lock:
            return None if self._coming is None else self._coming[0]

    def behind(self) -> bool:
        """A burst's packs are coming (its section started, its packs not queued yet) at a version older
        than the clock's: the burst began before the last sync."""
        with self.lock:
            return self._coming is not None and self._coming[0] < self.clock.ver

    def add_coming(self, versions: list[int], counts: list[int]) -> None:
        """Add the coming packs to their version's count, in place (call under `lock`, with the counts read
        from the queue under it)."""
        if self._coming is not None and self._coming[0] in versions:
            counts[versions.index(self._coming[0])] += self._coming[1]

    def wait(self, timeout_s: float | None, give_up: Callable[[], bool]) -> bool:
        """Until the burst in progress, if any, has ended or `give_up()` holds; False after `timeout_s`."""
        with self._done:
            if not self._in_burst:
                return True
            mark = self._num_ended
            return self._done.wait_for(lambda: self._num_ended > mark or give_up(), timeout_s)

    def wait_first(self, timeout_s: float | None, give_up: Callable[[], bool]) -> bool:
        """Until the thread's first burst has ended (queued its packs or failed), the thread is idle
        outside a burst, or `give_up()` holds; False after `timeout_s`. At once once a burst has ended."""
        with self._done:
            return self._done.wait_for(
                lambda: self._num_ended > 0 or (self._idle and not self._in_burst) or give_up(), timeout_s
            )
