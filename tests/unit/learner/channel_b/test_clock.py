"""The version clock: one `ver` the publisher advances and the queue and the rollout source read; its sync
fence: syncs wait for in-flight calls, block new ones, and can never deadlock."""

from __future__ import annotations

import random
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from stagectl.config.sampling import SamplingSpec
from stagectl.dist import World
from stagectl.learner.channel_b.clock import VersionClock
from stagectl.learner.channel_b.publisher import WeightPublisher
from stagectl.learner.channel_b.queue import ReadyPackQueue
from stagectl.learner.channel_b.rollouts import ServerRollouts


class _Servers:
    """A weight sync whose servers take every push (only what `WeightPublisher` calls)."""

    def __init__(self) -> None:
        self.served = 0

    def versions(self) -> list[Any]:
        return [SimpleNamespace(version=self.served, engine="hf")]

    def keeps_delta_base(self) -> bool:
        return False

    def push_weights(self, state_dict: Any, version: int, base_version: int | None = None) -> Any:
        self.served = version
        return SimpleNamespace(num_bytes=8, state_bytes=8, delta=False)


def test_a_sync_moves_the_one_version_the_queue_and_the_rollout_source_read() -> None:
    """No copy of `ver`: the publisher advances the shared clock inside the fence; the queue judges its packs
    by it (a version-0 pack goes stale at version 1 with window 0, before the fence opens) and the next
    rollout section takes it, with nobody forwarding it."""
    clock = VersionClock()
    servers = _Servers()
    publisher = WeightPublisher(servers, torch.nn.Linear(2, 2), World(0, 0, 1), num_updates=0, clock=clock)  # type: ignore[arg-type]
    queue: ReadyPackQueue[str] = ReadyPackQueue(queue_limit=4, version_window=0, clock=clock)
    source = ServerRollouts(None, None, SamplingSpec(max_new_tokens=8), 2, clock)  # type: ignore[arg-type]
    assert queue.push("pack of version 0", 0)
    seen: list[tuple[int, list[int], list[int]]] = []
    outcome = publisher.sync(None, then=lambda _: seen.append((queue.current_ver, *queue.eligible_counts())))
    assert outcome.status == "ok" and servers.served == 1 and publisher.ver == 1
    assert seen == [(1, [1], [0])]  # inside the fence: the queue already at version 1, the old pack gone
    assert queue.counters().drop_stale_total == 1
    with source.section() as section:
        assert section.ver == 1
    with pytest.raises(ValueError, match="went back from 1 to 0"):
        clock.advance(0)


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
