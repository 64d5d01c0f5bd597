"""`ReadyPackQueue`: one rank's bounded, versioned FIFO of ready packs (thread-safe).

Producer: the prefetcher thread (`push`). Consumer: the learner (`count_for_ver`, `pop_for_ver`).
When full, `push` drops the oldest pack (`drop_oldest_total`). Packs that fall out of the version
window are dropped and counted (`drop_stale_total`) and are never returned.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import Generic, TypeVar

from stagectl.prefetch.staleness import eligible_versions, is_stale

T = TypeVar("T")


@dataclass(frozen=True)
class QueueCounters:
    depth: int
    pushed_total: int
    popped_total: int
    drop_oldest_total: int
    drop_stale_total: int


class ReadyPackQueue(Generic[T]):
    def __init__(self, queue_limit: int, version_window: int) -> None:
        if queue_limit < 1:
            raise ValueError(f"queue_limit must be >= 1, got {queue_limit}")
        if version_window < 0:
            raise ValueError(f"version_window must be >= 0, got {version_window}")
        self.queue_limit = queue_limit
        self.version_window = version_window
        self._items: deque[tuple[int, T]] = deque()
        self._lock = threading.Lock()
        self._current_ver = 0
        self._pushed = self._popped = self._drop_oldest = self._drop_stale = 0

    def push(self, pack: T, ver: int) -> None:
        with self._lock:
            if is_stale(ver, self._current_ver, self.version_window):
                self._drop_stale += 1
                return
            if len(self._items) >= self.queue_limit:
                self._items.popleft()
                self._drop_oldest += 1
            self._items.append((ver, pack))
            self._pushed += 1

    def set_current_ver(self, ver: int) -> None:
        """Advance the learner's version; packs now outside the window are dropped."""
        with self._lock:
            if ver < self._current_ver:
                raise ValueError(f"policy version went back from {self._current_ver} to {ver}")
            self._current_ver = ver
            self._purge_stale()

    @property
    def current_ver(self) -> int:
        return self._current_ver

    def count_for_ver(self, ver: int) -> int:
        with self._lock:
            self._purge_stale()
            return sum(1 for v, _ in self._items if v == ver)

    def eligible_counts(self) -> tuple[list[int], list[int]]:
        """(versions oldest first, packs held of each) for the feasibility gate."""
        with self._lock:
            self._purge_stale()
            versions = eligible_versions(self._current_ver, self.version_window)
            counts = [sum(1 for v, _ in self._items if v == ver) for ver in versions]
            return versions, counts

    def pop_for_ver(self, ver: int) -> T:
        """The oldest pack of exactly version `ver`; `LookupError` if there is none."""
        with self._lock:
            self._purge_stale()
            for k, (v, pack) in enumerate(self._items):
                if v == ver:
                    del self._items[k]
                    self._popped += 1
                    return pack
            raise LookupError(f"no ready pack of version {ver} (depth {len(self._items)})")

    def depth(self) -> int:
        with self._lock:
            return len(self._items)

    def counters(self) -> QueueCounters:
        with self._lock:
            return QueueCounters(
                depth=len(self._items),
                pushed_total=self._pushed,
                popped_total=self._popped,
                drop_oldest_total=self._drop_oldest,
                drop_stale_total=self._drop_stale,
            )

    def _purge_stale(self) -> None:
        kept = deque(
            item for item in self._items if not is_stale(item[0], self._current_ver, self.version_window)
        )
        self._drop_stale += len(self._items) - len(kept)
        self._items = kept
