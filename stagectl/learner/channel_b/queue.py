"""`ReadyPackQueue`: one rank's bounded, versioned FIFO of ready packs (thread-safe).

Producer: the prefetcher thread (`push`). Consumer: the learner's feasibility gate, which works in two
moves around its collectives so that no push can take away what it decided on:

1. `hold(gas)`: under the lock, set aside up to `gas` packs of every eligible version (oldest first)
   and report how many of each were held; held packs are out of reach of drop-oldest and staleness.
2. after the collective decision, `take_held(ver)` returns exactly the held packs of `ver` and puts every
   other held pack back where it was; `release_held()` puts them all back (the step went to Channel-A).

When full, `push` drops the oldest pack that is not held (`drop_oldest_total`); when every pack is
held, the new pack itself is dropped. Packs that fall out of the version window are dropped and counted
(`drop_stale_total`) and are never returned. Each pack carries a size (its segments) so the drops can be
counted in rollouts too.

The shared view (`set_shared`, read by pacing through `pacing_counts`): for each version older than the
current one, how many of its packs EVERY rank holds (the minimum over ranks, measured at the weight sync
that made it older, when it could no longer grow; lowered by each B step that takes packs of it). Pacing
counts an older group as covering a coming B step only if every rank has it: a group one rank holds alone
can never pass the gate.

The version is the shared `VersionClock`'s (the publisher advances it; the queue keeps no copy). Its
arithmetic is pure functions at the end of the module: a ready pack built from rollouts of policy version
`ver` is *eligible* at learner version `current` iff `current - version_window <= ver <= current`; older
packs are *stale* (dropped, never trained); the feasibility gate (`decide_step`) picks the oldest version
every rank holds `gas` packs of.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Generic, Literal, TypeVar

from stagectl.learner.channel_b.clock import VersionClock

T = TypeVar("T")


@dataclass(frozen=True)
class QueueCounters:
    depth: int
    pushed_total: int
    popped_total: int
    drop_oldest_total: int
    drop_stale_total: int
    dropped_segments_total: int  # segments inside the dropped packs (stale or oldest)


@dataclass
class _Entry(Generic[T]):
    ver: int
    pack: T
    size: int
    held: bool = False


class ReadyPackQueue(Generic[T]):
    def __init__(self, queue_limit: int, version_window: int, clock: VersionClock | None = None) -> None:
        """`clock`: the shared version clock the queue judges staleness against (its own when None)."""
        if queue_limit < 1:
            raise ValueError(f"queue_limit must be >= 1, got {queue_limit}")
        if version_window < 0:
            raise ValueError(f"version_window must be >= 0, got {version_window}")
        self.queue_limit = queue_limit
        self.version_window = version_window
        self._items: list[_Entry[T]] = []  # push order; held entries keep their place
        self._lock = threading.Lock()
        self.clock = clock if clock is not None else VersionClock()
        self._shared: dict[int, int] | None = None  # None: never measured (each rank's own counts stand)
        self._pushed = self._popped = self._drop_oldest = self._drop_stale = self._dropped_segments = 0

    # ------------------------------------------------------------------ producer

    def push(self, pack: T, ver: int, size: int = 1) -> bool:
        """Queue `pack` of version `ver` (`size` segments); False if it was dropped instead."""
        with self._lock:
            if is_stale(ver, self.clock.ver, self.version_window):
                self._drop_stale += 1
                self._dropped_segments += size
                return False
            if len(self._items) >= self.queue_limit:
                victim = next((e for e in self._items if not e.held), None)
                if victim is None:  # everything is held by the gate: the newcomer is the one to go
                    self._drop_oldest += 1
                    self._dropped_segments += size
                    return False
                self._items.remove(victim)
                self._drop_oldest += 1
                self._dropped_segments += victim.size
            self._items.append(_Entry(ver, pack, size))
            self._pushed += 1
            return True

    # ------------------------------------------------------------------ consumer

    @property
    def current_ver(self) -> int:
        """The clock's version (packs outside its window are dropped at the next read or push)."""
        return self.clock.ver

    def eligible_counts(self) -> tuple[list[int], list[int]]:
        """(versions oldest first, this rank's packs of each, held or not) — what the sync's shared view and
        metrics read."""
        versions, own, _ = self.pacing_counts()
        return versions, own

    def set_shared(self, versions: list[int], counts: list[int]) -> None:
        """The packs of each version every rank holds (the minimum over ranks of `eligible_counts`),
        measured right after a weight sync; only the versions older than the current one are kept."""
        with self._lock:
            current = self.clock.ver
            self._shared = {v: c for v, c in zip(versions, counts, strict=True) if v < current}

    def restore_shared(self, pairs: list[tuple[int, int]] | None) -> None:
        """Put back a checkpoint's shared view (`sorted(shared().items())`); None: not measured (a
        checkpoint written before it was kept): each rank's own counts stand until the next sync."""
        with self._lock:
            self._shared = None if pairs is None else {int(v): int(c) for v, c in pairs}

    def shared(self) -> dict[int, int] | None:
        with self._lock:
            return None if self._shared is None else dict(self._shared)

    def pacing_counts(self) -> tuple[list[int], list[int], list[int]]:
        """(versions oldest first, this rank's packs of each, the packs of each that every rank holds as
        far as this rank knows: the shared view for older versions, this rank's own count otherwise)."""
        with self._lock:
            current = self._purge_stale()
            versions = eligible_versions(current, self.version_window)
            own = [sum(1 for e in self._items if e.ver == v) for v in versions]
            if self._shared is None:
                return versions, own, list(own)
            shared = [
                min(c, self._shared.get(v, 0)) if v < current else c
                for v, c in zip(versions, own, strict=True)
            ]
            return versions, own, shared

    def hold(self, gas: int) -> tuple[list[int], list[int]]:
        """Hold up to `gas` packs of every eligible version (oldest packs first) and return
        (versions oldest first, packs held of each). Held packs stay until `take_held`/`release_held`."""
        with self._lock:
            if any(e.held for e in self._items):
                raise RuntimeError("hold() while packs are still held: take or release them first")
            current = self._purge_stale()
            versions = eligible_versions(current, self.version_window)
            counts = []
            for ver in versions:
                mine = [e for e in self._items if e.ver == ver][:gas]
                for entry in mine:
                    entry.held = True
                counts.append(len(mine))
            return versions, counts

    def take_held(self, ver: int) -> list[T]:
        """The held packs of `ver` (oldest first), removed; every other held pack is released."""
        with self._lock:
            taken = [e for e in self._items if e.held and e.ver == ver]
            self._items = [e for e in self._items if not (e.held and e.ver == ver)]
            for entry in self._items:
                entry.held = False
            self._popped += len(taken)
            if self._shared is not None and ver in self._shared:  # every rank took as many of `ver`
                self._shared[ver] = max(0, self._shared[ver] - len(taken))
            return [e.pack for e in taken]

    def release_held(self) -> None:
        with self._lock:
            for entry in self._items:
                entry.held = False
            self._purge_stale()

    def pop_for_ver(self, ver: int) -> T:
        """The oldest pack of exactly version `ver` (tests and tools; the learner uses hold/take)."""
        with self._lock:
            self._purge_stale()
            for k, entry in enumerate(self._items):
                if entry.ver == ver and not entry.held:
                    del self._items[k]
                    self._popped += 1
                    return entry.pack
            raise LookupError(f"no ready pack of version {ver} (depth {len(self._items)})")

    def depth(self) -> int:
        with self._lock:
            return len(self._items)

    def counters(self) -> QueueCounters:
        with self._lock:
            return self._counters()

    def _counters(self) -> QueueCounters:  # under the lock
        return QueueCounters(
            depth=len(self._items),
            pushed_total=self._pushed,
            popped_total=self._popped,
            drop_oldest_total=self._drop_oldest,
            drop_stale_total=self._drop_stale,
            dropped_segments_total=self._dropped_segments,
        )

    # ------------------------------------------------------------------ checkpoint and resume

    def state(self) -> tuple[list[tuple[int, T]], dict[str, int]]:
        """(every queued pack with its version, in queue order; the counters) for a checkpoint. Taken
        between steps: a held pack here is a programming error."""
        with self._lock:
            assert not any(e.held for e in self._items), "queue state taken while packs are held"
            counters = asdict(self._counters())
            return [(e.ver, e.pack) for e in self._items], counters

    def restore(self, packs: list[tuple[int, T]], counters: dict[str, int], size: Callable[[T], int]) -> None:
        """Refill an empty queue from `state()`'s output: the counters as saved, then each pack under
        `push`'s rules without counting it as pushed again. A pack outside the version window — older than
        it, or newer than the current version (a resume whose weight push did not land) — is dropped and
        counted as stale."""
        with self._lock:
            if self._items:
                raise RuntimeError("restore() into a queue that already holds packs")
            self._pushed = int(counters["pushed_total"])
            self._popped = int(counters["popped_total"])
            self._drop_oldest = int(counters["drop_oldest_total"])
            self._drop_stale = int(counters["drop_stale_total"])
            self._dropped_segments = int(counters["dropped_segments_total"])
        for ver, pack in packs:
            if ver > self.clock.ver:
                with self._lock:
                    self._drop_stale += 1
                    self._dropped_segments += size(pack)
                continue
            if self.push(pack, ver, size(pack)):
                with self._lock:
                    self._pushed -= 1

    def _purge_stale(self) -> int:
        """Drop the packs outside the window of the clock's version (under the lock); that version."""
        current = self.clock.ver  # read once: a sync may move it meanwhile
        kept = []
        for entry in self._items:
            if not entry.held and is_stale(entry.ver, current, self.version_window):
                self._drop_stale += 1
                self._dropped_segments += entry.size
            else:
                kept.append(entry)
        self._items = kept
        return current


def is_stale(ver: int, current_ver: int, version_window: int) -> bool:
    return ver < current_ver - version_window


def eligible_versions(current_ver: int, version_window: int) -> list[int]:
    """Versions a B step may consume, oldest first."""
    return list(range(max(0, current_ver - version_window), current_ver + 1))


def choose_b_version(versions: Sequence[int], min_counts: Sequence[int], gas: int) -> int | None:
    """The feasibility gate: `min_counts[i]` is the MIN over ranks of packs held of `versions[i]`.
    A version is feasible when every rank holds at least `gas` packs of it; the oldest feasible one
    wins (it is the first to go stale). None when no version is feasible."""
    for ver, count in zip(versions, min_counts, strict=True):
        if count >= gas:
            return ver
    return None


def decide_step(
    policy_wants_b: bool, versions: Sequence[int], min_counts: Sequence[int], gas: int
) -> tuple[Literal["A", "B"], int | None]:
    """Policy gate then feasibility gate: ("B", ver) or ("A", None). Wants-B-but-infeasible -> A."""
    if not policy_wants_b:
        return "A", None
    ver = choose_b_version(versions, min_counts, gas)
    return ("B", ver) if ver is not None else ("A", None)
