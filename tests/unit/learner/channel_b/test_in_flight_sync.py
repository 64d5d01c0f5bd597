"""`in_flight_sync` needs servers that honour `weight_version`: an older server is refused by name at start-up."""

from __future__ import annotations

from stagectl.learner.channel_b.health import servers_without_version_tags, untagged_message
from stagectl.wire.protocol import VersionResponse


def test_servers_that_do_not_promise_version_tags_are_named() -> None:
    old = VersionResponse.model_validate({"version": 3, "model": "m"})  # a server older than the field
    new = VersionResponse(version=3, model="m", version_tags=True)
    urls = ["http://a:8000", "http://b:8000"]
    assert servers_without_version_tags(urls, [new, new]) == []
    assert servers_without_version_tags(urls, [old, new]) == ["http://a:8000"]
    message = untagged_message(["http://a:8000"])
    assert "http://a:8000 does not" in message and "in_flight_sync: false" in message


def test_our_server_promises_them() -> None:
    from stagectl.engines.fake import FakeEngine
    from stagectl.server.service import RolloutService, ServerSettings

    service = RolloutService(FakeEngine(), ServerSettings())
    try:
        assert service.version().version_tags is True
    finally:
        service.close()


class _Prefetcher:
    """Bursts the test ends by hand: each `wait_burst` returns once the test has queued one burst's packs;
    every burst began at version `began`."""

    def __init__(self, queue, bursts: list[int], began: int) -> None:  # type: ignore[no-untyped-def]
        self.queue, self.bursts, self.began, self.waits = queue, bursts, began, 0

    def burst_behind(self) -> bool:
        return bool(self.bursts) and self.began < self.queue.clock.ver

    def wait_burst(self, timeout_s: float | None) -> bool:
        self.waits += 1
        for _ in range(self.bursts.pop(0)):  # the burst queues its packs
            self.queue.push(object(), 0)
        return True


def _channel(bursts: list[int], queued: int = 0, began: int = 0):  # type: ignore[no-untyped-def]
    from stagectl.learner.channel_b.async_mode import AsyncChannelB
    from stagectl.learner.channel_b.clock import VersionClock
    from stagectl.learner.channel_b.queue import ReadyPackQueue

    channel = object.__new__(AsyncChannelB)
    channel.clock = VersionClock(1)  # one sync since version 0
    channel.queue = ReadyPackQueue(queue_limit=8, version_window=1, clock=channel.clock)
    for _ in range(queued):
        channel.queue.push(object(), 0)
    channel.prefetcher = _Prefetcher(channel.queue, bursts, began)
    channel.gas = 2
    channel.fence_timeout_s = 5.0
    return channel


def test_a_b_step_waits_for_a_burst_begun_before_the_sync_and_no_longer() -> None:
    """What the fenced sync waited for, the B step that needs its packs waits for (the burst of version 0,
    begun before the sync to 1): one pack queued, the burst brings one more, no second wait. A burst of the
    current version the fenced sync did not wait for either (the B step is skipped to Channel-A, counted,
    as before); with packs enough or an idle prefetcher, no wait."""
    channel = _channel([1, 2], queued=1)
    channel._wait_for_burst()
    assert channel.prefetcher.waits == 1 and channel.queue.depth() == 2
    for other in (_channel([2], queued=0, began=1), _channel([2], queued=2), _channel([], queued=0)):
        other._wait_for_burst()
        assert other.prefetcher.waits == 0
