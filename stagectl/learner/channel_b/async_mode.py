"""Channel-B `async` mode, learner side: the rank's prefetcher and ready-pack queue, the collective
feasibility gate, the weight sync, and the drop accounting.

Per optimizer step (`decide`): a B step waits for the rank's packs where they are on their way (the
prefetcher's first burst since start or resume; with `in_flight_sync`, a burst begun before the last
sync; never a later burst begun at the current version); every rank reports its prefetcher status (one
rank's error ends every rank with that error); each rank holds up to GAS packs of every eligible version
(held packs cannot be evicted by a push); the policy gate (schedule) and the feasibility gate (every rank
holds >= GAS packs of one version: all-reduce MIN) let rank 0 decide `{kind, ver}` and broadcast it; each
rank then takes exactly its held packs of that version (or releases them all for a Channel-A step). With
no server serving, a B step trains packs queued before the outage; without, `stop` waits (`health`). `run`
trains one pack per micro-step. Every `sync_every_steps` updates `after_update` runs the weight sync
(`WeightPublisher`) and advances `ver` on every rank.

Checkpoints: `rank_state` is the rank's async state (the prefetcher's `snapshot`: queued packs with their
versions and rollouts, carried leftovers, the B-stream position after the last finished burst, the pacing
estimate and counters; plus this class's step counters); `restore` puts it back on resume, after the
resume's weight sync has set the current version.
"""

from __future__ import annotations

import math
import sys
import time
import traceback
from typing import Any, Literal

from stagectl import dist
from stagectl import metric_keys as mk
from stagectl.config.plan import AsyncQueue, AsyncServers, ChannelBPlan
from stagectl.detection.stats import RolloutStats
from stagectl.inference.client import RolloutClient
from stagectl.learner.channel_b.gallery import make_b_gallery
from stagectl.learner.channel_b.health import ServerHealth, servers_without_version_tags, untagged_message
from stagectl.learner.channel_b.pacing import PacingRules, request_multiples
from stagectl.learner.channel_b.packs import PackBuilder
from stagectl.learner.channel_b.prefetcher import Prefetcher
from stagectl.learner.channel_b.protocol import Decision, SkipReason, skip_reason
from stagectl.learner.channel_b.publisher import WeightPublisher, connection_metrics
from stagectl.learner.channel_b.queue import ReadyPackQueue, decide_step
from stagectl.learner.channel_b.records import ReadyPack
from stagectl.learner.channel_b.rollouts import ServerRollouts
from stagectl.learner.packs import PackRunner, StepAccumulator
from stagectl.learner.setup import LearnerState


class AsyncChannelB:
    def __init__(
        self,
        plan: ChannelBPlan,
        state: LearnerState,
        runner: PackRunner,
        client: RolloutClient,
        publisher: WeightPublisher,
        prefetcher_cpus: tuple[int, ...] | None = None,
    ) -> None:
        """`plan.source` is `AsyncServers`; the rest of what it reads comes from `state.plan` (seed, steps,
        packing). `client` and `publisher` (with its weight sync) are this Channel-B's to report and close."""
        assert isinstance(plan.source, AsyncServers), "async Channel-B needs an AsyncServers source"
        self.queue_plan: AsyncQueue = plan.source.queue
        q = self.queue_plan
        training = state.plan.training
        self.state = state
        self.runner = runner
        self.client = client
        self.publisher = publisher
        self.world = state.world
        self.gas = state.resolved.gradient_accumulation_steps
        # the one clock every part reads: the publisher advances `ver`, the learner moves the steps
        self.clock = publisher.clock
        self.clock.next_step = state.start_step  # the step whose channel decision comes next
        self.clock.open_step = state.start_step  # the first step whose post-update sync is still ahead
        self.queue: ReadyPackQueue[ReadyPack] = ReadyPackQueue(q.queue_limit, q.version_window, self.clock)
        self.source = ServerRollouts(
            client,
            state.encoder,
            plan.sampling,
            plan.decode_batch_size,
            self.clock,
            tag_versions=q.in_flight_sync,
        )
        packs = PackBuilder.of_state(state)
        prompt_tokens = len(state.encoder.prompt(0).input_ids)
        # every server's decode batch (`/version/`), read once on rank 0 so that every rank sizes alike
        versions = client.versions() if self.world.is_main else []
        server_batches, untagged = dist.broadcast_object(
            (
                [v.batch_size for v in versions],
                servers_without_version_tags(client.base_urls, versions) if self.world.is_main else [],
            )
        )
        if q.in_flight_sync and untagged:
            raise dist.SharedError(untagged_message(untagged))
        self.prefetcher = Prefetcher(
            source=self.source,
            packs=packs,
            sampler=state.b_sampler,
            queue=self.queue,
            rules=PacingRules(
                b_ratio=state.plan.b_ratio,
                gas=self.gas,
                sync_every_steps=q.sync_every_steps,
                version_window=q.version_window,
                target_packs=q.prefetch_target_packs,
                pack_tokens=math.ceil(training.packing_min_fill_ratio * packs.packing_length),
                max_steps=training.max_steps,
            ),
            initial_tokens_per_rollout=float(prompt_tokens + plan.sampling.max_new_tokens),
            max_consecutive_failures=q.max_consecutive_failures,
            # a server outage never ends the thread: it backs off and retries, and the learner decides
            # (`ServerHealth`: re-sync a server that is back, or stop after `rollout_loss_timeout_s`)
            outage_timeout_s=math.inf,
            seed=training.seed,
            rank=self.world.rank,
            num_chunks=int(state.extra_state.get("rank_state", {}).get("b_chunks", 0)),
            request_multiples=request_multiples(plan.decode_batch_size, server_batches),
            cpus=prefetcher_cpus,
        )
        self.fence_timeout_s = plan.source.rollouts.servers.infer_timeout_s
        self.health = ServerHealth(
            plan.source.rollouts,
            self.world,
            publisher,
            client,
            self.after_sync,
            # the watchdog watches the step phase a B step waits in on several ranks only
            watchdog_step_s=state.plan.watchdog.step_s if self.world.world_size > 1 else None,
        )
        self._held: list[ReadyPack] = []
        self._stale_seen = 0  # the queue's drop_stale_total at the last decision (rank 0)
        self._stale_at_gate = 0  # ... as the last gate read it
        self.num_b_steps = 0
        self.num_steps = 0
        self.num_skipped = 0
        self.rollouts_trained = 0
        # the servers' version `ver` holds exactly the learner's current weights (a fresh run: the base)
        self.weights_are_ver = True
        self._prefetch_seconds = (0.0, 0.0)  # the prefetcher's (build_s, collate_s) at the last metrics row
        self.gallery = make_b_gallery(state) if self.world.is_main else None

    @property
    def ver(self) -> int:
        return self.clock.ver

    def start(self) -> None:
        self.prefetcher.start()

    def decide(self, step: int, policy_wants_b: bool) -> tuple[Decision, dict[str, Any]]:
        """Prefetcher status, then the policy and feasibility gates (collectives on every rank)."""
        with self.runner.timer.time("wait_packs"):
            return self._decide(step, policy_wants_b)

    def _decide(self, step: int, policy_wants_b: bool) -> tuple[Decision, dict[str, Any]]:
        t0 = time.perf_counter()
        if policy_wants_b:
            self._wait_for_first_burst()
        if self.queue_plan.in_flight_sync and policy_wants_b:
            self._wait_for_burst()
        errors = dist.all_gather_objects(self.prefetcher.error())
        for rank, error in enumerate(errors):
            if error is not None:  # every rank raises it; rank 0 reports it
                raise dist.SharedError(f"Channel-B prefetcher on rank {rank} failed: {error}")
        resyncs = self.health.num_resyncs
        plan = self.health.check(step, wants_b=policy_wants_b, wait=False)  # queued packs train first
        kind, ver, reason = self._gate(policy_wants_b, serving=bool(plan.serving))
        if reason == "no_server" and self.health.waits_for_server(plan):  # `stop`, and no packs to train
            self.queue.release_held()
            plan = self.health.check(step, wants_b=True)  # waits for a server, or raises past the timeout
            kind, ver, reason = self._gate(policy_wants_b, serving=bool(plan.serving))
        if self.health.num_resyncs != resyncs:  # a full push of the current weights went out
            self.weights_are_ver = True
        self._stale_seen = self._stale_at_gate  # a drop since the gate read it is the next step's reason
        if reason == "no_server":  # decided, not guessed from the roster: queued packs train without a server
            self.health.warn_trains_a(step)
        if kind == "B":
            assert ver is not None
            self._held = self.queue.take_held(ver)
            assert len(self._held) == self.gas, "the gate decided on packs this rank did not hold"
        else:
            self.queue.release_held()
        if self.queue_plan.in_flight_sync:
            self._measure_shared()  # a burst that began before the last sync has queued since, or failed
        self.clock.next_step = step + 1
        self.num_steps += 1
        self.num_b_steps += kind == "B"
        self.num_skipped += policy_wants_b and kind == "A"
        return Decision(kind, ver, reason), {
            "stage2_ab/async/servers_serving": len(plan.serving),
            "stage2_ab/async/policy_wants_b": int(policy_wants_b),
            "stage2_ab/async/b_step_skipped_due_to_queue": int(policy_wants_b and kind == "A"),
            "time/wait_s": time.perf_counter() - t0,
        }

    def _gate(
        self, policy_wants_b: bool, *, serving: bool
    ) -> tuple[Literal["A", "B"], int | None, SkipReason | None]:
        """The feasibility gate (collectives on every rank): each rank sets aside its packs (`queue.hold`);
        rank 0 decides B at the oldest version every rank holds `gas` packs of, else A with its reason."""
        versions, held = self.queue.hold(self.gas)
        min_held = dist.all_reduce_ints(held, "min")
        max_held = dist.all_reduce_ints(held, "max")
        decision: tuple[Literal["A", "B"], int | None, SkipReason | None] | None = None
        if self.world.is_main:
            kind, ver = decide_step(policy_wants_b, versions, min_held, self.gas)
            reason = None
            self._stale_at_gate = self.queue.counters().drop_stale_total  # read once (the prefetcher drops)
            if policy_wants_b and kind == "A":
                reason = skip_reason(
                    serving=serving,
                    some_rank_held=max(max_held, default=0) >= self.gas,
                    went_stale=self._stale_at_gate > self._stale_seen,
                )
            decision = (kind, ver, reason)
        decided = dist.broadcast_object(decision)
        assert decided is not None, "rank 0 decides"
        return decided

    def _wait_for_first_burst(self) -> None:
        """A step that wants Channel-B while this rank holds fewer than GAS packs of every eligible version
        and its prefetcher has not finished a burst since it started (a run's or a resume's first B step):
        wait for that first burst (queued or failed; an idle, failed or stopped prefetcher: no wait), at
        most the servers' `infer_timeout_s` (without it, 18 of 20 runs of the async example began one B
        step short). Each rank waits for its own burst; the gates then decide together."""
        if max(self.queue.eligible_counts()[1], default=0) < self.gas:
            self.prefetcher.wait_first_burst(self.fence_timeout_s)

    def _wait_for_burst(self) -> None:
        """`in_flight_sync`, a step that wants Channel-B: while this rank holds fewer than GAS packs of any
        eligible version and the burst in progress began before the last sync (the burst a fenced sync
        would have waited for, and the one that makes these packs: the nearest B step's first), wait for
        it, one burst at a time. So the learner waits no more than the fence made it wait, only later: at
        the B step that needs the packs, not at the sync. A burst of the current version, an idle or a
        failed prefetcher: no wait, and the gates decide (Channel-A if packs are missing, as before)."""
        deadline = None if self.fence_timeout_s is None else time.monotonic() + self.fence_timeout_s
        while max(self.queue.eligible_counts()[1], default=0) < self.gas:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return
            if not self.prefetcher.burst_behind() or not self.prefetcher.wait_burst(remaining):
                return

    def run(self, step: int, decision: Decision, acc: StepAccumulator) -> dict[str, Any]:
        """Exactly one held pack per micro-step: one forward/backward each."""
        packs, self._held = self._held, []
        if self.gallery is not None:
            self.gallery.offer_packs(step, packs)  # a reference; built after the update
        total = sum(p.num_segments for p in packs)
        stats = RolloutStats()
        for micro, pack in enumerate(packs):
            stats.add(pack.stats)
            self.runner.run_batch(
                pack.batch, scale=pack.num_segments / total, sync=micro == self.gas - 1, acc=acc
            )
            acc.samples += [("B", r.sample, r.stream_pos, pack.ver, self.ver) for r in pack.rollouts]
        self.rollouts_trained += total
        with dist.phase("rollout statistics reduction", "step_s"):
            summed = RolloutStats.from_list(dist.all_reduce_floats(stats.as_list()))
        assert decision.ver is not None
        return {
            **summed.metrics(),
            "stage2_ab/async/ver_lag": self.ver - decision.ver,
            "stage2_ab/async/ver_trained": decision.ver,
        }

    def after_update(self, num_updates: int) -> dict[str, Any]:
        out = self._write_gallery()
        if num_updates % self.queue_plan.sync_every_steps:
            self.clock.open_step = self.clock.next_step
            self.weights_are_ver = False
            return out
        fence_before = self.clock.wait_s_total
        started = time.perf_counter()
        with dist.phase("weight sync", "weight_sync_s"):
            outcome = self.publisher.sync(self.fence_timeout_s, then=self.after_sync)
        self.weights_are_ver = outcome.status == "ok"
        fence_s = self.clock.wait_s_total - fence_before
        self.runner.timer.add("fence", fence_s)
        self.runner.timer.add("weight_sync", time.perf_counter() - started - fence_s)
        self.clock.open_step = self.clock.next_step
        return {
            **out,
            **self.publisher.metrics(outcome),
            "stage2_ab/async/synced": int(outcome.status == "ok"),
        }

    def _write_gallery(self) -> dict[str, Any]:
        """Rank 0: a sampled B step's Channel-B gallery record, built and written after its update."""
        if self.gallery is not None and self.gallery.flush() is not None:
            return {"time/b_gallery_s": self.gallery.last_write_s}
        return {}

    def after_sync(self, outcome: object) -> None:
        """Inside the sync's fence, every rank: the clock has the new version (the queue drops the packs now
        outside the window), then the ranks measure which packs of the older versions EVERY rank holds (those
        versions can no longer grow) for pacing (`ReadyPackQueue.set_shared`)."""
        self._measure_shared()

    def _measure_shared(self) -> None:
        """Every rank: the packs of each older version that EVERY rank holds (all-reduce MIN), for pacing.
        With `in_flight_sync` a rank's burst that began before the sync is still running: its packs count
        as held (they are queued within the burst, or the burst fails and the next measurement, at the next
        step, drops them). Counted as missing instead, pacing would make the same B step's packs again at
        the new version, to go stale unused (the learning check's runs dropped 36-49% of their rollouts so)."""
        # the same versions on every rank
        versions, counts = (
            self.prefetcher.counts_with_coming()
            if self.queue_plan.in_flight_sync
            else self.queue.eligible_counts()
        )
        self.queue.set_shared(versions, dist.all_reduce_ints(counts, "min"))

    def metrics(self) -> dict[str, Any]:
        """`stage2_ab/async/*`: this rank's counters reduced over ranks, each by its declared reduction
        (`stagectl.metric_keys`: the queue depth is the sum of every rank's depth, the version and the sync
        counters rank 0's); the drop rate from the reduced counts."""
        c, q = self.prefetcher.counters_now()  # one consistent reading of the thread's counters
        build_s, collate_s = c.build_s, c.collate_s  # rank 0's prefetcher, like the learner's phase timers
        last_build_s, last_collate_s = self._prefetch_seconds
        self._prefetch_seconds = (build_s, collate_s)
        too_long = c.rollouts_total - c.segments_total  # rollouts too long to pack
        counters = {
            "queue_depth": q.depth,
            "ver_current": self.ver,
            "drop_stale_total": q.drop_stale_total,
            "drop_oldest_total": q.drop_oldest_total,
            "prefetch_success_total": c.success_total,
            "prefetch_fail_total": c.fail_total,
            "produced_packs_total": c.produced_packs,
            "rollouts_requested_total": c.rollouts_total,
            "rollouts_trained_total": self.rollouts_trained,
            "rollouts_dropped_total": q.dropped_segments_total + too_long + c.carry_dropped_total,
            "rollouts_lost_total": c.lost_total,
            "bursts_cut_short_total": c.cut_short_total,
            "b_ratio_realized": self.num_b_steps / max(1, self.num_steps),
            "sync_total": self.publisher.num_syncs,
            "sync_fail_total": self.publisher.num_failures,
            "server_resync_total": self.health.num_resyncs,
            "rollout_requests_total": c.requests_total,
            "requests_refused_total": c.refused_total,
            "prefetch_busy_s": c.busy_s,
            "rollout_request_s": c.request_s,
        }
        row: dict[str, Any] = dist.reduce_metrics(
            {
                "time/prefetch_build_s": build_s - last_build_s,
                "time/prefetch_collate_s": collate_s - last_collate_s,
                **{mk.ASYNC_PREFIX + name: value for name, value in counters.items()},
            }
        )
        dropped = row[mk.ASYNC_PREFIX + "rollouts_dropped_total"]
        requested = row[mk.ASYNC_PREFIX + "rollouts_requested_total"]
        row[mk.ASYNC_PREFIX + "drop_rate"] = dropped / requested if requested else 0.0
        row.update(connection_metrics(self.client, self.publisher))  # this rank's, as written by rank 0
        return row

    def saved_version(self) -> dict[str, Any]:
        """The checkpoint's `ver` and whether the servers' `ver` holds exactly the saved weights."""
        return {"ver": self.ver, "ver_is_weights": self.weights_are_ver}

    def rank_state(self) -> dict[str, Any]:
        """The B-stream position and seed counter after the last finished burst, and under `async` the
        whole async state (`restore`'s input); taken between steps, one consistent snapshot."""
        snap = self.prefetcher.snapshot()
        snap["steps"] = {
            "num_b_steps": self.num_b_steps,
            "num_steps": self.num_steps,
            "num_skipped": self.num_skipped,
            "rollouts_trained": self.rollouts_trained,
            "weight_syncs": self.publisher.totals(),
        }
        return {"b_consumed": snap["stream_pos"], "b_chunks": snap["num_chunks"], "async": snap}

    def restore(self, saved: dict[str, Any]) -> None:
        """Resume from `rank_state()["async"]` of a checkpoint: before `start`, after the resume's weight
        sync (the queue judges the saved packs against the current version)."""
        self.prefetcher.restore(saved)
        steps = saved["steps"]
        self.num_b_steps = int(steps["num_b_steps"])
        self.num_steps = int(steps["num_steps"])
        self.num_skipped = int(steps["num_skipped"])
        self.rollouts_trained = int(steps["rollouts_trained"])
        self.publisher.carry_totals(steps.get("weight_syncs", {}))

    def close(self, deadline_s: float = 30.0) -> None:
        """Stop event -> close the HTTP sessions (ends a rollout call in flight) -> join the prefetcher
        with a deadline -> close the weight sync. A prefetcher that does not stop is an error: a thread left
        running inside torch or an HTTP call at interpreter exit is what crashes a finished run."""
        self.prefetcher.request_stop()
        self.source.stop()
        try:
            self.client.close()
            if not self.prefetcher.join(deadline_s):
                raise RuntimeError(
                    f"the Channel-B prefetcher on rank {self.world.rank} did not stop within {deadline_s:g} s "
                    f"of the shutdown; its stack:\n{thread_stack(self.prefetcher.thread_ident)}"
                )
        finally:
            self.publisher.client.close()


def thread_stack(ident: int | None) -> str:
    """The current Python stack of thread `ident` (for an error about a thread that will not stop)."""
    frame = sys._current_frames().get(ident) if ident is not None else None
    return "".join(traceback.format_stack(frame)) if frame is not None else "(thread not running)"
