"""`weightsync.gate.VersionGate`: a committed sync is swapped in between rollout calls, never inside one, and
never makes the sync wait for them."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from stagectl.weightsync.gate import VersionGate, WrongVersion


class Engine:
    def __init__(self) -> None:
        self.version = 0
        self.swaps: list[int] = []

    def swap_to(self, version: int) -> Any:
        def swap() -> None:
            self.swaps.append(version)
            self.version = version

        return swap


def test_a_sync_with_no_call_in_progress_is_swapped_in_at_once() -> None:
    engine = Engine()
    gate = VersionGate(engine)  # type: ignore[arg-type]
    assert gate.apply(1, engine.swap_to(1)) is True
    assert engine.version == 1 and gate.committed_version == 1 and gate.num_deferred == 0


def test_a_sync_during_a_call_waits_for_it_and_the_calls_it_admits() -> None:
    """The commit returns at once (deferred); the call in progress and a call tagged with the serving
    version finish on the old weights; an untagged call waits for the swap; the last call to leave swaps."""
    engine = Engine()
    gate = VersionGate(engine)  # type: ignore[arg-type]
    with gate.admit(None):
        assert gate.apply(1, engine.swap_to(1)) is False
        assert engine.version == 0 and gate.committed_version == 1 and gate.num_deferred == 1
        with gate.admit(0):  # the burst that began before the sync: still answered at version 0
            assert engine.version == 0
        assert engine.swaps == []  # the first call is still in progress
        seen: list[int] = []
        untagged = threading.Thread(target=lambda: _call(gate, None, engine, seen))
        untagged.start()
        time.sleep(0.05)
        assert seen == []  # it waits for the swap
    untagged.join(5.0)
    assert engine.swaps == [1] and seen == [1]


def test_stale_or_unknown_tags_are_refused() -> None:
    engine = Engine()
    gate = VersionGate(engine)  # type: ignore[arg-type]
    gate.apply(1, engine.swap_to(1))
    with pytest.raises(WrongVersion, match="weight_version 0 is no longer served"), gate.admit(0):
        pass
    with pytest.raises(WrongVersion, match="weight_version 2 was never committed"), gate.admit(2):
        pass
    with gate.admit(1):
        assert engine.version == 1


def test_the_next_sync_waits_for_a_pending_swap() -> None:
    engine = Engine()
    gate = VersionGate(engine)  # type: ignore[arg-type]
    release = threading.Event()

    def call() -> None:
        with gate.admit(None):
            release.wait(5.0)

    caller = threading.Thread(target=call)
    caller.start()
    time.sleep(0.05)
    gate.apply(1, engine.swap_to(1))
    with pytest.raises(TimeoutError, match="1 rollout call"):
        gate.wait_swapped(timeout_s=0.05)
    release.set()
    gate.wait_swapped(timeout_s=5.0)
    caller.join(5.0)
    assert engine.version == 1


def test_a_failing_deferred_swap_keeps_the_old_weights_and_is_counted() -> None:
    engine = Engine()
    gate = VersionGate(engine)  # type: ignore[arg-type]

    def broken() -> None:
        raise RuntimeError("engine gone")

    with gate.admit(None):
        gate.apply(1, broken)
    assert engine.version == 0 and gate.num_failed == 1 and gate.committed_version == 0
    with gate.admit(None):  # calls go on at the old version
        pass


def _call(gate: VersionGate, tag: int | None, engine: Engine, seen: list[int]) -> None:
    with gate.admit(tag):
        seen.append(engine.version)
