"""Which rollout servers can serve the learner's policy: a small pure class over probes it is given (rank 0
probes every server's `/version/` once per step; `AsyncChannelB` acts on the plan).

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

from collections.abc import Sequence
from dataclasses import dataclass, field

from stagectl.wire.protocol import VersionResponse


@dataclass(frozen=True)
class ServerPlan:
    """What the learner does with the servers this step (plain data: broadcast to every rank)."""

    serving: tuple[int, ...]  # servers that serve `ver` now
    resync: tuple[int, ...]  # up, but restarted or on another version: a full push first
    down: tuple[int, ...]  # no answer: no requests, no pushes
    outage_s: float  # how long no server has served (0 while one does)
    last_error: str  # the latest probe or push error ("" if none yet)

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

    def observe(self, now: float, probes: Sequence[VersionResponse | str], ver: int) -> ServerPlan:
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
        return ServerPlan(tuple(serving), tuple(resync), tuple(down), outage_s, self.last_error)

    def synced(self, servers: Sequence[int]) -> None:
        """A push reached `servers` (each now serves the learner's version on the process last probed)."""
        for k in servers:
            self.instance_ids[k] = self._seen_ids[k]
        if servers:
            self._outage_since = None

    def failed(self, message: str) -> None:
        """A push or rollout call failed: the message names it in the stop error."""
        self.last_error = message
