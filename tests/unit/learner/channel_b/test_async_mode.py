"""`AsyncChannelB`: `metrics` (two ranks' async counters reduced once, each by the reduction the metric
catalog declares; the gather of `dist.reduce_metrics` plays the second rank), `close`, and `decide`'s wait
for the prefetcher's first burst."""

from __future__ import annotations

import threading
from contextlib import nullcontext
from types import SimpleNamespace
from typing import Any

import pytest

from stagectl import dist

A = "stage2_ab/async/"


def _channel(scale: int) -> Any:
    """A channel whose counters are `scale` times a base set (only what `metrics` reads is set)."""
    from stagectl.learner.channel_b.async_mode import AsyncChannelB

    channel: Any = object.__new__(AsyncChannelB)
    channel.queue = SimpleNamespace(
        counters=lambda: SimpleNamespace(
            depth=1 * scale,
            drop_stale_total=2 * scale,
            drop_oldest_total=3 * scale,
            dropped_segments_total=4 * scale,
        )
    )
    channel.prefetcher = SimpleNamespace(
        counters=SimpleNamespace(
            success_total=5 * scale,
            fail_total=6 * scale,
            produced_packs=7 * scale,
            rollouts_total=40 * scale,
            segments_total=38 * scale,  # 2 too long to pack
            carry_dropped_total=1 * scale,
            lost_total=8 * scale,
            cut_short_total=9 * scale,
            requests_total=10 * scale,
            refused_total=11 * scale,
            busy_s=0.5 * scale,
            request_s=0.25 * scale,
            build_s=3.0 * scale,
            collate_s=1.0 * scale,
        )
    )
    # read together, as the prefetcher's lock has them
    channel.prefetcher.counters_now = lambda: (channel.prefetcher.counters, channel.queue.counters())
    channel._prefetch_seconds = (1.0, 0.5)
    channel.clock = SimpleNamespace(ver=4 * scale)
    channel.client = SimpleNamespace(counters=lambda: {"retries": scale})  # this rank's, not reduced
    weight_sync = SimpleNamespace(counters=lambda: {"delta_fallbacks": 2 * scale})
    channel.publisher = SimpleNamespace(num_syncs=4 * scale, num_failures=scale, client=weight_sync)
    channel.health = SimpleNamespace(num_resyncs=scale)
    channel.rollouts_trained = 20 * scale
    channel.num_b_steps, channel.num_steps = scale, 4
    return channel


def test_two_ranks_async_counters_are_summed_and_rank_0s_version_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    handed_in: list[Any] = []
    monkeypatch.setattr(dist, "all_gather_objects", lambda local: handed_in.append(local) or [local])
    _channel(scale=2).metrics()
    rank1 = handed_in.pop()
    monkeypatch.setattr(dist, "all_gather_objects", lambda local: [local, rank1])
    row = _channel(scale=1).metrics()
    assert row == {
        "time/prefetch_build_s": 2.0,  # rank 0's prefetcher since the last row
        "time/prefetch_collate_s": 0.5,
        A + "queue_depth": 3,
        A + "ver_current": 4,
        A + "drop_stale_total": 6,
        A + "drop_oldest_total": 9,
        A + "prefetch_success_total": 15,
        A + "prefetch_fail_total": 18,
        A + "produced_packs_total": 21,
        A + "rollouts_requested_total": 120,
        A + "rollouts_trained_total": 60,
        A + "rollouts_dropped_total": 21,  # (4 stale segments + 2 too long + 1 carry) x 3
        A + "rollouts_lost_total": 24,
        A + "bursts_cut_short_total": 27,
        A + "b_ratio_realized": 0.25,
        A + "sync_total": 4,
        A + "sync_fail_total": 1,
        A + "server_resync_total": 1,
        A + "rollout_requests_total": 30,
        A + "requests_refused_total": 33,
        A + "prefetch_busy_s": 1.5,
        A + "rollout_request_s": 0.75,
        A + "drop_rate": 21 / 120,
        "rollout_client/retries": 1,  # the channel's own client and weight sync (rank 0's, as written)
        "weight_sync/delta_fallbacks": 2,
    }
    assert isinstance(row[A + "queue_depth"], int)


def _connections(calls: list[str]) -> tuple[Any, Any]:
    """A rollout client and a publisher whose weight sync record their `close`."""
    client = SimpleNamespace(close=lambda: calls.append("rollout client"))
    publisher = SimpleNamespace(client=SimpleNamespace(close=lambda: calls.append("weight sync")))
    return client, publisher


def test_async_close_closes_its_client_and_weight_sync_even_when_the_prefetcher_hangs() -> None:
    from stagectl.learner.channel_b.async_mode import AsyncChannelB

    calls: list[str] = []
    channel: Any = object.__new__(AsyncChannelB)
    channel.client, channel.publisher = _connections(calls)
    channel.world = SimpleNamespace(rank=1)
    channel.source = SimpleNamespace(stop=lambda: calls.append("source stop"))
    channel.prefetcher = SimpleNamespace(
        request_stop=lambda: calls.append("stop event"),
        join=lambda deadline_s: calls.append(f"join {deadline_s:g}") is not None,  # still alive: False
        thread_ident=None,
    )
    with pytest.raises(RuntimeError, match="prefetcher on rank 1 did not stop within 2 s"):
        channel.close(deadline_s=2.0)
    assert calls == ["stop event", "source stop", "rollout client", "join 2", "weight sync"]


def test_step_mode_close_closes_its_client_and_weight_sync() -> None:
    from stagectl.learner.channel_b.step_mode import StepChannelB

    calls: list[str] = []
    channel: Any = object.__new__(StepChannelB)
    channel.client, channel.publisher = _connections(calls)
    channel.close(deadline_s=2.0)
    assert calls == ["rollout client", "weight sync"]
    in_process: Any = object.__new__(StepChannelB)  # no servers: nothing to close
    in_process.client = in_process.publisher = None
    in_process.close(deadline_s=2.0)


class _Producer:
    """The prefetcher's burst bookkeeping (the real `BurstState` and queue under one lock), its bursts run
    by the test: `burst(ver, delay_s)` begins one whose `gas` packs are queued `delay_s` later."""

    def __init__(self, queue: Any, gas: int) -> None:
        from stagectl.learner.channel_b.bursts import BurstState

        self.queue, self.gas = queue, gas
        self.lock = threading.Lock()
        self.bursts = BurstState(self.lock, queue.clock)

    def burst(self, ver: int, delay_s: float | None) -> None:
        """Begin a burst of `ver`; it queues its packs after `delay_s` (None: the test ends it)."""
        with self.lock:
            self.bursts.begin()
            self.bursts.set_coming(ver, self.gas)
        if delay_s is not None:
            threading.Timer(delay_s, self.queue_packs, args=(ver,)).start()

    def queue_packs(self, ver: int) -> None:
        with self.lock:
            for _ in range(self.gas):
                self.queue.push(object(), ver)
            self.bursts.queued()
            self.bursts.end()

    # what `AsyncChannelB.decide` reads of the prefetcher
    def error(self) -> None:
        return None

    def wait_first_burst(self, timeout_s: float | None) -> bool:
        return self.bursts.wait_first(timeout_s, lambda: False)

    def burst_behind(self) -> bool:
        return self.bursts.behind()

    def wait_burst(self, timeout_s: float | None) -> bool:
        return self.bursts.wait(timeout_s, lambda: False)

    def counts_with_coming(self) -> tuple[list[int], list[int]]:
        with self.lock:
            versions, counts = self.queue.eligible_counts()
            self.bursts.add_coming(versions, counts)
            return versions, counts


def _decider(fence_timeout_s: float = 30.0) -> Any:
    """One rank's async Channel-B at the start of a run (version 0, GAS 2, in-flight sync): the real
    queue, clock, burst state and decision path; a server that serves."""
    from stagectl.learner.channel_b.async_mode import AsyncChannelB
    from stagectl.learner.channel_b.clock import VersionClock
    from stagectl.learner.channel_b.queue import ReadyPackQueue

    channel: Any = object.__new__(AsyncChannelB)
    channel.clock = VersionClock(0)
    channel.queue = ReadyPackQueue(queue_limit=8, version_window=1, clock=channel.clock)
    channel.gas = 2
    channel.prefetcher = _Producer(channel.queue, channel.gas)
    channel.queue_plan = SimpleNamespace(in_flight_sync=True)
    channel.fence_timeout_s = fence_timeout_s
    channel.runner = SimpleNamespace(timer=SimpleNamespace(time=lambda phase: nullcontext()))
    channel.health = SimpleNamespace(
        num_resyncs=0,
        check=lambda step, wants_b, wait=True: SimpleNamespace(serving=["http://127.0.0.1:1"]),
        waits_for_server=lambda roster: False,
    )
    channel.world = SimpleNamespace(is_main=True)
    channel._stale_seen = 0
    channel.num_steps = channel.num_b_steps = channel.num_skipped = 0
    return channel


def test_the_first_b_step_waits_for_the_first_burst_then_never_for_one_of_the_current_version() -> None:
    """The prefetcher starts with the step loop: the first B step (step 1, after an A step) came before
    its packs in 18 of 20 runs of the async example and trained as A. It waits for the first burst; a
    later burst of the current version is not waited for (the step trains as A: `queue_empty`)."""
    channel = _decider()
    channel.prefetcher.burst(0, delay_s=0.3)  # the thread's first burst, begun with the step loop
    assert channel.decide(0, False)[0].kind == "A"  # an A step never waits
    decision, extra = channel.decide(1, True)
    assert (decision.kind, decision.ver, decision.reason) == ("B", 0, None)
    assert extra["time/wait_s"] >= 0.2
    channel.prefetcher.burst(0, delay_s=None)  # the next burst, of the current version, in flight
    decision, extra = channel.decide(2, True)
    assert (decision.kind, decision.reason) == ("A", "queue_empty")
    assert extra["time/wait_s"] < 5.0


def test_a_failed_first_burst_ends_the_wait() -> None:
    channel = _decider()
    channel.prefetcher.burst(0, delay_s=None)

    def fail() -> None:  # the burst failed: it ends without queuing anything
        with channel.prefetcher.lock:
            channel.prefetcher.bursts.end()

    threading.Timer(0.1, fail).start()
    decision, extra = channel.decide(1, True)
    assert (decision.kind, decision.reason) == ("A", "queue_empty") and extra["time/wait_s"] < 5.0


def test_the_first_burst_wait_is_bounded_by_the_servers_infer_timeout() -> None:
    channel = _decider(fence_timeout_s=0.1)
    channel.prefetcher.burst(0, delay_s=None)  # never ends
    decision, extra = channel.decide(1, True)
    assert (decision.kind, decision.reason) == ("A", "queue_empty")
    assert 0.1 <= extra["time/wait_s"] < 5.0


def test_a_resumed_run_counts_its_weight_syncs_from_the_checkpoints_totals() -> None:
    """4 syncs (1 failed, 1000 bytes) before checkpoint; the resume's own sync (1, 10 bytes) adds to them:
    `weight_sync/total` and `stage2_ab/async/sync_total` restarted at 1 (the report said 2 syncs for a run of
    4)."""
    from stagectl.learner.channel_b.async_mode import AsyncChannelB
    from stagectl.learner.channel_b.publisher import WeightPublisher

    def channel(syncs: int, failures: int, num_bytes: int) -> Any:
        c: Any = object.__new__(AsyncChannelB)
        c.prefetcher = SimpleNamespace(
            snapshot=lambda: {"stream_pos": 7, "num_chunks": 2}, restore=lambda s: None
        )
        c.publisher = object.__new__(WeightPublisher)
        c.publisher.num_syncs, c.publisher.num_failures = syncs, failures
        c.publisher.bytes_total, c.publisher.seconds_total = num_bytes, 0.5
        c.num_b_steps, c.num_steps, c.num_skipped, c.rollouts_trained = 2, 4, 0, 21
        return c

    saved = channel(4, 1, 1000).rank_state()["async"]
    resumed = channel(1, 0, 10)  # after the resume's own sync
    resumed.restore(saved)
    assert (resumed.publisher.num_syncs, resumed.publisher.num_failures) == (5, 1)
    assert resumed.publisher.bytes_total == 1010
    assert resumed.publisher.seconds_total == pytest.approx(1.0)
    assert (resumed.num_b_steps, resumed.num_steps, resumed.rollouts_trained) == (2, 4, 21)
    del saved["steps"]["weight_syncs"]  # a checkpoint written before they were kept
    older = channel(1, 0, 10)
    older.restore(saved)
    assert older.publisher.num_syncs == 1


class _DownServers:
    """The weight-sync client's side `ServerHealth` uses, every server refusing the connection."""

    def __init__(self) -> None:
        self.base_urls = ["http://127.0.0.1:9"]

    def probe(self) -> list[str]:
        return ["ConnectError: [Errno 111] Connection refused"]

    def use_servers(self, servers: Any) -> None:
        pass


def _packs_queued_then_servers_down(on_rollout_loss: Any, rollout_loss_timeout_s: float = 300.0) -> Any:
    """A decider whose first burst queued one B step's packs (version 0) before its only server went away,
    with the real `ServerHealth` under `on_rollout_loss`."""
    from stagectl.config.plan import ServerList, ServerRollouts
    from stagectl.config.rollout import HttpSync
    from stagectl.dist import World
    from stagectl.learner.channel_b.health import ServerHealth

    channel = _decider()
    servers = _DownServers()
    rollouts = ServerRollouts(
        ServerList(tuple(servers.base_urls)), HttpSync(), on_rollout_loss, rollout_loss_timeout_s
    )
    publisher = SimpleNamespace(client=servers, ver=0)
    client = SimpleNamespace(use_servers=lambda servers: None)
    channel.health = ServerHealth(rollouts, World(0, 0, 1), publisher, client, lambda outcome: None)
    channel.prefetcher.burst(0, delay_s=None)
    channel.prefetcher.queue_packs(0)  # a burst finished before the server went away
    return channel


def test_continue_a_only_warns_only_for_a_b_step_that_trains_as_a(capsys: pytest.CaptureFixture[str]) -> None:
    """No server serves and the policy is `continue_a_only`: a B step whose packs are queued still trains
    B and says nothing; one without packs trains A (`no_server`) with the warning. The warning came
    from the server probe, before the gate: 'B step 2 trains as Channel-A' and then 'step 2/.. B'."""
    channel = _packs_queued_then_servers_down("continue_a_only")
    decision, extra = channel.decide(1, True)
    assert (decision.kind, decision.ver) == ("B", 0) and extra["stage2_ab/async/servers_serving"] == 0
    channel.queue.take_held(0)  # trained
    assert "trains as Channel-A" not in capsys.readouterr().err
    decision, _ = channel.decide(3, True)
    assert (decision.kind, decision.reason) == ("A", "no_server")
    err = capsys.readouterr().err
    assert err.count("warning: B step 4 trains as Channel-A: no rollout server can serve") == 1


def test_stop_trains_queued_packs_before_it_waits_for_a_server(monkeypatch: pytest.MonkeyPatch) -> None:
    """No server serves and the policy is `stop`: a B step whose packs were queued before the outage trains
    them at once (it waited up to `rollout_loss_timeout_s` for a server first, then stopped the run with
    the packs untrained); a B step without packs waits, and stops the run once the outage passes the
    timeout."""
    from stagectl.learner.channel_b import health
    from stagectl.learner.channel_b.health import RolloutLossError

    monkeypatch.setattr(health, "POLL_S", 0.01)
    channel = _packs_queued_then_servers_down("stop", rollout_loss_timeout_s=0.3)
    decision, extra = channel.decide(1, True)
    assert (decision.kind, decision.ver) == ("B", 0) and extra["time/wait_s"] < 0.3
    channel.queue.take_held(0)  # trained
    with pytest.raises(RolloutLossError, match="stopped before step 4"):
        channel.decide(3, True)


def test_a_pack_gone_stale_during_the_gate_is_the_next_steps_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    """The prefetcher drops a stale pack while rank 0 broadcasts a step's decision: the next B step that
    trains as A says `stale_packs` (the count was read again after the decision, so that drop was never
    anyone's reason: `queue_empty`)."""
    from stagectl.learner.channel_b import async_mode

    channel = _decider(fence_timeout_s=0.01)  # no burst is coming: no wait for one
    real = dist.broadcast_object
    pushed: list[bool] = []

    def broadcast(obj: Any) -> Any:
        if isinstance(obj, tuple) and not pushed:  # the gate's decision: a burst of an old version lands
            pushed.append(channel.queue.push(object(), -2))
        return real(obj)

    monkeypatch.setattr(async_mode.dist, "broadcast_object", broadcast)
    decision, _ = channel.decide(1, True)
    assert (decision.kind, decision.reason) == ("A", "queue_empty") and pushed == [False]
    assert channel.queue.counters().drop_stale_total == 1
    decision, _ = channel.decide(2, True)
    assert (decision.kind, decision.reason) == ("A", "stale_packs")
    decision, _ = channel.decide(3, True)  # counted once
    assert (decision.kind, decision.reason) == ("A", "queue_empty")
