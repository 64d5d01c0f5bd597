"""The async Channel-B prefetcher: one background thread per learner rank that turns rollouts into
ready packs (rollout -> parse -> match -> targets -> encode -> pack), tagged with the weight version
that generated them, in the rank's bounded `ReadyPackQueue`.

- Pack size: a ready pack holds `segments_per_pack` segments (the per-device batch size, so a B
  micro-batch mirrors an A micro-batch), fewer when they would exceed `packing_length`.
- Pacing: no new rollout is requested while queued + buffered packs reach `target_packs`.
- Version purity: a pack holds segments of one version only; when the version moves, leftover
  segments of the old version are flushed into old-version packs first (the queue drops them if they
  are already stale).
- Errors: server trouble (connection, timeout, 5xx) is counted and retried with back-off, so the
  learner keeps training Channel-A while the server is away; once an outage outlasts
  `outage_timeout_s`, or after `max_consecutive_failures` other failures in a row, the error is
  handed to the learner, which re-raises it (`raise_if_failed`). A background thread never swallows
  an error.
- Shutdown: the owner sets the stop event (`request_stop`), closes the HTTP client (which ends a
  call in flight), then joins (`join`) with a deadline; a failure caused by the shutdown itself is
  not an error. A thread still alive after the deadline is an error the owner raises.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import httpx

from stagectl.data.sampler import ShardedSampler
from stagectl.learner.channel_b import RolloutStats
from stagectl.learner.rollout_server import VersionedRollouts
from stagectl.models.generate import Generation
from stagectl.packing import PackedBatch, Segment, pack_segments
from stagectl.prefetch.queue import ReadyPackQueue
from stagectl.rollout.client import RolloutServerError

INJECT_FAULT_ENV = "STAGECTL_INJECT_PREFETCH_FAULT_RANK"  # testing aid: this rank's prefetcher raises


@dataclass
class ReadyPack:
    """One packed micro-batch of Channel-B segments, all from rollouts of weight version `ver`."""

    batch: PackedBatch
    num_segments: int
    stats: RolloutStats
    ver: int


@dataclass
class PrefetchCounters:
    success_total: int = 0  # rollout chunks turned into segments
    fail_total: int = 0
    produced_packs: int = 0
    rollouts_total: int = 0
    busy_s: float = 0.0  # time spent waiting on rollouts + building packs
    last_error: str = ""


class VersionedSource(Protocol):
    """What the prefetcher needs from a rollout source (`learner.rollout_server.ServerRollouts`)."""

    def rollout_versioned(self, indices: Sequence[int], seed: int) -> VersionedRollouts: ...


BuildSegment = Callable[[int, Generation], tuple[Segment | None, RolloutStats]]


@dataclass
class _Buffered:
    segment: Segment
    stats: RolloutStats


@dataclass
class Prefetcher:
    source: VersionedSource
    build_segment: BuildSegment
    collate: Callable[[list[Segment]], PackedBatch]
    sampler: ShardedSampler
    queue: ReadyPackQueue[ReadyPack]
    current_ver: Callable[[], int]
    chunk_size: int
    packing_length: int
    target_packs: int
    max_consecutive_failures: int
    outage_timeout_s: float
    seed: int
    rank: int
    segments_per_pack: int
    num_chunks: int = 0  # rollout chunks requested so far (seeds derive from it; restored on resume)
    counters: PrefetchCounters = field(default_factory=PrefetchCounters)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._buffer: list[_Buffered] = []
        self._buffer_ver = -1
        self._consecutive = 0
        self._outage_since: float | None = None
        self._inject = os.environ.get(INJECT_FAULT_ENV) == str(self.rank)
        self._thread = threading.Thread(target=self._run, name=f"prefetcher-rank{self.rank}", daemon=True)

    # ------------------------------------------------------------------ owner side

    def start(self) -> None:
        self._thread.start()

    def request_stop(self) -> None:
        """Ask the thread to stop after the current rollout call (close the client to end that call)."""
        self._stop.set()

    def join(self, deadline_s: float) -> bool:
        """Wait for the thread to end; False if it is still alive after `deadline_s`."""
        if self._thread.is_alive():
            self._thread.join(deadline_s)
        return not self._thread.is_alive()

    def stop(self, deadline_s: float = 30.0) -> bool:
        """`request_stop` then `join`."""
        self.request_stop()
        return self.join(deadline_s)

    @property
    def thread_ident(self) -> int | None:
        return self._thread.ident

    def error(self) -> str | None:
        """A one-line description of the error that stopped the thread, if any."""
        if self._error is None:
            return None
        return f"{type(self._error).__name__}: {self._error}"

    def raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(
                f"Channel-B prefetcher (rank {self.rank}) failed: {self.error()}"
            ) from self._error

    # ------------------------------------------------------------------ thread

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if self.queue.depth() + self._buffered_packs() >= self.target_packs:
                    self._stop.wait(0.01)
                    continue
                self._produce_once()
        except BaseException as exc:  # handed to the learner, never swallowed
            self._error = exc

    def _buffered_packs(self) -> int:
        return 1 if self._buffer else 0

    def _produce_once(self) -> None:
        indices = self.sampler.take(self.chunk_size)
        seed = (self.seed * 1_000_003 + self.rank * 10_007 + self.num_chunks * 97) % 2**31
        self.num_chunks += 1
        started = time.perf_counter()
        try:
            if self._inject:
                raise RuntimeError(f"injected prefetch fault on rank {self.rank} ({INJECT_FAULT_ENV})")
            out = self.source.rollout_versioned(indices, seed)
        except (RolloutServerError, httpx.TransportError, TimeoutError, ConnectionError) as exc:
            if not self._stop.is_set():  # a call ended by the shutdown closing the client is no failure
                self._on_failure(exc, transient=True)
            return
        except Exception as exc:
            if not self._stop.is_set():
                self._on_failure(exc, transient=False)
            return
        self._consecutive = 0
        self._outage_since = None
        ver = out.ver if out.ver >= 0 else self.current_ver()
        items = []
        for index, generation in zip(indices, out.generations, strict=True):
            segment, stats = self.build_segment(index, generation)
            if segment is not None:
                items.append(_Buffered(segment, stats))
        self._add(items, ver)
        self.counters.success_total += 1
        self.counters.rollouts_total += len(indices)
        self.counters.busy_s += time.perf_counter() - started

    def _on_failure(self, exc: Exception, *, transient: bool) -> None:
        self.counters.fail_total += 1
        self.counters.last_error = f"{type(exc).__name__}: {exc}"
        self._consecutive += 1
        now = time.monotonic()
        if transient:
            self._outage_since = self._outage_since or now
            if now - self._outage_since > self.outage_timeout_s:
                raise RuntimeError(
                    f"rollout servers unreachable for {now - self._outage_since:.0f} s "
                    f"(> vllm.server.timeout_s {self.outage_timeout_s:g}): {self.counters.last_error}"
                ) from exc
            self._stop.wait(min(5.0, 0.25 * 2 ** min(self._consecutive, 5)))
            return
        if self._consecutive >= self.max_consecutive_failures:
            raise exc

    def _add(self, items: list[_Buffered], ver: int) -> None:
        if self._buffer and ver != self._buffer_ver:
            self._flush(everything=True)  # leftovers of the old version never mix with the new one
        self._buffer_ver = ver
        self._buffer += items
        self._flush(everything=False)

    def _flush(self, *, everything: bool) -> None:
        """Emit full packs of buffered segments (in arrival order); the rest waits for the next chunk
        unless `everything` (a version change) flushes it too."""
        while len(self._buffer) >= self.segments_per_pack or (everything and self._buffer):
            group = self._buffer[: self.segments_per_pack]
            for sub in pack_segments([len(b.segment) for b in group], self.packing_length):
                self._emit([group[i] for i in sub])
            self._buffer = self._buffer[len(group) :]

    def _emit(self, members: list[_Buffered]) -> None:
        stats = RolloutStats()
        for m in members:
            stats.add(m.stats)
        batch = self.collate([m.segment for m in members])
        self.queue.push(ReadyPack(batch, len(members), stats, self._buffer_ver), self._buffer_ver)
        self.counters.produced_packs += 1
