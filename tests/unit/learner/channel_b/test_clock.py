"""The sync fence: syncs wait for in-flight calls, block new ones, and can never deadlock."""

from __future__ import annotations

import random
import threading
import time

import pytest

from stagectl.learner.channel_b.clock import VersionClock


def test_sync_waits_for_in_flight_call() -> None:
    fence = VersionClock()
    entered, release = threading.Event(), threading.Event()
    order: list[str] = []

    def call() -> None:
        with fence.call():
            entered.set()
            release.wait(5)
            order.append("call done")

    t = threading.Thread(target=call)
    t.start()
    entered.wait(5)
    syncer = threading.Thread(target=lambda: _sync(fence, order))
    syncer.start()
    time.sleep(0.1)
    assert order == []  # the sync is waiting for the call
    assert fence.sync_pending  # what a section making more calls checks to end early
    release.set()
    t.join(5)
    syncer.join(5)
    assert order == ["call done", "sync"]
    assert not fence.sync_pending and fence.wait_s_total >= 0.1  # the sync's wait, for time/fence_s


def _sync(fence: VersionClock, order: list[str]) -> None:
    with fence.sync():
        order.append("sync")


def test_new_calls_block_while_sync_pending() -> None:
    fence = VersionClock()
    in_sync, finish_sync = threading.Event(), threading.Event()
    events: list[str] = []

    def syncer() -> None:
        with fence.sync():
            in_sync.set()
            finish_sync.wait(5)
            events.append("sync end")

    def caller() -> None:
        with fence.call():
            events.append("call")

    s = threading.Thread(target=syncer)
    s.start()
    in_sync.wait(5)
    c = threading.Thread(target=caller)
    c.start()
    time.sleep(0.1)
    assert events == []
    finish_sync.set()
    s.join(5)
    c.join(5)
    assert events == ["sync end", "call"]


def test_nested_calls_are_refused() -> None:
    fence = VersionClock()
    with fence.call(), pytest.raises(RuntimeError, match="nested"), fence.call():
        pass
    with fence.call(), pytest.raises(RuntimeError, match="wait for itself"), fence.sync():
        pass
    assert fence.in_flight == 0


def test_sync_timeout_releases_the_fence() -> None:
    fence = VersionClock()
    stuck = threading.Event()
    entered = threading.Event()

    def call() -> None:
        with fence.call():
            entered.set()
            stuck.wait(5)

    t = threading.Thread(target=call)
    t.start()
    entered.wait(5)
    with pytest.raises(TimeoutError, match="in flight"), fence.sync(timeout_s=0.1):
        pass
    stuck.set()
    t.join(5)
    with fence.call():  # new calls are not blocked by the failed sync
        pass


def test_many_calls_and_syncs_interleaving_never_deadlock() -> None:
    """8 prefetcher-like threads making fenced calls + 2 syncing threads; the test fails (instead of
    hanging) if anything is still blocked after the deadline, and checks mutual exclusion."""
    fence = VersionClock()
    state = {"in_call": 0, "in_sync": 0, "violations": 0}
    lock = threading.Lock()
    stop = time.monotonic() + 2.0
    rng = random.Random(0)

    def caller() -> None:
        while time.monotonic() < stop:
            with fence.call():
                with lock:
                    state["in_call"] += 1
                    state["violations"] += state["in_sync"] > 0
                time.sleep(rng.random() * 0.002)
                with lock:
                    state["in_call"] -= 1

    def syncer() -> None:
        while time.monotonic() < stop:
            with fence.sync(timeout_s=5):
                with lock:
                    state["in_sync"] += 1
                    state["violations"] += state["in_call"] > 0 or state["in_sync"] > 1
                time.sleep(0.001)
                with lock:
                    state["in_sync"] -= 1
            time.sleep(0.005)

    threads = [threading.Thread(target=caller, daemon=True) for _ in range(8)]
    threads += [threading.Thread(target=syncer, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=15)
    assert not any(t.is_alive() for t in threads), "deadlock: threads still blocked"
    assert state["violations"] == 0
    assert fence.num_syncs > 10 and fence.num_calls > 100
