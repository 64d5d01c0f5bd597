"""The async Channel-B prefetcher: one background thread per learner rank that turns rollouts into
ready packs (rollout -> parse -> match -> targets -> encode -> pack), tagged with the policy version
that generated them, in the rank's bounded `ReadyPackQueue`.

- Bursts: one B step's packs at a time, the nearest B step first (how a burst is sized, filled and
  packed: `bursts`). A burst never makes more packs than pacing asked for; what fits nowhere starts the
  next burst of the same version or is dropped and counted.
- One shared clock: the policy version `ver`, the learner's step position and the sync fence are the
  `VersionClock` the publisher advances and the queue and the source read; the segments, the packs'
  grouping and their collation are the run's `PackBuilder` (packed or padded, decided there).
- Version purity: a burst runs inside one fenced section of the source (the sync fence stays closed
  until its packs are queued), so every rollout of a burst comes from one version — the one captured
  when the section passed the fence — and its packs are queued before the next sync can start: the next
  step's gate always sees them. A sync that arrives while a burst is open waits for the request in flight
  only: the burst skips its remaining top-ups and packs what it has (`cut_short_total`). With
  `in_flight_sync` the source holds no fence: the servers answer each call at the section's version
  (`weight_version`) or refuse it once a sync has been swapped in (`WrongVersionError`); a refused call
  gives its samples and seed back to the stream (`refused_total`), the burst packs what it has (its
  version is still eligible), and a B step whose packs are missing waits for the burst (`wait_burst`).
- Start-up: the thread starts with the learner's step loop, so a B step of the run's (or the resume's)
  first steps may come before its first burst has queued anything: that step waits for the first burst
  (`wait_first_burst`), whatever its version.
- Pacing: nothing is requested while `pacing.packs_wanted` is zero (the queue holds what the coming B
  steps can train), and never more than fits under `prefetch_target_packs`.
- Seeds: request `k` of the thread is seeded `derive_seed(training.seed, rank, k)` (`num_chunks` is
  saved with the rank's state, so a resumed run continues the sequence).
- Errors: every failure is counted; `pacing.FailurePolicy` says when to retry (server trouble with
  back-off, so the learner keeps training Channel-A meanwhile; the burst's samples are retried, unless a
  server answered one request HTTP 500 twice: `RolloutRequestFailedError`, it may fail each time) and when
  to give up. Then the thread stops and keeps the exception; the learner re-raises it (`raise_if_failed`).
- Checkpoints (lossless resume): the thread publishes a *commit point* under `_lock` at the end of every
  burst; `snapshot` reads it, the carried segments and the queue under the same lock, so a checkpoint
  never sees half a burst; `restore` rebuilds the saved packs and leftovers (the layout and the
  rebuilding: `records`).
- Shutdown: the owner sets the stop event (`request_stop`), closes the HTTP client (which ends a call
  in flight), then joins (`join`) with a deadline; a failure caused by the shutdown itself is not an
  error. A thread still alive after the deadline is an error the owner raises.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from stagectl.data.sampler import ShardedSampler
from stagectl.detection.stats import RolloutStats
from stagectl.learner.channel_b.bursts import SERVER_TROUBLE, BurstState, queue_packs, request_rollouts
from stagectl.learner.channel_b.clock import VersionClock
from stagectl.learner.channel_b.pacing import (
    FailurePolicy,
    PacingRules,
    QueueView,
    packs_wanted,
    request_size,
    update_estimate,
)
from stagectl.learner.channel_b.packs import PackBuilder
from stagectl.learner.channel_b.queue import QueueCounters, ReadyPackQueue
from stagectl.learner.channel_b.records import (
    Built,
    PrefetchCounters,
    PrefetchError,
    ReadyPack,
    Rollout,
    Section,
    VersionedSource,
    commit_point,
    rebuild_packs,
    rebuild_segments,
    snapshot_state,
)
from stagectl.seeds import derive_seed
from stagectl.wire.errors import RolloutRequestFailedError, WrongVersionError


@dataclass
class Prefetcher:
    source: VersionedSource
    packs: PackBuilder  # rollouts -> segments -> packs -> micro-batches
    sampler: ShardedSampler
    queue: ReadyPackQueue[ReadyPack]  # judges staleness by `queue.clock`, the clock this thread reads
    rules: PacingRules
    initial_tokens_per_rollout: float  # before the first burst: prompt + max_new_tokens (an upper bound)
    max_consecutive_failures: int
    outage_timeout_s: float
    seed: int
    rank: int
    num_chunks: int = 0  # rollout requests so far (seeds derive from it; restored on resume)
    counters: PrefetchCounters = field(default_factory=PrefetchCounters)
    # request sizes to align to, largest first: the servers' batch, the decode batch (`pacing.request_multiples`)
    request_multiples: tuple[int, ...] = (1,)
    cpus: Sequence[int] | None = None  # pin the thread (and the request threads it starts) to these CPUs
    idle_wait_s: float = 0.02
    MAX_ROUNDS = 3  # requests per burst: the first, then top-ups while short of the target

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._failures = FailurePolicy(self.max_consecutive_failures, self.outage_timeout_s)
        self._tokens_per_rollout = self.initial_tokens_per_rollout
        self._carry: list[Built] = []
        self._carry_ver = -1
        self._lock = threading.Lock()  # the commit point, the carry and the queue's pushes move together
        self._bursts = BurstState(self._lock, self.clock)  # the burst in progress, for the learner
        self._commit()
        self._thread = threading.Thread(target=self._run, name=f"prefetcher-rank{self.rank}", daemon=True)

    @property
    def clock(self) -> VersionClock:
        """The shared version clock (the queue's): `ver`, the learner's step position, the fence."""
        return self.queue.clock

    # ------------------------------------------------------------------ owner side

    def start(self) -> None:
        self._thread.start()

    def request_stop(self) -> None:
        """Ask the thread to stop after the current burst (close the client to end that burst)."""
        self._stop.set()

    def join(self, deadline_s: float) -> bool:
        """Wait for the thread to end; False if it is still alive after `deadline_s`."""
        if self._thread.is_alive():
            self._thread.join(deadline_s)
        return not self._thread.is_alive()

    def stop(self, deadline_s: float = 30.0) -> bool:
        """`request_stop` then `join`."""
        self.request_stop()
        return self.join(deadline_s)

    def counts_with_coming(self) -> tuple[list[int], list[int]]:
        """The queue's `eligible_counts`, each version's count with the packs the burst in progress will
        queue added: read together under the lock its pushes take, so no pack is counted twice or missed."""
        with self._lock:
            versions, counts = self.queue.eligible_counts()
            self._bursts.add_coming(versions, counts)
            return versions, counts

    def counters_now(self) -> tuple[PrefetchCounters, QueueCounters]:
        """Copies of this thread's and the queue's counters, read under the lock a burst's packing holds: a
        metrics row never counts a burst as succeeded whose packs are not yet counted as produced or queued."""
        with self._lock:
            return replace(self.counters), self.queue.counters()

    def burst_behind(self) -> bool:
        """A burst is in progress (its section started, its packs not yet queued) at a version older than
        the clock's: it began before the last sync."""
        return self._bursts.behind()

    def wait_burst(self, timeout_s: float | None) -> bool:
        """Wait until the burst in progress, if any, has ended (or the thread stopped or failed); False
        after `timeout_s`. It returns for that burst even when the next has already begun."""
        return self._bursts.wait(timeout_s, self._gone)

    def wait_first_burst(self, timeout_s: float | None) -> bool:
        """Wait until the thread's first burst has ended (its packs queued, or it failed), the thread
        found nothing to make, stopped or failed; False after `timeout_s`. At once after the first burst."""
        return self._bursts.wait_first(timeout_s, self._gone)

    def _gone(self) -> bool:
        return self._error is not None or self._stop.is_set()

    @property
    def thread_ident(self) -> int | None:
        return self._thread.ident

    @property
    def failed(self) -> bool:
        return self._error is not None

    def error(self) -> str | None:
        """A one-line description of the error that stopped the thread, if any."""
        if self._error is None:
            return None
        return f"{type(self._error).__name__}: {self._error}"

    def raise_if_failed(self) -> None:
        if self._error is not None:
            raise PrefetchError(
                f"Channel-B prefetcher (rank {self.rank}) failed: {self.error()}"
            ) from self._error

    # ------------------------------------------------------------------ checkpoint and resume

    def _commit(self) -> None:
        """Record the state after the last finished burst (call under `_lock`, or before `start`)."""
        self._committed: dict[str, Any] = commit_point(
            self.sampler.num_consumed, self.num_chunks, self._tokens_per_rollout, self.counters
        )

    def snapshot(self) -> dict[str, Any]:
        """The rank's async state as plain data (ints, floats, strings, lists, dicts): the commit point,
        the carried leftovers and every queued pack with its version and rollouts. Called by the learner
        between steps (no pack held); a burst in flight is not part of it."""
        with self._lock:
            entries, queue_counters = self.queue.state()
            return snapshot_state(
                self._committed, self._carry, self._carry_ver, entries, queue_counters, self.queue.shared()
            )

    def restore(self, state: dict[str, Any]) -> None:
        """Continue from `snapshot`'s output (before `start`; the queue's version already current):
        the B stream at the saved position, the leftovers carried, the packs rebuilt and queued under
        the staleness rule (a pack outside the window is dropped and counted)."""
        assert not self._thread.is_alive(), "restore before start"
        self.sampler.num_consumed = int(state["stream_pos"])
        self.num_chunks = int(state["num_chunks"])
        self._tokens_per_rollout = float(state["tokens_per_rollout"])
        self.counters = PrefetchCounters(**state["counters"])
        self._carry = rebuild_segments(self.packs, [Rollout(**r) for r in state["carry"]])
        self._carry_ver = int(state["carry_ver"])
        packs = rebuild_packs(state["packs"], self.packs)
        self.queue.restore(packs, state["queue_counters"], size=lambda pack: pack.num_segments)
        self.queue.restore_shared(state.get("shared"))  # absent from checkpoints written before it was kept
        self._commit()

    # ------------------------------------------------------------------ thread

    def _run(self) -> None:
        try:
            if self.cpus is not None:  # this thread only (Linux: pid 0 is the calling thread)
                os.sched_setaffinity(0, self.cpus)
            while not self._stop.is_set():
                packs = self._packs_wanted()
                if packs == 0:
                    with self._lock:
                        self._bursts.idle()
                    self._stop.wait(self.idle_wait_s)
                    continue
                # one B step's packs per burst, the nearest B step first: a burst for two steps ahead
                # that finishes after the first of them has made it skip to A, and its packs go stale
                num_packs = min(packs, self.rules.gas)
                self._burst(num_packs, another_follows=packs > num_packs)
        except BaseException as exc:  # handed to the learner, never swallowed
            self._error = exc
        finally:
            with self._lock:
                self._bursts.thread_ended()  # a learner waiting for a burst goes on now

    def _packs_wanted(self) -> int:
        versions, counts, shared = self.queue.pacing_counts()
        view = QueueView(versions, counts, self.clock.ver, shared)
        return packs_wanted(self.clock.next_step, view, self.rules, open_step=self.clock.open_step)

    def _burst(self, num_packs: int, *, another_follows: bool = False) -> None:
        """Fill `num_packs` packs in one fenced section. `another_follows`: pacing wants more packs of this
        version than these, so a next burst of it comes at once (its requests may be rounded up: what does
        not fit these packs starts that burst, see `_roll_out`)."""
        started = time.perf_counter()
        with self._lock:
            self._bursts.begin()
        try:
            self._burst_in(num_packs, another_follows, started)
        finally:
            with self._lock:
                self._bursts.end()  # does nothing when `_commit_failed` has ended it

    def _burst_in(self, num_packs: int, another_follows: bool, started: float) -> None:
        try:
            with self.source.section() as section:
                with self._lock:
                    self._bursts.set_coming(section.ver, num_packs)
                carried = self._take_carry(section.ver)
                if self.packs.segments_per_pack is None:
                    built, dropped = self._roll_out(
                        section,
                        num_packs * self.rules.pack_tokens,
                        num_packs * self.packs.packing_length,
                        carried,
                        round_up=another_follows,
                    )
                else:
                    built, dropped = self._roll_out_count(
                        section, num_packs * self.packs.segments_per_pack, carried
                    )
                # still inside the section: fenced, the packs are queued before any sync can start
                self._failures.succeeded()
                self._pack(built, dropped, section.ver, num_packs)
        except SERVER_TROUBLE as exc:
            if not self._stop.is_set():  # a call ended by the shutdown closing the client is no failure
                self._commit_failed(give_back=not isinstance(exc, RolloutRequestFailedError))
                self._on_failure(exc, transient=True)
            return
        except Exception as exc:
            if not self._stop.is_set():
                self._commit_failed(give_back=False)
                self._on_failure(exc, transient=False)
            return
        self.counters.busy_s += time.perf_counter() - started

    def _commit_failed(self, *, give_back: bool) -> None:
        """A burst failed; its leftovers stay carried. Server trouble (`give_back`): its samples and seeds
        are the retry's, as a resume's are (an outage burned the stream). Else they are gone (counted): a
        request a server failed on its own may fail at every retry (the stream would never get past it)."""
        with self._lock:
            if give_back:
                self.sampler.num_consumed = int(self._committed["stream_pos"])
                self.num_chunks = int(self._committed["num_chunks"])
            else:
                self.counters.lost_total += self.sampler.num_consumed - self._committed["stream_pos"]
            self._commit()
            self._bursts.end()  # a learner waiting for it goes on now, not after the back-off

    def _take_carry(self, ver: int) -> list[Built]:
        """The segments the last burst could not fit, if they are of `ver`; older ones are dropped (and
        that is committed at once). The carry itself is replaced only when this burst commits."""
        if self._carry and self._carry_ver != ver:
            with self._lock:
                self.counters.carry_dropped_total += len(self._carry)
                self._carry = []
                self._commit()
        return list(self._carry)

    def _roll_out(
        self,
        section: Section,
        target_tokens: int,
        capacity_tokens: int,
        carried: list[Built],
        *,
        round_up: bool,
    ) -> tuple[list[Built], RolloutStats]:
        """Roll out until the segments reach `target_tokens` (the packs hold at most `capacity_tokens`),
        at most `MAX_ROUNDS` requests, each for the whole estimated need (`pacing.request_size` at the
        running estimate of tokens per rollout; rounded up to whole batches only while `round_up` holds and
        no weight sync waits: a waiting sync moves the version right after this burst, and a surplus of
        this version would be dropped)."""
        built = list(carried)
        dropped = RolloutStats()
        for round_ in range(self.MAX_ROUNDS):
            have = sum(len(segment) for _, segment, _ in built)
            if have >= target_tokens:
                break
            if round_ > 0 and self._sync_waits(section.ver):
                break
            count = request_size(
                target_tokens - have,
                capacity_tokens - have,
                self._tokens_per_rollout,
                whole_batches=round_up and not self.clock.sync_pending and self.clock.ver == section.ver,
                multiples=self.request_multiples,
            )
            try:
                kept, lost = self._request(section, count)
            except WrongVersionError:
                if round_ == 0 and self.clock.ver == section.ver:
                    raise  # refused before any rollout, the learner still at that version: servers ahead
                break  # a sync was swapped in: pack what arrived (its version is still eligible)
            built += kept
            dropped.add(lost)
            # running estimate of tokens per requested rollout (too-long rollouts count as nothing)
            observed = sum(len(segment) for _, segment, _ in kept) / count
            self._tokens_per_rollout = update_estimate(self._tokens_per_rollout, observed, self.num_chunks)
        return built, dropped

    def _roll_out_count(
        self, section: Section, count: int, carried: list[Built]
    ) -> tuple[list[Built], RolloutStats]:
        """`training.packing: false`: exactly the rollouts that make `count` segments (too-long ones are
        replaced by top-ups, at most `MAX_ROUNDS` requests)."""
        built = list(carried)
        dropped = RolloutStats()
        for round_ in range(self.MAX_ROUNDS):
            missing = count - len(built)
            if missing <= 0:
                break
            if round_ > 0 and self._sync_waits(section.ver):
                break
            try:
                kept, lost = self._request(section, missing)
            except WrongVersionError:
                if round_ == 0 and self.clock.ver == section.ver:
                    raise
                break
            built += kept
            dropped.add(lost)
        return built, dropped

    def _sync_waits(self, ver: int) -> bool:
        """A weight sync is waiting for this burst's section, or (`in_flight_sync`) one has moved the version
        since it began: skip the top-ups (the learner would wait a whole rollout call more, or the servers
        would refuse them) and pack what arrived into the packs asked for, less full."""
        if not self.clock.sync_pending and self.clock.ver == ver:
            return False
        self.counters.cut_short_total += 1
        return True

    def _request(self, section: Section, count: int) -> tuple[list[Built], RolloutStats]:
        first_pos = self.sampler.num_consumed
        indices = self.sampler.take(count)
        seed = derive_seed(self.seed, self.rank, self.num_chunks)
        self.num_chunks += 1
        try:
            return request_rollouts(section, self.packs, indices, first_pos, seed, self.counters)
        except WrongVersionError:
            # refused before anything was generated: the stream and the seeds go on as if it had not been made
            self.sampler.num_consumed = first_pos
            self.num_chunks -= 1
            self.counters.refused_total += 1
            raise

    def _pack(self, built: list[Built], dropped: RolloutStats, ver: int, num_packs: int) -> None:
        """Queue the burst's packs, carry its leftovers and commit, all under `_lock`."""
        with self._lock:
            self.counters.success_total += 1
            if built:
                self._carry = queue_packs(
                    self.packs, self.queue, built, dropped, ver, num_packs, self.counters
                )
                self._carry_ver = ver
            else:
                self._carry = []
            self._commit()
            self._bursts.queued()  # counted in the queue from now on (`counts_with_coming`)

    def _on_failure(self, exc: Exception, *, transient: bool) -> None:
        """Count the failure, then back off (`pacing.FailurePolicy`) or stop the thread with it."""
        self.counters.fail_total += 1
        self.counters.last_error = f"{type(exc).__name__}: {exc}"
        verdict = self._failures.failed(time.monotonic(), transient=transient)
        if isinstance(verdict, float):
            self._stop.wait(verdict)
        elif transient:
            raise RuntimeError(f"{verdict}: {self.counters.last_error}") from exc
        else:
            raise exc
