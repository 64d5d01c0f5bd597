"""`ServerHealth`: the async learner's side of rollout servers that die and come back (every rank).

Once per step, rank 0 probes every server's `/version/` (`ServerWatch` turns the answers into a
`ServerRoster`) and every rank learns the roster: rollout requests go to the servers that serve the learner's
version only, pushes to every server that answered. A server that restarted (new `instance_id`) or holds
another version gets a full push of the current weights (never a delta: it no longer has the base) and,
once that push succeeded, rollout requests again. The full push is a new version, so packs queued at the
oldest version of the window go stale: while another server serves, a B step does not pay for it: the
re-sync waits for the next A step (at most `MAX_DEFER_STEPS` B steps in a row; the others carry the
rollouts meanwhile).

When no server can serve, `stage2_ab.channel_b.on_rollout_loss` decides:
- `stop`: a step that wants Channel-B and has no packs queued waits for a server (probing and re-syncing every
  `POLL_S`; an async B step whose packs were queued before the outage trains them first), and once
  no server has served for `rollout_loss_timeout_s` (at any step) the run stops: `RolloutLossError`, which
  the learner loop turns into a checkpoint and the error naming the servers, the last error, the step and
  the checkpoint to resume from. A stop signal (SIGINT/SIGTERM, on rank 0) ends the wait: the step trains
  Channel-A (`no_server`), then the loop saves and stops as after any step.
- `continue_a_only`: the step trains Channel-A (`no_server`), with a warning line for every such B step.

Which rollout servers can serve the learner's policy: a small pure class over probes it is given (rank 0
probes every server's `/version/` once per step; `AsyncChannelB` acts on the roster).

A server *serves* when it answered and holds exactly the learner's version `ver` on the process the
learner last synced (its `instance_id`, new at every server start). A server that answered but restarted
(another instance id) or holds another version (its version went back: a restart; or a push it missed
while it was away) must be *re-synced*: a full push of the current weights (a delta needs a base it no
longer has), after which it serves again. A server that did not answer is *down*: it takes no rollout
request and no push until a probe finds it back. When no server serves, the *outage* clock runs from
the first probe that found none, until one serves again (`stage2_ab.channel_b.rollout_loss_timeout_s`
is measured on it).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from stagectl import dist, stopping
from stagectl.config.plan import ServerRollouts
from stagectl.console import say
from stagectl.inference.client import RolloutClient
from stagectl.learner.channel_b.protocol import Decision
from stagectl.learner.channel_b.publisher import SyncOutcome, WeightPublisher
from stagectl.wire.protocol import VersionResponse

POLL_S = 1.0  # how often a waiting B step probes the servers again
MAX_DEFER_STEPS = 2  # B steps in a row a re-sync waits for an A step (while another server serves)


class RolloutLossError(dist.SharedError):
    """No rollout server could serve for longer than `rollout_loss_timeout_s` (policy `stop`)."""

    def __init__(self, message: str, step: int) -> None:
        super().__init__(message)
        self.step = step


class ServerHealth:
    def __init__(
        self,
        rollouts: ServerRollouts,
        world: dist.World,
        publisher: WeightPublisher,
        rollout_client: RolloutClient,
        after_sync: Callable[[SyncOutcome], None],
        *,
        watchdog_step_s: float | None = None,
    ) -> None:
        """`rollouts`: the servers (a re-sync waits for calls in flight up to their `infer_timeout_s`) and
        the loss policy. `watchdog_step_s`: the deadline of the step phase a B step waits in (multi-rank
        runs): the wait ends at 80% of it if that comes first, so the run stops with the servers named, not
        by the watchdog."""
        self.on_loss = rollouts.on_rollout_loss
        self.configured_timeout_s = rollouts.rollout_loss_timeout_s
        self.timeout_s = self.configured_timeout_s
        if watchdog_step_s is not None:
            self.timeout_s = min(self.timeout_s, 0.8 * watchdog_step_s)
        self.world = world
        self.publisher = publisher
        self.weight_client = publisher.client
        self.rollout_client = rollout_client
        self.fence_timeout_s = rollouts.servers.infer_timeout_s
        self.after_sync = after_sync
        self.watch = ServerWatch(self.weight_client.base_urls)
        self.num_resyncs = 0  # full pushes to restarted or lagging servers
        self.roster = ServerRoster(tuple(range(len(self.weight_client.base_urls))), (), (), 0.0, "")
        self._deferred = 0  # B steps in a row whose re-sync waited (`check`)

    def check(
        self, step: int, *, wants_b: bool, defer_resync: bool = True, wait: bool = True
    ) -> ServerRoster:
        """Every rank: probe, re-sync what needs it, route the rollouts; with policy `stop` a B step
        waits for a server (at most until the outage reaches the timeout). The roster after it.
        `defer_resync`: a B step while another server serves leaves the re-sync to the next A step (its new
        version would make queued packs stale), at most `MAX_DEFER_STEPS` in a row. `wait=False`: a B step
        whose packs may already be queued does not wait yet (`waits_for_server` says when it must)."""
        roster = self._probe_and_resync(defer=defer_resync and wants_b)
        wait_since = None  # monotonic start of a B step's wait for a server
        while not roster.serving and self.on_loss == "stop":
            if roster.outage_s > self.timeout_s:
                raise RolloutLossError(self.loss_message(roster, step), step)
            if not (wants_b and wait):
                break
            if roster.stop_requested:  # the loop saves and stops after this step, which trains Channel-A
                say("train-ab", f"B step {step + 1}: a stop signal ends the wait for a rollout server")
                break
            if wait_since is None:  # a wait of up to the timeout: the log says why the step is not moving
                wait_since = time.monotonic()
                say(
                    "train-ab",
                    f"B step {step + 1} waits for a rollout server: {self._no_server(roster)}; stopping once "
                    f"the outage passes {self.timeout_s:g} s (on_rollout_loss: stop)",
                )
            time.sleep(POLL_S)
            roster = self._probe_and_resync(defer=False)
        if wait_since is not None and roster.serving:
            waited_s = time.monotonic() - wait_since
            say("train-ab", f"B step {step + 1}: a rollout server serves again after {waited_s:.1f} s")
        return roster

    def waits_for_server(self, roster: ServerRoster) -> bool:
        """Policy `stop` and no server serves: a B step without queued packs waits (`check`)."""
        return self.on_loss == "stop" and not roster.serving

    def warn_trains_a(self, step: int) -> None:
        """The B step `step` trains as Channel-A because no server can serve (`continue_a_only`): said
        by the caller once the step's kind is decided (an async B step with queued packs still trains B)."""
        say("train-ab", f"warning: B step {step + 1} trains as Channel-A: {self._no_server(self.roster)}")

    def step_mode_decision(self, step: int, num_updates: int) -> Decision:
        """Step mode (one rank), a step the schedule wants as B: `check` (a restarted server re-synced;
        `stop` waits, or raises past the timeout), then B, or A (`no_server`) under `continue_a_only`."""
        resyncs = self.num_resyncs
        roster = self.check(step, wants_b=True, defer_resync=False)  # no queue: no pack goes stale
        if self.num_resyncs != resyncs:  # the re-sync pushed the current weights: no push before the rollouts
            self.publisher.pushed_at_update = num_updates
        if not roster.serving:
            self.warn_trains_a(step)
            return Decision("A", reason="no_server")
        return Decision("B")

    def _probe_and_resync(self, *, defer: bool) -> ServerRoster:
        probed = None
        if self.world.is_main:  # rank 0's stop signal, as the loop's stop broadcast has it
            probed = self.watch.observe(time.monotonic(), self.weight_client.probe(), self.publisher.ver)
            probed = replace(probed, stop_requested=stopping.stop_requested())
        roster = dist.broadcast_object(probed)
        assert roster is not None, "rank 0 probes"
        # the same decision on every rank: it rests on the broadcast roster and the rank-local count only
        defer = defer and bool(roster.resync) and bool(roster.serving) and self._deferred < MAX_DEFER_STEPS
        self._deferred = self._deferred + 1 if defer else 0
        if self.world.is_main:  # a server waiting for its re-sync takes no regular (delta) push either
            self.weight_client.use_servers(roster.serving if defer else roster.up)
        self.rollout_client.use_servers(roster.serving)
        if roster.resync and not defer:
            roster = self._resync(roster)
        self.roster = roster
        return roster

    def _resync(self, roster: ServerRoster) -> ServerRoster:
        """A full push of the current weights to every server that answered (collective)."""
        if self.world.is_main:
            self.weight_client.forget_delta_base()
        outcome = self.publisher.sync(self.fence_timeout_s, then=self.after_sync)
        if outcome.status != "ok":
            if self.world.is_main:
                self.watch.failed(outcome.message)
            return roster
        self.num_resyncs += 1
        if self.world.is_main:
            self.watch.synced(roster.up)
        urls = ", ".join(self.weight_client.base_urls[k] for k in roster.resync)
        say("train-ab", f"rollout server {urls} re-synced in full at version {self.publisher.ver}")
        self.rollout_client.use_servers(roster.up)
        return ServerRoster(roster.up, (), roster.down, 0.0, roster.last_error)

    def _no_server(self, roster: ServerRoster) -> str:
        urls = ", ".join(self.weight_client.base_urls)
        return f"no rollout server can serve ({urls}) for {roster.outage_s:.1f} s; last error: {roster.last_error}"

    def loss_message(self, roster: ServerRoster, step: int) -> str:
        return (
            f"{self._no_server(roster)} (> stage2_ab.channel_b.rollout_loss_timeout_s {self.configured_timeout_s:g}"
            + (
                f", capped at 80% of launch.watchdog.step_s: {self.timeout_s:g}"
                if self.timeout_s < self.configured_timeout_s
                else ""
            )
            + "); "
            f"stopped before step {step + 1} (on_rollout_loss: stop; continue_a_only trains Channel-A meanwhile)"
        )


@dataclass(frozen=True)
class ServerRoster:
    """What the learner does with the servers this step (plain data: broadcast to every rank)."""

    serving: tuple[int, ...]  # servers that serve `ver` now
    resync: tuple[int, ...]  # up, but restarted or on another version: a full push first
    down: tuple[int, ...]  # no answer: no requests, no pushes
    outage_s: float  # how long no server has served (0 while one does)
    last_error: str  # the latest probe or push error ("" if none yet)
    stop_requested: bool = False  # rank 0 got a stop signal (SIGINT/SIGTERM): a B step stops waiting

    @property
    def up(self) -> tuple[int, ...]:
        """The servers a push goes to (and, once it succeeded, the rollouts)."""
        return tuple(sorted(self.serving + self.resync))


@dataclass
class ServerWatch:
    urls: Sequence[str]
    instance_ids: list[str | None] = field(init=False)  # the process each server ran at its last sync
    _seen_ids: list[str | None] = field(init=False)  # at the last probe
    _outage_since: float | None = None
    last_error: str = ""

    def __post_init__(self) -> None:
        self.instance_ids = [None] * len(self.urls)
        self._seen_ids = [None] * len(self.urls)

    def observe(self, now: float, probes: Sequence[VersionResponse | str], ver: int) -> ServerRoster:
        """One probe per server (its `/version/` answer, or the error message of a call that failed)."""
        assert len(probes) == len(self.urls), "one probe per server"
        serving, resync, down = [], [], []
        for k, probe in enumerate(probes):
            if isinstance(probe, str):
                down.append(k)
                self.last_error = f"{self.urls[k]}: {probe}"
                continue
            self._seen_ids[k] = probe.instance_id
            if self.instance_ids[k] is None:  # first sight: the process the learner starts with
                self.instance_ids[k] = probe.instance_id
            if probe.instance_id == self.instance_ids[k] and probe.version == ver:
                serving.append(k)
            else:
                resync.append(k)
                if probe.instance_id != self.instance_ids[k]:
                    self.last_error = f"{self.urls[k]} restarted (instance {probe.instance_id or '?'})"
                else:
                    self.last_error = f"{self.urls[k]} serves version {probe.version}, the learner {ver}"
        if serving:
            self._outage_since = None
        elif self._outage_since is None:
            self._outage_since = now
        outage_s = 0.0 if self._outage_since is None else now - self._outage_since
        return ServerRoster(tuple(serving), tuple(resync), tuple(down), outage_s, self.last_error)

    def synced(self, servers: Sequence[int]) -> None:
        """A push reached `servers` (each now serves the learner's version on the process last probed)."""
        for k in servers:
            self.instance_ids[k] = self._seen_ids[k]
        if servers:
            self._outage_since = None

    def failed(self, message: str) -> None:
        """A push or rollout call failed: the message names it in the stop error."""
        self.last_error = message


def servers_without_version_tags(urls: list[str], versions: list[VersionResponse]) -> list[str]:
    """The servers whose `/version/` does not promise `weight_version` tags (an older stagectl server's
    answer lacks the field: False)."""
    return [url for url, v in zip(urls, versions, strict=True) if not v.version_tags]


def untagged_message(urls: list[str]) -> str:
    """Why `in_flight_sync` cannot run against these servers (their `/version/` lacks `version_tags`)."""
    return (
        "stage2_ab.channel_b.async.in_flight_sync needs rollout servers that answer /infer/ at a tagged weight "
        f"version and swap syncs in between calls (stagectl's, this release or later); {', '.join(urls)} "
        f"{'does' if len(urls) == 1 else 'do'} not: upgrade them, or set in_flight_sync: false (the weight "
        "sync then waits for the rollouts in flight)"
    )
