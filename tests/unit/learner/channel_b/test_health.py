"""`ServerWatch`: which servers serve the learner's version, which must be re-synced (restarted: a new
instance id; or on another version) and which are down; the outage clock; and `skip_reason`'s order
(`protocol.skip_reason`)."""

from __future__ import annotations

import pytest

from stagectl.learner.channel_b.health import ServerWatch
from stagectl.learner.channel_b.protocol import skip_reason
from stagectl.wire.protocol import VersionResponse

URLS = ["http://a:1", "http://b:2"]


def _v(version: int, instance: str) -> VersionResponse:
    return VersionResponse(version=version, model="m", instance_id=instance)


def test_serving_down_restarted_and_behind() -> None:
    watch = ServerWatch(URLS)
    plan = watch.observe(0.0, [_v(3, "a1"), _v(3, "b1")], ver=3)
    assert (plan.serving, plan.resync, plan.down, plan.outage_s) == ((0, 1), (), (), 0.0)
    plan = watch.observe(1.0, [_v(3, "a1"), "ConnectError: refused"], ver=3)
    assert (plan.serving, plan.down) == (
        (0,),
        (1,),
    ) and plan.last_error == "http://b:2: ConnectError: refused"
    plan = watch.observe(2.0, [_v(2, "a1"), _v(0, "b2")], ver=3)  # a went back, b restarted
    assert (plan.serving, plan.resync, plan.up) == ((), (0, 1), (0, 1))
    assert "http://b:2 restarted" in plan.last_error
    watch.synced(plan.up)  # the full push reached both: their new processes are the ones synced
    plan = watch.observe(3.0, [_v(4, "a1"), _v(4, "b2")], ver=4)
    assert plan.serving == (0, 1) and plan.outage_s == 0.0


def test_outage_clock_runs_from_the_first_probe_without_a_server() -> None:
    watch = ServerWatch(URLS[:1])
    assert watch.observe(10.0, ["down"], ver=1).outage_s == 0.0
    assert watch.observe(12.5, ["down"], ver=1).outage_s == pytest.approx(2.5)
    assert watch.observe(13.0, [_v(0, "new")], ver=1).outage_s == pytest.approx(3.0)  # back, not synced
    watch.synced([0])
    assert watch.observe(14.0, [_v(2, "new")], ver=2).outage_s == 0.0
    assert watch.observe(20.0, ["down"], ver=2).outage_s == 0.0  # a new outage starts here


@pytest.mark.parametrize(
    ("serving", "held", "stale", "reason"),
    [
        (False, True, True, "no_server"),
        (True, True, True, "gate"),
        (True, False, True, "stale_packs"),
        (True, False, False, "queue_empty"),
    ],
)
def test_skip_reason_order(serving: bool, held: bool, stale: bool, reason: str) -> None:
    assert skip_reason(serving=serving, some_rank_held=held, went_stale=stale) == reason
