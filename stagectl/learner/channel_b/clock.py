"""`VersionClock`: the one object async and server Channel-B share for *when* — the policy version `ver`,
the learner's step position pacing reads, and the sync fence between rollout calls and weight sync.

- `ver`: the version the rollout servers serve. The weight publisher advances it (`advance`, inside the
  fence, before it opens); the ready-pack queue judges staleness against it, the rollout source tags its
  sections with it, the prefetcher's pacing and the learner's burst wait read it. Nobody keeps a copy.
- `next_step` / `open_step`: the step whose channel decision comes next, and the first step whose
  post-update weight sync is still ahead (the learner moves them; pacing reads them).
- The fence: rollout HTTP calls enter a shared section (`with clock.call():`) that blocks while a sync is
  pending; a sync (`with clock.sync():`) blocks new calls and waits for in-flight ones to finish, so the
  server never answers a request with half-updated weights from the learner's point of view. Only the HTTP
  call itself is fenced, never a section that makes further fenced calls: nesting is refused, which is
  what makes a deadlock between a sync and the prefetcher impossible.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager


class VersionClock:
    def __init__(self, ver: int = 0) -> None:
        self._cond = threading.Condition()
        self._ver = ver
        self._in_flight = 0
        self._sync_pending = False
        self._local = threading.local()
        self.next_step = 0  # the optimizer step whose channel decision comes next
        self.open_step = 0  # the first step whose post-update weight sync has not happened yet
        self.num_calls = 0
        self.num_syncs = 0
        self.wait_s_total = 0.0  # syncs waiting for calls in flight (and for an earlier sync) to end

    # ------------------------------------------------------------------ the version

    @property
    def ver(self) -> int:
        """The policy version the rollout servers serve (the learner's weights after the last push)."""
        return self._ver

    def advance(self, ver: int) -> None:
        """Move to version `ver` (the publisher, after a push landed; never backwards)."""
        with self._cond:
            if ver < self._ver:
                raise ValueError(f"policy version went back from {self._ver} to {ver}")
            self._ver = ver

    # ------------------------------------------------------------------ the fence

    @contextmanager
    def call(self) -> Iterator[None]:
        if getattr(self._local, "inside", False):
            raise RuntimeError("nested fenced call: only the HTTP call itself may be fenced")
        with self._cond:
            while self._sync_pending:
                self._cond.wait()
            self._in_flight += 1
            self.num_calls += 1
        self._local.inside = True
        try:
            yield
        finally:
            self._local.inside = False
            with self._cond:
                self._in_flight -= 1
                self._cond.notify_all()

    @contextmanager
    def sync(self, timeout_s: float | None = None) -> Iterator[None]:
        """Pause new calls, wait for in-flight ones (TimeoutError after `timeout_s`), run the body."""
        if getattr(self._local, "inside", False):
            raise RuntimeError("sync from inside a fenced call would wait for itself")
        started = time.monotonic()
        deadline = None if timeout_s is None else started + timeout_s
        with self._cond:
            while self._sync_pending:  # one sync at a time
                self._cond.wait()
            self._sync_pending = True
            try:
                while self._in_flight:
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        raise TimeoutError(
                            f"{self._in_flight} rollout call(s) still in flight after {timeout_s}s"
                        )
                    self._cond.wait(remaining)
            except BaseException:
                self._sync_pending = False
                self._cond.notify_all()
                raise
            self.wait_s_total += time.monotonic() - started
        try:
            yield
        finally:
            with self._cond:
                self._sync_pending = False
                self.num_syncs += 1
                self._cond.notify_all()

    @property
    def sync_pending(self) -> bool:
        """A sync waits for the calls in flight (a section that makes more calls should end soon)."""
        with self._cond:
            return self._sync_pending

    @property
    def in_flight(self) -> int:
        with self._cond:
            return self._in_flight
