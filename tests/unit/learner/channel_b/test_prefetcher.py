"""The prefetcher thread with fakes of our own interfaces: bursts sized by pacing, packs by token budget,
version tags from the fenced burst, error hand-off."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest

from stagectl.collate import Segment
from stagectl.config.plan import MatchCosts, TargetPlan
from stagectl.data.sampler import ShardedSampler
from stagectl.detection.stats import RolloutStats
from stagectl.learner.channel_b.clock import VersionClock
from stagectl.learner.channel_b.pacing import PacingRules
from stagectl.learner.channel_b.packs import PackBuilder
from stagectl.learner.channel_b.prefetcher import Prefetcher
from stagectl.learner.channel_b.queue import ReadyPackQueue
from stagectl.learner.channel_b.records import PrefetchError, ReadyPack
from stagectl.models.generate import Generation
from stagectl.seeds import derive_seed
from stagectl.wire.errors import RolloutRequestFailedError, RolloutServerError, WrongVersionError

SEGMENT_TOKENS = 10


def segment(length: int = SEGMENT_TOKENS) -> Segment:
    return Segment(
        input_ids=list(range(length)),
        ce_weights=[0.0] + [1.0] * (length - 1),
        mm_token_type_ids=[0] * length,
        pixel_values=None,
        image_grid_thw=None,
    )


class FakeSection:
    def __init__(self, source: FakeSource) -> None:
        self.source = source
        self.ver = source.ver

    def rollout(self, indices: Sequence[int], seed: int) -> list[Generation]:
        self.source.requests.append(len(indices))
        if self.source.gate is not None:  # a burst held in flight until the test opens the gate
            assert self.source.gate.wait(10.0)
        if self.source.tickets is not None:  # one request per ticket the test hands out
            assert self.source.tickets.acquire(timeout=10.0)
        if self.source.fail_with is not None:
            raise self.source.fail_with
        if len(self.source.requests) in self.source.refuse:  # a server swapped a sync in meanwhile
            self.source.ver = self.source.refuse[len(self.source.requests)]
            raise WrongVersionError(f"weight_version {self.ver} is no longer served")
        self.source.seeds.append(seed)
        return [Generation([i], "stop") for i in indices]


class FakeSource:
    """Answers with the version the test sets; can fail on demand; records sections and request sizes."""

    def __init__(self, tokens: int = SEGMENT_TOKENS) -> None:
        self.clock = VersionClock()  # `make` hands it the queue's: the one clock the prefetcher reads
        self.tokens = tokens  # segment length each rollout makes
        self.requests: list[int] = []
        self.sections = 0
        self.fail_with: Exception | None = None
        self.gate: threading.Event | None = None
        self.in_section = threading.Event()
        self.tickets: threading.Semaphore | None = None
        self.refuse: dict[int, int] = {}  # request number (1-based) -> the version the learner moves to
        self.seeds: list[int] = []  # of the answered requests

    @property
    def ver(self) -> int:
        return self.clock.ver

    @ver.setter
    def ver(self, ver: int) -> None:  # a weight sync: the publisher advances the shared clock
        self.clock.advance(ver)

    @contextmanager
    def section(self) -> Iterator[FakeSection]:
        self.sections += 1
        self.in_section.set()
        try:
            yield FakeSection(self)
        finally:
            self.in_section.clear()

    def build(
        self, indices: Sequence[int], generations: Sequence[Generation]
    ) -> tuple[list[Any], RolloutStats]:
        return [
            (k, segment(self.tokens), RolloutStats(n_samples=1)) for k in range(len(indices))
        ], RolloutStats()


@dataclass(frozen=True)
class FakePacks(PackBuilder):
    """The real grouping (`groups`), the source's segments, and a 'batch' that is the segment list."""

    source: Any = None

    def segments(self, indices: Sequence[int], generations: Sequence[Generation]) -> Any:
        return self.source.build(indices, generations)

    def collate(self, segments: list[Segment]) -> Any:
        return segments


class SyncPendingClock(VersionClock):
    """A clock whose fence always has a weight sync waiting."""

    @property
    def sync_pending(self) -> bool:
        return True


def make(source: FakeSource, queue: ReadyPackQueue[ReadyPack], **kwargs: Any) -> Prefetcher:
    rules = PacingRules(
        b_ratio=kwargs.pop("b_ratio", 1.0),
        gas=kwargs.pop("gas", 2),
        sync_every_steps=1,
        version_window=1,
        target_packs=kwargs.pop("target_packs", 4),
        pack_tokens=90,  # 0.9 x packing_length 100: 9 segments of 10 tokens
    )
    if kwargs.pop("sync_pending", False):
        queue.clock = SyncPendingClock(queue.clock.ver)
    source.clock = queue.clock
    packs = FakePacks(
        encoder=None,  # type: ignore[arg-type]
        target=TargetPlan(),
        match=MatchCosts(),
        packing_length=100,
        model=None,
        segments_per_pack=kwargs.pop("segments_per_pack", None),
        source=source,
    )
    options: dict[str, Any] = {
        "initial_tokens_per_rollout": float(SEGMENT_TOKENS),
        "max_consecutive_failures": 2,
        "outage_timeout_s": 60.0,
        "idle_wait_s": 0.005,
    }
    options.update(kwargs)
    return Prefetcher(
        source=source,
        packs=packs,
        sampler=ShardedSampler(500, rank=0, world_size=1, seed=0, stream="B"),
        queue=queue,
        rules=rules,
        seed=0,
        rank=0,
        **options,
    )


def test_a_burst_fills_exactly_the_packs_pacing_wants_at_the_fill_ratio() -> None:
    queue: ReadyPackQueue[ReadyPack] = ReadyPackQueue(queue_limit=50, version_window=1)
    source = FakeSource()
    pf = make(source, queue, gas=2, target_packs=4)
    pf._burst(pf._packs_wanted())
    # b_ratio 1, sync every step, window 1: 2 B steps in the horizon x gas 2 = 4 packs, room 4;
    # 4 x 90 tokens / 10 per rollout = 36 rollouts, all in the first request
    assert source.requests == [36] and source.sections == 1
    packs = [queue.pop_for_ver(0) for _ in range(4)]
    assert [p.num_segments for p in packs] == [9, 9, 9, 9]  # fill 0.9 each
    assert queue.depth() == 0 and pf._packs_wanted() == 4


def test_a_waiting_sync_cuts_the_burst_to_the_request_in_flight() -> None:
    """The learner's weight sync waits for an open burst: the burst skips its top-ups and packs what the
    first request brought into the packs asked for (less full), all queued before the sync goes on. The
    first request asks for the whole need at the estimate, so only an estimate that ran high (12 tokens a
    rollout against 10) leaves the packs short: 30 rollouts, no top-up of 6."""
    queue: ReadyPackQueue[ReadyPack] = ReadyPackQueue(queue_limit=50, version_window=1)
    source = FakeSource()
    pf = make(source, queue, gas=2, target_packs=4, sync_pending=True, initial_tokens_per_rollout=12.0)
    pf._burst(pf._packs_wanted())
    assert source.requests == [30] and pf.counters.cut_short_total == 1  # no top-up of 6
    packs = [queue.pop_for_ver(0) for _ in range(4)]
    assert sum(p.num_segments for p in packs) == 30 and queue.depth() == 0


def test_nothing_is_requested_when_the_queue_holds_what_b_steps_can_train() -> None:
    queue: ReadyPackQueue[ReadyPack] = ReadyPackQueue(queue_limit=50, version_window=1)
    source = FakeSource()
    pf = make(source, queue, gas=2, target_packs=4)
    pf.start()
    assert wait_for(lambda: queue.depth() == 4, 5.0)
    time.sleep(0.2)
    assert sum(source.requests) == 36  # idle: the queue is at its target
    queue.pop_for_ver(0)
    queue.pop_for_ver(0)
    assert wait_for(lambda: sum(source.requests) == 54, 5.0)  # consumption resumes production
    assert queue.depth() == 4  # exactly the 2 packs consumed were made again
    assert pf.stop(5.0)


def test_requests_are_rounded_up_to_whole_decode_batches_that_fit_the_packs() -> None:
    """The server answers a request in decode batches, and a batch of a few rollouts costs it about as
    much as a full one: 4 packs of 90 tokens at 10 per rollout need 36 rollouts. When a next burst of the
    version follows (it takes what does not fit), with batches of 12 the request is 36 (3 batches); with
    batches of 5 it is 40 (all 40 fit the 4 packs' 400 tokens: nothing is carried)."""
    for multiple, expected, segments in ((12, [36], [9, 9, 9, 9]), (5, [40], [10, 10, 10, 10])):
        queue: ReadyPackQueue[ReadyPack] = ReadyPackQueue(queue_limit=50, version_window=1)
        source = FakeSource()
        pf = make(source, queue, gas=2, target_packs=4, request_multiples=(multiple,))
        pf._burst(pf._packs_wanted(), another_follows=True)
        assert source.requests == expected and source.sections == 1
        assert [queue.pop_for_ver(0).num_segments for _ in range(4)] == segments
        assert queue.depth() == 0 and pf.snapshot()["carry"] == []


def test_rounding_to_decode_batches_never_asks_for_more_than_the_packs_hold_nor_less_than_they_need() -> None:
    """Batches of 24: rounding 36 up to 48 (480 tokens) would overshoot the packs' 400 tokens at the
    estimate, and rounding it down to one batch (24) left the packs at 6 segments of 9 (fill 0.6): the
    request is the need itself (36), the packs reach their fill (9 segments each)."""
    queue: ReadyPackQueue[ReadyPack] = ReadyPackQueue(queue_limit=50, version_window=1)
    source = FakeSource()
    pf = make(source, queue, gas=2, target_packs=4, request_multiples=(24,))
    pf._burst(pf._packs_wanted(), another_follows=True)
    assert source.requests == [36]
    assert [queue.pop_for_ver(0).num_segments for _ in range(4)] == [9, 9, 9, 9]


def test_the_last_burst_of_a_version_asks_for_no_surplus_that_would_go_stale() -> None:
    """Pacing wants one burst of 2 packs (target 2): it is the last of version 0, so its request is the
    need at the estimate (10 tokens a rollout: 18), not rounded up to a batch of 8 (24: 6 more segments
    to carry and drop when the version moves). Rollouts make 12 tokens, so 2 of the 18 still fit no pack
    (the estimate ran low) and are dropped, counted, when the version moves; the next burst asks at the
    corrected estimate (15 x 12 = 180 tokens) and leaves nothing over."""
    queue: ReadyPackQueue[ReadyPack] = ReadyPackQueue(queue_limit=50, version_window=1)
    source = FakeSource(tokens=12)
    pf = make(source, queue, gas=2, target_packs=2, request_multiples=(8,))
    pf.start()  # the thread decides whether a next burst of the version follows
    assert wait_for(lambda: queue.depth() == 2, 5.0)
    assert pf.stop(5.0)
    assert source.requests == [18] and len(pf.snapshot()["carry"]) == 2
    source.ver = 1
    queue.clock.advance(1)
    pf._burst(2)
    assert source.requests == [18, 15] and pf.snapshot()["carry"] == []
    assert pf.counters.carry_dropped_total == 2
    assert [queue.pop_for_ver(v).num_segments for v in (0, 0, 1, 1)] == [8, 8, 8, 7]


def test_rounding_happens_where_a_next_burst_of_the_version_takes_the_surplus() -> None:
    """Pacing wants 4 packs (two bursts of gas 2) of version 0: the first burst's need (18 at the estimate
    of 10) is whole batches of 6; 16 segments of 12 tokens fill its 2 packs and 2 are carried; the second
    burst (the last of the version) starts from them and asks for the rest at the corrected estimate (13).
    Every rollout is trained at version 0."""
    queue: ReadyPackQueue[ReadyPack] = ReadyPackQueue(queue_limit=50, version_window=1)
    source = FakeSource(tokens=12)
    pf = make(source, queue, gas=2, target_packs=4, request_multiples=(6,))
    pf.start()
    assert wait_for(lambda: queue.depth() == 4, 5.0)
    assert pf.stop(5.0)
    assert source.requests == [18, 13] and source.sections == 2
    assert [queue.pop_for_ver(0).num_segments for _ in range(4)] == [8, 8, 8, 7]
    assert pf.snapshot()["carry"] == [] and pf.counters.carry_dropped_total == 0


def test_no_rounding_while_a_weight_sync_waits_for_the_burst() -> None:
    """A waiting sync moves the version right after this burst, so its surplus could not be used by a
    next burst of the version: the request is the need (18), not rounded up to 5 batches of 4 (20)."""
    queue: ReadyPackQueue[ReadyPack] = ReadyPackQueue(queue_limit=50, version_window=1)
    source = FakeSource()
    pf = make(source, queue, gas=2, target_packs=4, request_multiples=(4,), sync_pending=True)
    pf._burst(2, another_follows=True)
    assert source.requests == [18]
    free = FakeSource()  # no sync waits: rounded up to whole batches that fit the packs at the estimate
    free_queue: ReadyPackQueue[ReadyPack] = ReadyPackQueue(queue_limit=50, version_window=1)
    make(free, free_queue, gas=2, target_packs=4, request_multiples=(4,))._burst(2, another_follows=True)
    assert free.requests == [20]


def test_the_nearest_b_step_gets_its_packs_first_in_a_burst_of_its_own() -> None:
    """Pacing wants 4 packs (2 B steps of gas 2): they come as two bursts (two fenced sections) of 2 packs,
    so the first B step does not wait for the second one's rollouts."""
    queue: ReadyPackQueue[ReadyPack] = ReadyPackQueue(queue_limit=50, version_window=1)
    source = FakeSource()
    pf = make(source, queue, gas=2, target_packs=4)
    pf.start()
    assert wait_for(lambda: queue.depth() == 4, 5.0)
    assert pf.stop(5.0)
    assert source.sections == 2
    assert source.requests[0] == 2 * 9  # the first request is for 2 packs of 9 segments, not 4


def test_no_rollouts_for_a_version_whose_b_steps_do_not_come() -> None:
    """b_ratio 0: no B step ever wants these packs, so nothing is generated (nothing wasted)."""
    queue: ReadyPackQueue[ReadyPack] = ReadyPackQueue(queue_limit=50, version_window=1)
    source = FakeSource()
    pf = make(source, queue, b_ratio=0.0)
    pf.start()
    time.sleep(0.3)
    assert source.requests == [] and queue.depth() == 0
    assert pf.stop(2.0)


def test_packs_carry_the_version_of_their_burst_and_are_queued_inside_it() -> None:
    queue: ReadyPackQueue[ReadyPack] = ReadyPackQueue(queue_limit=50, version_window=5)
    source = FakeSource()
    pushed_inside: list[bool] = []
    original = queue.push

    def push(pack: ReadyPack, ver: int, size: int = 1) -> bool:
        pushed_inside.append(source.in_section.is_set())
        return original(pack, ver, size)

    queue.push = push  # type: ignore[method-assign]
    pf = make(source, queue, gas=1, target_packs=1)
    pf._burst(1)
    source.ver = 3
    queue.clock.advance(3)
    pf._burst(1)
    assert [queue.pop_for_ver(0).ver, queue.pop_for_ver(3).ver] == [0, 3]
    assert pushed_inside == [True, True]  # the sync fence was still closed when each pack was queued


def test_a_short_burst_is_topped_up_inside_the_same_section() -> None:
    queue: ReadyPackQueue[ReadyPack] = ReadyPackQueue(queue_limit=50, version_window=1)
    source = FakeSource()
    pf = make(source, queue, gas=1, target_packs=1, initial_tokens_per_rollout=100.0)
    pf._burst(1)  # the first guess is high (prompt + max_new_tokens): 1 rollout, then a top-up
    assert source.sections == 1 and source.requests == [1, 8]
    first = queue.pop_for_ver(0)
    assert first.num_segments == sum(source.requests)
    source.requests.clear()
    pf._burst(1)  # the estimate has come down: the pack reaches its 90 tokens
    assert queue.pop_for_ver(0).num_segments * SEGMENT_TOKENS >= 90


def test_rollouts_longer_than_estimated_never_make_an_extra_pack() -> None:
    queue: ReadyPackQueue[ReadyPack] = ReadyPackQueue(queue_limit=50, version_window=1)
    source = FakeSource(tokens=12)  # the estimate says 10: 9 rollouts make 108 > 100
    pf = make(source, queue, gas=1, target_packs=1)
    pf._burst(1)  # 9 x 12 = 108: 8 fill the one pack (96 >= 90), the 9th is carried, not a second pack
    assert source.requests == [9]
    assert queue.depth() == 1 and queue.pop_for_ver(0).num_segments == 8
    assert len(pf.snapshot()["carry"]) == 1


def test_non_transient_errors_reach_the_learner_after_n_failures() -> None:
    queue: ReadyPackQueue[ReadyPack] = ReadyPackQueue(queue_limit=50, version_window=1)
    source = FakeSource()
    source.fail_with = KeyError("boom")
    pf = make(source, queue, max_consecutive_failures=3)
    pf.start()
    assert wait_for(lambda: pf.error() is not None, 5.0)
    assert len(source.requests) == 3 and pf.counters.fail_total == 3
    with pytest.raises(PrefetchError, match="prefetcher \\(rank 0\\) failed: KeyError"):
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
    assert wait_for(lambda: len(source.requests) >= 2, 3.0)
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


def test_an_error_caused_by_the_shutdown_is_not_an_error() -> None:
    queue: ReadyPackQueue[ReadyPack] = ReadyPackQueue(queue_limit=50, version_window=1)
    source = FakeSource()
    pf = make(source, queue, max_consecutive_failures=1)
    pf.request_stop()
    source.fail_with = RolloutServerError("client closed")
    pf._burst(1)
    assert pf.error() is None and pf.counters.fail_total == 0


def test_segments_that_fit_no_pack_start_the_next_burst_of_the_same_version() -> None:
    queue: ReadyPackQueue[ReadyPack] = ReadyPackQueue(queue_limit=50, version_window=1)
    source = FakeSource(tokens=40)
    pf = make(source, queue, gas=1, target_packs=1, initial_tokens_per_rollout=20.0)
    pf._burst(1)  # the estimate says 20: 90 -> 5 rollouts of 40 = 200 tokens, 2 fit in 100
    assert source.requests == [5] and queue.pop_for_ver(0).num_segments == 2
    pf._burst(1)  # 3 carried (120 tokens) reach the target alone: 2 fit, 1 carried again
    assert source.requests == [5] and queue.pop_for_ver(0).num_segments == 2
    source.ver = 1
    queue.clock.advance(1)
    pf._burst(1)  # the version moved on: the carried segment is dropped and counted
    assert pf.counters.carry_dropped_total == 1 and queue.pop_for_ver(1).ver == 1


def test_a_checkpoint_snapshot_leaves_out_the_burst_in_flight_and_restore_rebuilds_the_rest() -> None:
    """The snapshot holds the queued pack (with its rollouts' samples and stream positions) and the stream
    position after the last *finished* burst; the burst in flight is not in it, so a resumed prefetcher
    takes those samples again from the front of its stream. Nothing twice, nothing skipped."""
    queue: ReadyPackQueue[ReadyPack] = ReadyPackQueue(queue_limit=50, version_window=1)
    source = FakeSource()
    pf = make(source, queue, gas=1, target_packs=2)
    pf._burst(1)
    done, chunks_done = pf.sampler.num_consumed, len(source.requests)
    first = queue.state()[0][0][1]
    assert [r.stream_pos for r in first.rollouts] == list(range(first.num_segments))
    source.gate = threading.Event()
    in_flight = threading.Thread(target=pf._burst, args=(1,))
    in_flight.start()
    assert wait_for(lambda: pf.sampler.num_consumed > done, 5.0)  # the second burst has taken samples
    snap = pf.snapshot()
    source.gate.set()
    in_flight.join(5.0)
    assert queue.depth() == 2  # the uninterrupted prefetcher finished its burst
    assert snap["stream_pos"] == done and snap["num_chunks"] == chunks_done
    assert [len(p["rollouts"]) for p in snap["packs"]] == [first.num_segments]
    assert snap["counters"]["rollouts_total"] == done  # the in-flight burst's rollouts are not counted

    resumed_queue: ReadyPackQueue[ReadyPack] = ReadyPackQueue(queue_limit=50, version_window=1)
    resumed = make(FakeSource(), resumed_queue, gas=1, target_packs=2)
    resumed.restore(snap)
    restored = resumed_queue.state()[0]
    assert [(ver, pack.rollouts) for ver, pack in restored] == [(0, first.rollouts)]
    assert (
        restored[0][1].num_segments == first.num_segments and len(restored[0][1].batch) == first.num_segments
    )
    assert resumed.sampler.num_consumed == done and resumed.counters.rollouts_total == done
    resumed._burst(1)  # the samples that were in flight are generated again, from the front of the stream
    again = resumed_queue.state()[0][1][1]
    assert again.rollouts[0].stream_pos == done
    assert [r.sample for r in again.rollouts] == [r.sample for r in queue.state()[0][1][1].rollouts]


def test_restore_refuses_rollouts_that_no_longer_make_a_segment() -> None:
    queue: ReadyPackQueue[ReadyPack] = ReadyPackQueue(queue_limit=50, version_window=1)
    source = FakeSource()
    pf = make(source, queue, gas=1, target_packs=1)
    pf._burst(1)
    snap = pf.snapshot()
    shrunk = FakeSource()
    shrunk.build = lambda indices, generations: ([], RolloutStats())  # type: ignore[method-assign]
    resumed = make(shrunk, ReadyPackQueue(queue_limit=50, version_window=1))
    with pytest.raises(ValueError, match="no longer make a segment that fits global_max_length"):
        resumed.restore(snap)


def test_a_call_refused_after_a_swap_gives_its_samples_back_and_the_burst_packs_what_it_has() -> None:
    """`in_flight_sync`: the servers refuse the top-up (a sync was swapped in since the burst began): the
    burst queues its packs at its own version from the first request's rollouts, and the refused samples and
    seed are the next burst's, at the new version: nothing is lost, nothing skipped."""
    queue: ReadyPackQueue[ReadyPack] = ReadyPackQueue(queue_limit=50, version_window=1)
    source = FakeSource()
    source.refuse = {2: 1}
    # an estimate that runs high (12 tokens a rollout against 10): the first request (30) leaves 6 missing
    pf = make(source, queue, gas=2, target_packs=4, initial_tokens_per_rollout=12.0)
    pf._burst(pf._packs_wanted())
    assert source.requests == [30, 6] and pf.counters.refused_total == 1
    assert pf.sampler.num_consumed == 30 and pf.num_chunks == 1 and pf.counters.lost_total == 0
    assert sum(queue.pop_for_ver(0).num_segments for _ in range(4)) == 30
    queue.clock.advance(1)
    pf._burst(2)
    assert pf.snapshot()["stream_pos"] == 30 + sum(source.requests[2:])
    assert source.seeds[1] == derive_seed(0, 0, 1)  # the refused call's seed, now answered


def test_a_refusal_while_the_learner_has_not_moved_is_a_failure_that_loses_nothing() -> None:
    """Refused at the burst's first call although the learner's version is the section's: the servers are
    ahead of the learner. Counted as a failed burst (retried with back-off), the samples stay in the stream."""
    queue: ReadyPackQueue[ReadyPack] = ReadyPackQueue(queue_limit=50, version_window=1)
    source = FakeSource()
    source.refuse = {1: 0}
    pf = make(source, queue, gas=2, target_packs=4, outage_timeout_s=60.0)
    pf._burst_in(4, False, time.perf_counter())
    assert pf.counters.fail_total == 1 and pf.counters.lost_total == 0
    assert pf.sampler.num_consumed == 0 and pf.num_chunks == 0 and queue.depth() == 0


def test_wait_burst_returns_when_the_burst_in_progress_has_queued_its_packs() -> None:
    queue: ReadyPackQueue[ReadyPack] = ReadyPackQueue(queue_limit=50, version_window=1)
    source = FakeSource()
    source.gate = threading.Event()
    pf = make(source, queue, gas=2, target_packs=2)
    pf.start()
    assert wait_for(lambda: pf._bursts.version() == 0, 5.0)  # in its section
    assert pf.wait_burst(0.05) is False  # still in flight
    source.gate.set()
    assert pf.wait_burst(5.0) is True and queue.depth() >= 2
    assert pf.stop(5.0)


def test_wait_burst_returns_for_the_burst_in_progress_even_when_the_next_has_begun() -> None:
    """The learner waits for the burst that makes its B step's packs; the prefetcher starts its next burst
    the moment that one ends, before the waiting thread wakes up. The wait must still end then (it once
    waited for the next burst too: a whole burst of idle learner)."""
    queue: ReadyPackQueue[ReadyPack] = ReadyPackQueue(queue_limit=50, version_window=1)
    source = FakeSource()
    source.tickets = threading.Semaphore(0)
    pf = make(source, queue, gas=2, target_packs=4)  # two bursts of 2 packs: one request of 18 each
    pf.start()
    assert wait_for(lambda: pf._bursts.version() == 0, 5.0)  # in its section
    waited: list[bool] = []
    waiter = threading.Thread(target=lambda: waited.append(pf.wait_burst(10.0)))
    waiter.start()
    source.tickets.release(1)  # the first burst's request; the second burst blocks on its first
    assert wait_for(lambda: len(source.requests) == 2, 5.0)
    waiter.join(5.0)
    assert waited == [True] and pf._bursts.version() == 0 and queue.depth() == 2  # the next one runs
    source.tickets.release(10)
    assert pf.stop(5.0)


def test_the_packs_of_a_burst_in_flight_at_a_sync_count_as_held_for_pacing() -> None:
    """`in_flight_sync`: a burst of version 0 is still running when the sync moves the learner to 1. The
    shared view measured then must count its packs (once, whether queued yet or not): counted as missing,
    pacing asks for the same B step's packs again at version 1, and they go stale unused (the learning
    check's runs dropped 36-49% of their rollouts so)."""
    queue: ReadyPackQueue[ReadyPack] = ReadyPackQueue(queue_limit=50, version_window=1)
    source = FakeSource()
    source.gate = threading.Event()
    pf = make(source, queue, gas=2, target_packs=8)
    burst = threading.Thread(target=pf._burst, args=(2,))
    burst.start()
    assert source.in_section.wait(5.0)
    source.ver = 1  # the sync, while the burst runs
    queue.clock.advance(1)
    assert pf.counts_with_coming() == ([0, 1], [2, 0])
    queue.set_shared(*pf.counts_with_coming())
    source.gate.set()
    burst.join(5.0)
    assert pf.counts_with_coming() == ([0, 1], [2, 0])  # queued now: counted once
    # B every step, sync every step, window 1: steps 0 and 1 train version 0 or 1; version 0's group covers one
    assert pf._packs_wanted() == 2
    queue.set_shared([0, 1], [0, 0])  # the view without the burst in flight: a second group for the same step
    assert pf._packs_wanted() == 4


def test_the_first_burst_wait_ends_with_its_packs_queued() -> None:
    """The thread's first burst, held in flight: `wait_first_burst` waits for it and returns with its
    packs in the queue; after it, at once."""
    queue: ReadyPackQueue[ReadyPack] = ReadyPackQueue(queue_limit=50, version_window=1)
    source = FakeSource()
    source.gate = threading.Event()
    pf = make(source, queue, gas=2, target_packs=2)
    pf.start()
    assert source.in_section.wait(5.0)
    assert pf.wait_first_burst(0.05) is False  # its rollouts are not back
    threading.Timer(0.1, source.gate.set).start()
    assert pf.wait_first_burst(10.0) is True
    assert queue.depth() == 2
    assert pf.wait_first_burst(0.0) is True
    assert pf.stop(5.0)


def test_no_first_burst_wait_for_an_idle_or_dead_thread() -> None:
    """Pacing wants nothing (b_ratio 0): the thread idles and the wait ends. A thread that died before its
    first burst (here: pinned to a CPU that does not exist) ends it too, at once, not at the timeout."""
    queue: ReadyPackQueue[ReadyPack] = ReadyPackQueue(queue_limit=50, version_window=1)
    idle = make(FakeSource(), queue, b_ratio=0.0)
    idle.start()
    assert idle.wait_first_burst(10.0) is True and queue.depth() == 0
    assert idle.stop(5.0)
    dead = make(FakeSource(), ReadyPackQueue(queue_limit=50, version_window=1), cpus=[10**6])
    waited: list[bool] = []
    waiter = threading.Thread(target=lambda: waited.append(dead.wait_first_burst(10.0)))
    waiter.start()
    time.sleep(0.2)  # the learner waits before the thread dies
    started = time.monotonic()
    dead.start()
    waiter.join(10.0)
    assert waited == [True] and time.monotonic() - started < 5.0 and dead.error() is not None
    assert dead.stop(1.0)


def test_a_burst_that_server_trouble_failed_gives_its_samples_and_seeds_to_the_retry() -> None:
    """A server outage: each failed burst took its samples from the B stream and lost them (480 samples in a
    200 s outage of the example, 15 epochs of its 32). Now the retry after the back-off asks for the same
    samples with the same seeds, as after a resume; a failure of another kind still loses them (counted)."""
    queue: ReadyPackQueue[ReadyPack] = ReadyPackQueue(queue_limit=50, version_window=1)
    source = FakeSource()
    source.fail_with = RolloutServerError("connection refused")
    pf = make(source, queue, gas=2, target_packs=2, outage_timeout_s=60.0, max_consecutive_failures=9)
    for _ in range(2):
        pf._burst_in(2, False, time.perf_counter())
    assert pf.counters.fail_total == 2 and pf.counters.lost_total == 0 and source.requests == [18, 18]
    assert (pf.sampler.num_consumed, pf.num_chunks, pf.snapshot()["stream_pos"]) == (0, 0, 0)
    source.fail_with = None  # the server is back
    pf._burst(2)
    rollouts = [r for _, pack in queue.state()[0] for r in pack.rollouts]
    assert sorted(r.stream_pos for r in rollouts) == list(range(18)) and source.seeds == [
        derive_seed(0, 0, 0)
    ]
    source.fail_with = KeyError("a sample that breaks the burst")
    pf._burst_in(2, False, time.perf_counter())
    assert pf.counters.lost_total == 18 and pf.snapshot()["stream_pos"] == 36


class PoisonSection(FakeSection):
    """A server that is there but fails every request holding one sample (the stream's first)."""

    def rollout(self, indices: Sequence[int], seed: int) -> list[Generation]:
        source = self.source
        if source.poison is None:
            source.poison = indices[0]
        if source.poison in indices:
            source.requests.append(len(indices))
            raise RolloutRequestFailedError(f"rollout [0, 1) seed={seed} failed twice: HTTP 500: bad sample")
        return super().rollout(indices, seed)


class PoisonSource(FakeSource):
    poison: int | None = None

    @contextmanager
    def section(self) -> Iterator[FakeSection]:
        self.sections += 1
        yield PoisonSection(self)


def test_a_request_a_server_fails_on_its_own_loses_the_burst_and_the_next_burst_goes_on() -> None:
    """Not an outage: a server that answers fails a request of one sample every time (the client split the
    call down to it). Given back, every retry asked for that sample again, the stream never got past it and
    the thread gave up at outage_timeout_s ('rollout servers unreachable'); its burst is lost (counted)."""
    queue: ReadyPackQueue[ReadyPack] = ReadyPackQueue(queue_limit=50, version_window=1)
    source = PoisonSource()
    pf = make(source, queue, gas=2, target_packs=2, outage_timeout_s=60.0, max_consecutive_failures=9)
    pf._burst_in(2, False, time.perf_counter())
    assert pf.counters.fail_total == 1 and pf.counters.lost_total == 18
    assert pf.snapshot()["stream_pos"] == 18
    pf._burst(2)  # the next samples: no poison among them
    assert pf.counters.fail_total == 1 and pf.counters.success_total == 1
    rollouts = [r for _, pack in queue.state()[0] for r in pack.rollouts]
    assert sorted(r.stream_pos for r in rollouts) == list(range(18, 36))


def test_counters_read_while_a_burst_packs_count_the_burst_and_its_packs_together(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The learner's metrics row read the thread's counters one by one while a burst was packing: the burst
    was counted in `prefetch_success_total` and its packs not yet in `produced_packs_total` nor the queue (a
    resumed async run logged 6 successful bursts and 5 packs in one row). `counters_now` reads them under
    the lock the packing holds."""
    queue: ReadyPackQueue[ReadyPack] = ReadyPackQueue(queue_limit=50, version_window=1)
    source = FakeSource()
    pf = make(source, queue, gas=2, target_packs=4)
    packing, resume = threading.Event(), threading.Event()
    collate = FakePacks.collate

    def slow_collate(self: FakePacks, segments: list[Segment]) -> Any:
        packing.set()
        assert resume.wait(10.0)
        return collate(self, segments)

    monkeypatch.setattr(FakePacks, "collate", slow_collate)
    burst = threading.Thread(target=lambda: pf._burst(pf._packs_wanted()))
    burst.start()
    assert packing.wait(10.0)  # the burst has its rollouts and is making its first pack
    read: list[Any] = []
    reader = threading.Thread(target=lambda: read.append(pf.counters_now()))
    reader.start()
    reader.join(0.2)
    resume.set()
    reader.join(10.0)
    burst.join(10.0)
    ((counters, queued),) = read
    assert (counters.success_total, counters.produced_packs) == (1, 4)
    assert (queued.depth, queued.pushed_total) == (4, 4)


def test_a_failed_request_is_not_counted_as_requested_and_the_catalog_says_so() -> None:
    """`stage2_ab/async/rollout_requests_total` and `rollouts_requested_total` count what the servers
    answered: a run whose server was SIGKILLed made 4 more requests that failed and both stayed where they
    were, while docs/reference/metrics.md called them the requests made and the rollouts requested."""
    from stagectl import metric_keys

    queue: ReadyPackQueue[ReadyPack] = ReadyPackQueue(queue_limit=50, version_window=1)
    source = FakeSource()
    source.fail_with = RolloutServerError("connection refused")
    pf = make(source, queue, gas=2, target_packs=4)
    pf._burst(pf._packs_wanted())  # server trouble: counted as a failed burst, then a back-off
    assert source.requests == [36] and pf.counters.fail_total == 1  # sent, never answered
    assert (pf.counters.requests_total, pf.counters.rollouts_total) == (0, 0)
    for name in ("rollout_requests_total", "rollouts_requested_total"):
        assert "answered" in metric_keys.METRICS[metric_keys.ASYNC_PREFIX + name].doc
