"""Async Channel-B: version arithmetic, the feasibility gate, the ready-pack queue."""

from __future__ import annotations

import itertools
import threading
import time

import pytest

from stagectl.learner.channel_b.queue import (
    ReadyPackQueue,
    choose_b_version,
    decide_step,
    eligible_versions,
    is_stale,
)
from stagectl.schedule import channel_for_step


@pytest.mark.parametrize(("cur", "window"), list(itertools.product(range(6), range(4))))
def test_stale_iff_outside_window(cur: int, window: int) -> None:
    eligible = eligible_versions(cur, window)
    for ver in range(cur + 1):
        assert is_stale(ver, cur, window) == (ver not in eligible)
    assert eligible[-1] == cur and len(eligible) == min(cur, window) + 1


def test_empty_queues_give_a_step_with_skip() -> None:
    assert decide_step(True, [0, 1], [0, 0], gas=2) == ("A", None)


def test_gas_packs_of_one_version_on_every_rank_give_b() -> None:
    # MIN over ranks is what each entry holds: here every rank has >= 2 packs of version 1
    assert decide_step(True, [0, 1], [1, 2], gas=2) == ("B", 1)
    assert decide_step(True, [0, 1], [3, 2], gas=2) == ("B", 0)  # the oldest feasible version wins
    assert decide_step(False, [0, 1], [3, 3], gas=2) == ("A", None)  # policy gate first


def test_packs_split_across_versions_are_infeasible() -> None:
    # 1 pack of v0 and 1 of v1 on the slowest rank: two packs in all, but never GAS of one version
    assert choose_b_version([0, 1], [1, 1], gas=2) is None


def test_ratio_half_with_ample_packs_alternates() -> None:
    kinds = []
    for step in range(8):
        kind, _ = decide_step(channel_for_step(step, 0.5) == "B", [0], [100], gas=4)
        kinds.append(kind)
    assert kinds == ["A", "B"] * 4


def test_queue_full_drops_oldest_first() -> None:
    q: ReadyPackQueue[str] = ReadyPackQueue(queue_limit=3, version_window=1)
    for name in "abcde":
        q.push(name, ver=0)
    assert q.depth() == 3
    assert [q.pop_for_ver(0) for _ in range(3)] == ["c", "d", "e"]
    assert q.counters().drop_oldest_total == 2


def test_stale_pack_dropped_counted_never_returned() -> None:
    q: ReadyPackQueue[str] = ReadyPackQueue(queue_limit=8, version_window=1)
    q.push("old", ver=0)
    q.push("mid", ver=1)
    q.clock.advance(2)  # window 1: v0 < 2 - 1 is stale
    assert q.eligible_counts() == ([1, 2], [1, 0])
    with pytest.raises(LookupError):
        q.pop_for_ver(0)
    assert q.counters().drop_stale_total == 1
    assert q.pop_for_ver(1) == "mid"
    q.push("late", ver=0)  # a straggler from a stale version is dropped on arrival
    assert q.depth() == 0 and q.counters().drop_stale_total == 2


def test_pop_for_ver_takes_oldest_of_that_version() -> None:
    q: ReadyPackQueue[str] = ReadyPackQueue(queue_limit=8, version_window=2)
    for name, ver in [("a0", 0), ("b1", 1), ("c0", 0), ("d1", 1)]:
        q.push(name, ver)
    assert q.eligible_counts() == ([0], [2])  # current version 0
    q.clock.advance(1)
    assert q.eligible_counts() == ([0, 1], [2, 2])
    assert q.pop_for_ver(1) == "b1" and q.pop_for_ver(0) == "a0"
    assert q.counters().popped_total == 2


def test_version_cannot_go_back() -> None:
    q: ReadyPackQueue[int] = ReadyPackQueue(queue_limit=2, version_window=0)
    q.clock.advance(3)
    with pytest.raises(ValueError, match="went back"):
        q.clock.advance(2)


def test_concurrent_push_and_pop_lose_nothing() -> None:
    q: ReadyPackQueue[int] = ReadyPackQueue(queue_limit=1000, version_window=0)
    popped: list[int] = []

    def produce(base: int) -> None:
        for k in range(200):
            q.push(base + k, ver=0)

    threads = [threading.Thread(target=produce, args=(1000 * t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    while q.depth():
        popped.append(q.pop_for_ver(0))
    assert sorted(popped) == sorted(1000 * t + k for t in range(4) for k in range(200))


@pytest.mark.parametrize(("limit", "window"), [(0, 1), (1, -1)])
def test_bad_limits(limit: int, window: int) -> None:
    with pytest.raises(ValueError):
        ReadyPackQueue(limit, window)


def test_held_packs_survive_drop_oldest_and_come_back_in_place_when_released() -> None:
    q: ReadyPackQueue[str] = ReadyPackQueue(queue_limit=3, version_window=1)
    q.clock.advance(1)
    for name, ver in [("a0", 0), ("b1", 1), ("c1", 1)]:
        q.push(name, ver)
    assert q.hold(gas=2) == ([0, 1], [1, 2])
    assert not q.push("d1", 1)  # full and everything held: the newcomer goes, not a held pack
    assert q.counters().drop_oldest_total == 1
    q.release_held()
    assert q.push("e1", 1)  # released: the oldest (a0) is the one to go now
    assert [q.pop_for_ver(1) for _ in range(3)] == ["b1", "c1", "e1"]


def test_take_held_returns_exactly_the_chosen_version_and_releases_the_rest() -> None:
    q: ReadyPackQueue[str] = ReadyPackQueue(queue_limit=8, version_window=1)
    q.clock.advance(1)
    for name, ver in [("a0", 0), ("b0", 0), ("c1", 1), ("d1", 1), ("e1", 1)]:
        q.push(name, ver)
    assert q.hold(gas=2) == ([0, 1], [2, 2])  # e1 is not held: gas 2 per version
    assert q.take_held(1) == ["c1", "d1"]
    assert q.hold(gas=2) == ([0, 1], [2, 1])  # a0, b0 were released by the take
    q.release_held()
    q.clock.advance(2)  # v0 goes stale once no longer held
    assert q.eligible_counts() == ([1, 2], [1, 0])


def test_stress_the_gate_never_loses_a_held_pack() -> None:
    """A producer pushes as fast as it can into a tiny queue (drop-oldest all the time, versions moving
    on) while the consumer runs thousands of hold -> decide -> take/release rounds: every decision to
    take `gas` packs of a version gets exactly `gas` packs of that version."""
    gas = 2
    q: ReadyPackQueue[tuple[int, int]] = ReadyPackQueue(queue_limit=3, version_window=1)
    stop = threading.Event()
    current = [0]

    def produce() -> None:
        k = 0
        while not stop.is_set():
            ver = current[0]
            q.push((ver, k), ver)
            k += 1

    producer = threading.Thread(target=produce)
    producer.start()
    taken = 0
    try:
        for round_ in range(3000):
            deadline = time.monotonic() + 1.0
            while q.depth() < 3 and time.monotonic() < deadline:  # let the producer refill
                time.sleep(0.0002)
            versions, held = q.hold(gas)
            feasible = [v for v, c in zip(versions, held, strict=True) if c >= gas]
            if feasible and round_ % 2:
                packs = q.take_held(feasible[0])
                assert len(packs) == gas and all(ver == feasible[0] for ver, _ in packs)
                taken += 1
            else:
                q.release_held()
            if round_ % 50 == 49:
                current[0] += 1
                q.clock.advance(current[0])
    finally:
        stop.set()
        producer.join()
    assert taken > 500  # the race was real: many decisions went to B while pushes evicted others
    assert q.counters().drop_oldest_total > 1000


def test_restore_keeps_packs_inside_the_window_and_drops_and_counts_the_rest() -> None:
    saved: ReadyPackQueue[str] = ReadyPackQueue(queue_limit=8, version_window=2)
    saved.clock.advance(1)
    saved.push("old", ver=0, size=3)
    saved.push("new", ver=1, size=2)
    packs, counters = saved.state()
    assert packs == [(0, "old"), (1, "new")] and counters["pushed_total"] == 2

    resumed: ReadyPackQueue[str] = ReadyPackQueue(queue_limit=8, version_window=2)
    resumed.clock.advance(3)  # the resumed run is two versions further: version 0 is outside the window
    resumed.restore(packs, counters, size=lambda pack: {"old": 3, "new": 2}[pack])
    assert resumed.state()[0] == [(1, "new")]
    after = resumed.counters()
    assert after.pushed_total == 2  # restored, not pushed again
    assert after.drop_stale_total == 1 and after.dropped_segments_total == 3


def test_restore_drops_packs_newer_than_the_current_version() -> None:
    """A resume whose weight push did not land leaves the version below the saved packs': they could never
    be trained (nor go stale), so they are dropped and counted."""
    resumed: ReadyPackQueue[str] = ReadyPackQueue(queue_limit=8, version_window=1)
    counters = {"pushed_total": 1, "popped_total": 0, "drop_oldest_total": 0, "drop_stale_total": 0}
    resumed.restore([(4, "ahead")], {**counters, "dropped_segments_total": 0}, size=lambda pack: 2)
    assert resumed.depth() == 0
    assert resumed.counters().drop_stale_total == 1 and resumed.counters().dropped_segments_total == 2


def test_the_shared_view_counts_older_packs_every_rank_holds_and_follows_takes() -> None:
    q: ReadyPackQueue[str] = ReadyPackQueue(queue_limit=8, version_window=2)
    for name in ("a", "b", "c", "d"):
        q.push(name, 0)
    assert q.pacing_counts() == ([0], [4], [4])  # never measured: this rank's own counts stand
    q.clock.advance(1)
    q.set_shared([0, 1], [2, 0])  # the other rank holds 2 packs of version 0; the current one is not kept
    assert q.shared() == {0: 2}
    q.push("e", 1)
    assert q.pacing_counts() == ([0, 1], [4, 1], [2, 1])
    versions, held = q.hold(2)
    assert (versions, held) == ([0, 1], [2, 1])
    assert q.take_held(0) == ["a", "b"]  # every rank takes 2 of version 0: none left that all ranks hold
    assert q.pacing_counts() == ([0, 1], [2, 1], [0, 1])
    saved = sorted((q.shared() or {}).items())
    other: ReadyPackQueue[str] = ReadyPackQueue(queue_limit=8, version_window=2)
    other.clock.advance(1)
    other.restore_shared(saved)
    assert other.shared() == {0: 0}
    other.restore_shared(None)  # a checkpoint from before the view was kept
    assert other.shared() is None
