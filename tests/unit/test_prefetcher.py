"""The prefetcher thread with fakes of our own interfaces: version-pure packs, pacing, error hand-off."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import pytest

from stagectl.data.sampler import ShardedSampler
from stagectl.learner.channel_b import RolloutStats
from stagectl.learner.rollout_server import VersionedRollouts
from stagectl.models.generate import Generation
from stagectl.packing import Segment
from stagectl.prefetch.prefetcher import Prefetcher, ReadyPack
from stagectl.prefetch.queue import ReadyPackQueue
from stagectl.rollout.client import RolloutServerError


def segment(length: int) -> Segment:
    return Segment(
        input_ids=list(range(length)),
        ce_weights=[0.0] + [1.0] * (length - 1),
        mm_token_type_ids=[0] * length,
        pixel_values=None,
        image_grid_thw=None,
    )


class FakeSource:
    """Answers each chunk with the version the test sets; can fail on demand."""

    def __init__(self) -> None:
        self.ver = 0
        self.calls = 0
        self.fail_with: Exception | None = None
        self.gate = threading.Semaphore(1000)

    def rollout_versioned(self, indices: Sequence[int], seed: int) -> VersionedRollouts:
        self.gate.acquire()
        self.calls += 1
        if self.fail_with is not None:
            raise self.fail_with
        return VersionedRollouts([Generation([i], "stop") for i in indices], self.ver)


def make(source: FakeSource, queue: ReadyPackQueue[ReadyPack], **kwargs: Any) -> Prefetcher:
    options: dict[str, Any] = {
        "chunk_size": 3,
        "packing_length": 100,
        "target_packs": 4,
        "max_consecutive_failures": 2,
        "outage_timeout_s": 60.0,
        "segments_per_pack": 2,
    }
    options.update(kwargs)
    return Prefetcher(
        source=source,
        build_segment=lambda index, generation: (segment(10), RolloutStats(n_samples=1)),
        collate=lambda segments: segments,  # type: ignore[arg-type,return-value]
        sampler=ShardedSampler(50, rank=0, world_size=1, seed=0, stream="B"),
        queue=queue,
        current_ver=lambda: 0,
        seed=0,
        rank=0,
        **options,
    )


def test_version_change_flushes_leftovers_into_old_version_packs() -> None:
    queue: ReadyPackQueue[ReadyPack] = ReadyPackQueue(queue_limit=50, version_window=5)
    source = FakeSource()
    pf = make(source, queue, target_packs=100)
    pf._produce_once()  # ver 0: 3 segments -> one pack of 2, one leftover buffered
    assert queue.depth() == 1
    source.ver = 1
    queue.set_current_ver(1)
    pf._produce_once()  # ver 1: the ver-0 leftover is flushed alone, then 3 new -> 1 pack + leftover
    packs = [queue.pop_for_ver(0), queue.pop_for_ver(0), queue.pop_for_ver(1)]
    assert [p.ver for p in packs] == [0, 0, 1]
    assert [p.num_segments for p in packs] == [2, 1, 2]
    assert queue.depth() == 0 and pf.counters.produced_packs == 3


def test_pacing_stops_at_target() -> None:
    queue: ReadyPackQueue[ReadyPack] = ReadyPackQueue(queue_limit=50, version_window=1)
    source = FakeSource()
    pf = make(source, queue, target_packs=4)
    pf.start()
    time.sleep(0.5)
    calls = source.calls
    time.sleep(0.3)
    assert source.calls == calls  # idle once queued + buffered reaches the target
    assert 4 <= queue.depth() + 1 <= 6
    queue.pop_for_ver(0)
    queue.pop_for_ver(0)
    deadline = time.monotonic() + 5
    while source.calls == calls and time.monotonic() < deadline:
        time.sleep(0.01)
    assert source.calls > calls  # consumption resumes production
    assert pf.stop(5.0)


def test_non_transient_errors_reach_the_learner_after_n_failures() -> None:
    queue: ReadyPackQueue[ReadyPack] = ReadyPackQueue(queue_limit=50, version_window=1)
    source = FakeSource()
    source.fail_with = KeyError("boom")
    pf = make(source, queue, max_consecutive_failures=3)
    pf.start()
    deadline = time.monotonic() + 5
    while pf.error() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert source.calls == 3 and pf.counters.fail_total == 3
    with pytest.raises(RuntimeError, match="prefetcher \\(rank 0\\) failed: KeyError"):
        pf.raise_if_failed()
    assert pf.stop(1.0)


def wait_for(predicate: Any, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)
    return bool(predicate())


def test_server_outage_is_retried_and_recovers() -> None:
    queue: ReadyPackQueue[ReadyPack] = ReadyPackQueue(queue_limit=50, version_window=1)
    source = FakeSource()
    source.fail_with = RolloutServerError("connection refused")
    pf = make(source, queue, max_consecutive_failures=1, outage_timeout_s=30.0)
    pf.start()
    assert wait_for(lambda: source.calls >= 2, 3.0)
    assert pf.error() is None  # transient: retried with back-off, not fatal
    source.fail_with = None  # the server is back
    assert wait_for(lambda: queue.depth() > 0, 5.0)
    assert pf.error() is None and pf.counters.fail_total >= 2
    assert pf.stop(2.0)


def test_long_outage_is_reported() -> None:
    queue: ReadyPackQueue[ReadyPack] = ReadyPackQueue(queue_limit=50, version_window=1)
    source = FakeSource()
    source.fail_with = RolloutServerError("connection refused")
    pf = make(source, queue, max_consecutive_failures=1, outage_timeout_s=0.4)
    pf.start()
    assert wait_for(lambda: pf.error() is not None, 5.0)
    assert "unreachable" in (pf.error() or "")
    assert pf.stop(1.0)
