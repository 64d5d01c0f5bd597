"""`ServerHealth` against the real rollout server app in process (FastAPI + uvicorn on 127.0.0.1 over the
fake echo engine, which answers `ver=<version> w=<sum of w0>`): a down server takes no rollout request and
no push while the other carries them; a server restarted on its port (a new instance id, base weights) is
re-synced in full and takes requests again; with no server at all, `stop` ends after the timeout with the
servers and the last error named, `continue_a_only` warns and goes on. The CLI runs of the same
(`tests/faults/test_rollout_loss.py`) are the end-to-end side."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from stagectl.config.plan import ServerList, ServerRollouts
from stagectl.config.rollout import HttpSync
from stagectl.config.stage2_ab import ChannelBConfig
from stagectl.dist import World
from stagectl.engines.fake import FakeEngine, default_weights
from stagectl.inference.client import RolloutClient, RolloutServerError
from stagectl.learner.channel_b.health import MAX_DEFER_STEPS, RolloutLossError, ServerHealth
from stagectl.learner.channel_b.publisher import WeightPublisher
from stagectl.server.app import build_app
from stagectl.server.service import RolloutService, ServerSettings
from stagectl.server.serving import ThreadedServer
from stagectl.stopping import StopSignals
from stagectl.weightsync.client import WeightSyncClient
from stagectl.wire.protocol import InferRequest, Message, RequestConfig


def _serve(port: int = 0) -> ThreadedServer:
    engine = FakeEngine(default_weights())
    return ThreadedServer(build_app(RolloutService(engine, ServerSettings())), port=port).start()


def _port(server: ThreadedServer) -> int:
    return int(server.url.rsplit(":", 1)[1])


class Policy(torch.nn.Module):
    """The fake engine's weights (`w0`, 4 x 4) as a trainable model."""

    def __init__(self) -> None:
        super().__init__()
        self.w0 = torch.nn.Parameter(torch.zeros(4, 4))


class Rig:
    def __init__(
        self, servers: list[ThreadedServer], cb_cfg: ChannelBConfig, watchdog_step_s: float | None = None
    ) -> None:
        self.servers = servers
        self.urls = [s.url for s in servers]
        self.model = Policy()
        self.weights = WeightSyncClient(self.urls, delta=True)
        self.rollouts = RolloutClient(self.urls)
        self.publisher = WeightPublisher(self.weights, self.model, World(0, 0, 1), num_updates=0)
        loss = ServerRollouts(
            ServerList(tuple(self.urls), infer_timeout_s=10.0),
            HttpSync(),
            on_rollout_loss=cb_cfg.on_rollout_loss,
            rollout_loss_timeout_s=cb_cfg.rollout_loss_timeout_s,
        )
        self.health = ServerHealth(
            loss,
            World(0, 0, 1),
            self.publisher,
            self.rollouts,
            lambda o: None,
            watchdog_step_s=watchdog_step_s,
        )

    def train(self) -> None:
        """An 'update' of the policy (its checksum w moves by 16) and the regular sync after it."""
        with torch.no_grad():
            self.model.w0 += 1.0
        outcome = self.publisher.sync(10.0)
        assert outcome.status == "ok", outcome.message

    def answers(self) -> list[tuple[int, float]]:
        """(ver, w) of 4 rollouts spread over the servers the client uses."""
        requests = [InferRequest(messages=[Message(role="user", content=f"hi {i}")]) for i in range(4)]
        out = self.rollouts.infer(requests, RequestConfig(max_tokens=200))
        found = [re.search(r"ver=(\d+) w=([-\d.]+)", r.choices[0].message.content) for r in out]
        return [(int(m.group(1)), float(m.group(2))) for m in found if m is not None]

    def close(self) -> None:
        self.rollouts.close()
        self.weights.close()
        for server in self.servers:
            server.stop()


@pytest.fixture
def two_servers() -> Iterator[Rig]:
    rig = Rig([_serve(), _serve()], ChannelBConfig())
    yield rig
    rig.close()


def test_a_down_server_is_left_out_and_a_restarted_one_resynced_in_full(two_servers: Rig) -> None:
    rig = two_servers
    assert rig.health.check(0, wants_b=True).serving == (0, 1)
    rig.train()
    assert rig.answers() == [(1, 16.0)] * 4
    port = _port(rig.servers[1])
    rig.servers[1].stop()
    plan = rig.health.check(1, wants_b=True)
    assert plan.serving == (0,) and plan.down == (1,) and rig.rollouts.active == [0]
    rig.train()  # the push goes to server 0 only; the rollouts too
    assert rig.publisher.ver == 2 and rig.answers() == [(2, 32.0)] * 4
    rig.servers[1] = _serve(port)  # back on its port: base weights (w 0), version 0, a new instance
    plan = rig.health.check(2, wants_b=False)  # an A step: the re-sync's new version costs no B step
    assert plan.serving == (0, 1) and rig.health.num_resyncs == 1
    assert rig.publisher.last is not None and not rig.publisher.last.delta  # in full: it has no base
    assert rig.answers() == [(3, 32.0)] * 4  # both servers, the learner's current weights
    rig.train()  # and the next regular sync (a delta again) reaches both
    assert rig.publisher.last.delta and rig.answers() == [(4, 48.0)] * 4


def test_a_server_gone_mid_step_is_marked_down_and_its_share_re_sent_to_the_other(two_servers: Rig) -> None:
    """Server 1 dies between two checks: the next call's share for it goes to server 0 in the same call
    (same seeds, at the call's weight version) and server 1 is marked down at once, not at the next check."""
    rig = two_servers
    rig.health.check(0, wants_b=True)
    rig.train()
    requests = [InferRequest(messages=[Message(role="user", content=f"hi {i}")]) for i in range(4)]
    config = RequestConfig(max_tokens=200, seed=7)
    both = [r.choices[0].message.content for r in rig.rollouts.infer(requests, config, weight_version=1)]
    rig.servers[1].stop()
    alone = [r.choices[0].message.content for r in rig.rollouts.infer(requests, config, weight_version=1)]
    assert alone == both  # every sample, the same seeds, the same version
    assert rig.rollouts.active == [0] and rig.rollouts.counters()["failovers"] == 1
    assert rig.answers() == [(1, 16.0)] * 4 and rig.rollouts.counters()["failovers"] == 1  # no retry on 1
    rig.servers[0].stop()  # none left to take the share: the call fails, naming the server
    with pytest.raises(RolloutServerError, match="no other rollout server"):
        rig.answers()


def test_a_server_restarted_between_probes_is_detected_by_its_instance_id(two_servers: Rig) -> None:
    rig = two_servers
    rig.health.check(0, wants_b=True)
    port = _port(rig.servers[0])
    rig.servers[0].stop()
    rig.servers[0] = _serve(port)  # never seen down: version 0 = the learner's, but a new process
    plan = rig.health.check(1, wants_b=False)
    assert plan.serving == (0, 1) and rig.health.num_resyncs == 1 and rig.publisher.ver == 1


def test_a_re_sync_waits_for_an_a_step_while_another_server_serves(two_servers: Rig) -> None:
    """The re-sync is a new version (queued packs of the window's oldest go stale): at a B step with
    another server serving it waits for the next A step, at most `MAX_DEFER_STEPS` B steps in a row; the
    waiting server takes no rollout and no regular push meanwhile."""
    rig = two_servers
    rig.health.check(0, wants_b=True)
    rig.train()
    port = _port(rig.servers[1])
    rig.servers[1].stop()
    rig.servers[1] = _serve(port)
    for step in range(1, 1 + MAX_DEFER_STEPS):
        plan = rig.health.check(step, wants_b=True)
        assert plan.serving == (0,) and plan.resync == (1,) and rig.health.num_resyncs == 0
        assert rig.rollouts.active == [0] and rig.weights.servers.active == [0]
        rig.train()  # a regular (delta) push to server 0 only
        assert rig.answers() == [(rig.publisher.ver, 16.0 * rig.publisher.ver)] * 4
    plan = rig.health.check(1 + MAX_DEFER_STEPS, wants_b=True)  # waited long enough: re-synced now
    assert plan.serving == (0, 1) and rig.health.num_resyncs == 1
    assert rig.answers() == [(MAX_DEFER_STEPS + 2, 16.0 * (MAX_DEFER_STEPS + 1))] * 4


def test_no_server_stops_after_the_timeout_naming_servers_and_error() -> None:
    rig = Rig([_serve()], ChannelBConfig(rollout_loss_timeout_s=1.0))
    try:
        rig.servers[0].stop()
        assert not rig.health.check(3, wants_b=False).serving  # an A step goes on inside the timeout
        started = time.monotonic()
        with pytest.raises(RolloutLossError) as caught:
            rig.health.check(4, wants_b=True)  # a B step waits, then stops
        assert 0.5 < time.monotonic() - started < 10
        message = str(caught.value)
        assert rig.urls[0] in message and "ConnectError" in message and "before step 5" in message
        assert "rollout_loss_timeout_s 1" in message
    finally:
        rig.close()


def test_the_wait_ends_before_the_step_watchdog_would() -> None:
    rig = Rig([_serve()], ChannelBConfig(rollout_loss_timeout_s=300), watchdog_step_s=2.0)
    try:
        rig.servers[0].stop()
        started = time.monotonic()
        with pytest.raises(RolloutLossError, match=r"capped at 80% of launch.watchdog.step_s: 1.6"):
            rig.health.check(0, wants_b=True)
        assert time.monotonic() - started < 2.0 + 1.5  # the probe interval past 1.6 s, never 300 s
    finally:
        rig.close()


def test_a_b_step_waiting_for_a_server_says_so_and_when_one_is_back(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`stop`: the wait (up to `rollout_loss_timeout_s`, 300 s by default) is said as it starts, and its end
    with the restarted server's re-sync; the log showed nothing but the failed rollout call meanwhile."""
    rig = Rig([_serve()], ChannelBConfig(rollout_loss_timeout_s=30.0))
    try:
        rig.health.check(0, wants_b=True)
        rig.train()
        port = _port(rig.servers[0])
        rig.servers[0].stop()
        threading.Timer(1.5, lambda: rig.servers.__setitem__(0, _serve(port))).start()
        assert rig.health.check(4, wants_b=True).serving == (0,)
        err = capsys.readouterr().err
        assert err.count("B step 5 waits for a rollout server: no rollout server can serve") == 1
        assert "stopping once the outage passes 30 s (on_rollout_loss: stop)" in err
        assert f"rollout server {rig.urls[0]} re-synced in full at version 2" in err
        assert re.search(r"B step 5: a rollout server serves again after \d+\.\d s", err)
        assert rig.answers() == [(2, 16.0)] * 4
    finally:
        rig.close()


def test_a_stop_signal_ends_a_b_steps_wait_for_a_server(capsys: pytest.CaptureFixture[str]) -> None:
    """Ctrl-C while a B step waits for a server: the wait ends (the step trains Channel-A, then the loop
    saves and stops). It was ignored until `rollout_loss_timeout_s` (300 s by default) had passed."""
    rig = Rig([_serve()], ChannelBConfig(rollout_loss_timeout_s=20.0))
    try:
        rig.servers[0].stop()
        with StopSignals() as stop:
            threading.Timer(1.0, os.kill, args=(os.getpid(), signal.SIGINT)).start()
            started = time.monotonic()
            assert not rig.health.check(4, wants_b=True).serving
            assert time.monotonic() - started < 10 and stop.signum == signal.SIGINT
        assert "B step 5: a stop signal ends the wait for a rollout server" in capsys.readouterr().err
    finally:
        rig.close()


def test_continue_a_only_warns_for_the_b_step_and_goes_on(capsys: pytest.CaptureFixture[str]) -> None:
    rig = Rig([_serve()], ChannelBConfig(on_rollout_loss="continue_a_only", rollout_loss_timeout_s=1.0))
    try:
        rig.servers[0].stop()
        assert rig.health.step_mode_decision(step=7, num_updates=7).reason == "no_server"
        time.sleep(1.2)
        assert not rig.health.check(8, wants_b=False).serving  # past the timeout: no stop
        err = capsys.readouterr().err
        assert err.count("warning: B step 8 trains as Channel-A: no rollout server can serve") == 1
        assert "step 9" not in err  # an A step the schedule wanted as A: no warning
    finally:
        rig.close()


def test_step_mode_resyncs_a_restarted_server_before_its_b_step() -> None:
    """Step mode (`rollout_backend: vllm` without async): a B step first re-syncs a restarted server (the
    publisher then has nothing left to push for this update), and answers are the learner's weights."""
    rig = Rig([_serve()], ChannelBConfig())
    try:
        rig.train()
        rig.publisher.pushed_at_update = 1  # as `ensure_current` leaves it after update 1's push
        with torch.no_grad():
            rig.model.w0 += 1.0  # update 2, not pushed yet
        port = _port(rig.servers[0])
        rig.servers[0].stop()
        rig.servers[0] = _serve(port)  # base weights again
        decision = rig.health.step_mode_decision(step=2, num_updates=2)
        assert decision.kind == "B" and rig.health.num_resyncs == 1
        assert rig.publisher.ensure_current(2) is None  # the re-sync pushed update 2: no second push
        assert rig.answers() == [(2, 32.0)] * 4
    finally:
        rig.close()


def test_step_mode_without_a_server_trains_a_under_continue_a_only() -> None:
    rig = Rig([_serve()], ChannelBConfig(on_rollout_loss="continue_a_only"))
    try:
        rig.servers[0].stop()
        decision = rig.health.step_mode_decision(step=3, num_updates=3)
        assert (decision.kind, decision.reason) == ("A", "no_server")
    finally:
        rig.close()
