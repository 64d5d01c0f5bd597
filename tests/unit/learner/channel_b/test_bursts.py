"""The burst in progress as the learner sees it: coming packs counted once, waits that end for their burst."""

from __future__ import annotations

import threading

from stagectl.learner.channel_b.bursts import BurstState
from stagectl.learner.channel_b.clock import VersionClock


def test_coming_packs_count_for_their_version_until_queued() -> None:
    clock = VersionClock(3)
    state = BurstState(threading.Lock(), clock)
    with state.lock:
        state.begin()
        state.set_coming(3, 2)
    assert not state.behind()  # of the clock's version
    clock.advance(4)  # a sync while the burst runs: the burst is behind, read from the shared clock
    assert state.behind()
    versions, counts = [2, 3], [1, 0]
    state.add_coming(versions, counts)
    assert counts == [1, 2]
    other = [4]
    state.add_coming([4], other)  # a version the queue no longer takes: nothing added
    assert other == [4]
    with state.lock:
        state.queued()
    counts = [1, 2]
    state.add_coming(versions, counts)
    assert counts == [1, 2] and not state.behind()  # queued: no burst's packs are coming


def test_end_is_counted_once_per_burst() -> None:
    state = BurstState(threading.Lock(), VersionClock())
    with state.lock:
        state.begin()
        state.end()
        state.end()  # the failure path and the finally both end it
    assert state.wait(0.0, lambda: False) is True  # no burst in progress


def test_a_wait_ends_for_its_burst_even_when_the_next_has_begun() -> None:
    state = BurstState(threading.Lock(), VersionClock())
    with state.lock:
        state.begin()
    waiting = threading.Event()

    def give_up() -> bool:  # first asked under the lock as the wait begins
        waiting.set()
        return False

    waited: list[bool] = []
    waiter = threading.Thread(target=lambda: waited.append(state.wait(10.0, give_up)))
    waiter.start()
    assert waiting.wait(10.0)
    with state.lock:  # taken once the waiter waits; it wakes only after the next burst has begun
        state.end()
        state.begin()
    waiter.join(10.0)
    assert waited == [True]
    assert state.wait(0.05, lambda: False) is False  # the new burst is still in progress
    assert state.wait(0.05, lambda: True) is True  # give up: the thread stopped or failed


def test_the_first_burst_is_waited_for_until_it_ends_and_never_again() -> None:
    """A run's first B step waits for the thread's first burst (queued or failed): not before it has
    ended, at once after it, and not at all for a later burst."""
    state = BurstState(threading.Lock(), VersionClock())
    assert state.wait_first(0.05, lambda: False) is False  # the thread has not begun a burst yet
    with state.lock:
        state.begin()
        state.set_coming(0, 2)
    assert state.wait_first(0.05, lambda: False) is False  # in flight
    assert state.wait_first(0.05, lambda: True) is True  # the thread stopped or failed: no wait

    def end() -> None:
        with state.lock:
            state.end()

    threading.Timer(0.1, end).start()
    assert state.wait_first(10.0, lambda: False) is True
    with state.lock:
        state.begin()  # the next burst: the first one has ended, no start-up wait is left
    assert state.wait_first(0.0, lambda: False) is True


def test_an_idle_thread_ends_the_first_burst_wait() -> None:
    """Pacing wants nothing (a resume whose queue holds the coming B steps' packs): no first burst may
    come, so a waiter goes on; once a burst begins, it is waited for again."""
    state = BurstState(threading.Lock(), VersionClock())
    with state.lock:
        state.idle()
    assert state.wait_first(0.0, lambda: False) is True
    with state.lock:
        state.begin()
    assert state.wait_first(0.05, lambda: False) is False
