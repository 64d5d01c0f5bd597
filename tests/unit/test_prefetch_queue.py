"""Async Channel-B: version arithmetic, the feasibility gate, the ready-pack queue."""

from __future__ import annotations

import itertools
import threading

import pytest

from stagectl.prefetch.queue import ReadyPackQueue
from stagectl.prefetch.staleness import choose_b_version, decide_step, eligible_versions, is_stale
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
    q.set_current_ver(2)  # window 1: v0 < 2 - 1 is stale
    assert q.count_for_ver(0) == 0
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
    q.set_current_ver(1)
    assert q.eligible_counts() == ([0, 1], [2, 2])
    assert q.pop_for_ver(1) == "b1" and q.pop_for_ver(0) == "a0"
    assert q.counters().popped_total == 2


def test_version_cannot_go_back() -> None:
    q: ReadyPackQueue[int] = ReadyPackQueue(queue_limit=2, version_window=0)
    q.set_current_ver(3)
    with pytest.raises(ValueError, match="went back"):
        q.set_current_ver(2)


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
