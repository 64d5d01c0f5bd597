"""`AsyncChannelB.metrics`: two ranks' async counters reduced once, each by the reduction the metric catalog
declares (the gather of `dist.reduce_metrics` plays the second rank)."""

from __future__ import annotations

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
