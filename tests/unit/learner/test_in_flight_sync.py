"""`in_flight_sync` needs servers that honour `weight_version`: an older server is refused by name at start-up."""

from __future__ import annotations

from stagectl.learner.channel_b_async import servers_without_version_tags, untagged_message
from stagectl.rollout.protocol import VersionResponse


def test_servers_that_do_not_promise_version_tags_are_named() -> None:
    old = VersionResponse.model_validate({"version": 3, "model": "m"})  # a server older than the field
    new = VersionResponse(version=3, model="m", version_tags=True)
    urls = ["http://a:8000", "http://b:8000"]
    assert servers_without_version_tags(urls, [new, new]) == []
    assert servers_without_version_tags(urls, [old, new]) == ["http://a:8000"]
    message = untagged_message(["http://a:8000"])
    assert "http://a:8000 does not" in message and "in_flight_sync: false" in message


def test_our_server_promises_them() -> None:
    from stagectl.rollout.server.engines.fake import FakeEngine
    from stagectl.rollout.server.service import RolloutService, ServerSettings

    service = RolloutService(FakeEngine(), ServerSettings())
    try:
        assert service.version().version_tags is True
    finally:
        service.close()
