"""`WeightPublisher`: the learner's side of keeping rollout servers on its policy.

It owns the push of the state dict (rank 0 pushes; every rank learns the outcome) and advances the
shared `VersionClock` (`clock.ver`: the policy version the servers serve; it starts from what the servers
report and moves with every push, past any version a partly committed push left on some server; the
queue, the rollout source and the prefetcher read the same clock), and the fresh-server
rule: a server that reports version 0 while the learner has made no update already serves the base
weights; anything else gets a push before its rollouts are used.

Two ways to use it: `ensure_current` (step mode, one rank: push before a B step when the weights changed)
and `sync` (async mode, every rank: a collective with the sync fence closed around it).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import httpx
import torch

from stagectl import dist
from stagectl.config.engines import merges_adapter
from stagectl.inference.client import RolloutClient
from stagectl.learner.channel_b.clock import VersionClock
from stagectl.weightsync.base import PushReport
from stagectl.weightsync.client import WeightSyncClient
from stagectl.weightsync.errors import WeightPushError
from stagectl.weightsync.wire import WeightState
from stagectl.wire.errors import RolloutRequestError


@dataclass(frozen=True)
class SyncOutcome:
    status: str  # "ok" | "unreachable" (skipped; the next sync retries) | "error" (ends every rank)
    message: str = ""
    num_bytes: int = 0  # bytes sent (a delta: only the changed blocks)
    seconds: float = 0.0  # the whole push, state-dict gathering included
    state_bytes: int = 0  # bytes of the whole state dict
    delta: bool = False  # only changed blocks were sent
    version: int = 0  # the version the servers serve after an "ok" push


class WeightPublisher:
    def __init__(
        self,
        client: WeightSyncClient,
        model: Any,
        world: dist.World,
        *,
        num_updates: int,
        clock: VersionClock | None = None,
        storage_dtype: torch.dtype | None = None,
        adapter_sync: bool = False,
    ) -> None:
        """`clock`: the version clock and fence Channel-B shares (a clock of its own when None); it is set
        to the highest version the servers report."""
        self.client = client
        self.model = model
        self.world = world
        self.clock = clock if clock is not None else VersionClock()
        self.storage_dtype = storage_dtype  # the servers' dtype: float32 masters are converted to it
        versions = client.versions() if world.is_main else []
        self.clock.advance(dist.broadcast_object(max(v.version for v in versions) if versions else 0))
        # `sync.mode: adapter`: servers whose engine merges adapters (hf) get the adapter alone; if any engine
        # cannot (vLLM), all get the merged weights (a full sync of the plain model, as a checkpoint's model/)
        adapter_engines = adapter_sync and all(merges_adapter(v.engine) for v in versions)
        self.sends_adapter: bool = adapter_sync and dist.broadcast_object(adapter_engines)
        # a fresh server already serves the base weights; anything else gets a push first
        self.pushed_at_update = 0 if self.ver == 0 and num_updates == 0 else -1
        self.num_syncs = 0
        self.num_failures = 0
        self.seconds_total = 0.0
        self.bytes_total = 0
        self.last: SyncOutcome | None = None
        # After a failed push some servers may have committed it (a multi-server commit that failed on
        # another server): the next push must go past the highest version any server serves.
        self._maybe_diverged = False

    @property
    def ver(self) -> int:
        """The policy version the servers serve (the clock's)."""
        return self.clock.ver

    @property
    def fresh(self) -> bool:
        """True when the servers serve exactly the learner's current weights at update 0."""
        return self.pushed_at_update == 0

    def ensure_current(self, num_updates: int) -> SyncOutcome | None:
        """Step mode (one rank): push if the weights changed since the last push. Raises on failure."""
        if self.pushed_at_update == num_updates:
            return None
        with self._weights() as weights:
            outcome = self._push(weights)
        if outcome.status != "ok":
            raise WeightPushError(outcome.message)
        self._advance(outcome)
        self.pushed_at_update = num_updates
        return outcome

    def sync(
        self,
        fence_timeout_s: float | None,
        *,
        target: int | None = None,
        then: Callable[[SyncOutcome], None] | None = None,
    ) -> SyncOutcome:
        """Async mode, every rank: close the clock's fence (no rollout call in flight on this rank), meet, rank 0
        pushes the next version, every rank learns the outcome (and the version pushed). An unreachable server skips this sync (the
        next retries); a rejected push ends every rank with its message. `target`: push as this version
        instead of the next (a resumed run re-labels its checkpoint's weights with their saved version);
        it must be above every version the servers report. `then(outcome)` runs on every rank once the
        version has moved, with the fence still closed (a collective is allowed there)."""
        with self.clock.sync(timeout_s=fence_timeout_s):
            dist.barrier()
            # under fsdp every rank gathers each tensor in turn while rank 0 sends it (see `_weights`)
            with self._weights() as weights:
                outcome = self._push(weights, target) if self.world.is_main else SyncOutcome("ok")
            outcome = dist.broadcast_object(outcome)
            if outcome.status == "error":
                raise dist.SharedError(
                    f"weight sync to version {self.ver + 1} failed on rank 0: {outcome.message}"
                )
            # the version moves before the fence opens: a rollout section that starts the moment it opens
            # must already see the new version, or the servers' answers would not match it
            if outcome.status == "unreachable":
                self.num_failures += 1
            else:
                self._advance(outcome)
            self.last = outcome
            if then is not None:  # every rank, inside the fence: no rollout section can start meanwhile
                then(outcome)
        return outcome

    def _advance(self, outcome: SyncOutcome) -> None:
        self.clock.advance(outcome.version)
        self.num_syncs += 1
        self.seconds_total += outcome.seconds
        self.bytes_total += outcome.num_bytes

    @contextlib.contextmanager
    def _weights(self) -> Iterator[WeightState]:
        """What a push sends, in the servers' dtype. Under fsdp a `TensorStream` that gathers one tensor
        at a time from the shards while rank 0 sends it (the push holds a chunk or a tensor, never the
        model); every rank takes every tensor (all-gathers), whatever the push did, before the block
        ends. A delta sync compares whole tensors, so it gets the whole state dict gathered first."""
        from stagectl.learner import sharding

        if not sharding.is_sharded(self.model):
            yield self._state_dict()
            return
        keep = self.world.is_main
        if keep and self.client.keeps_delta_base():
            yield sharding.full_state_dict(self.model, dtype=self.storage_dtype, keep=True)
            return
        gathered = sharding.GatheredStream(self.model, dtype=self.storage_dtype, keep=keep)
        try:
            yield gathered.stream()
        finally:
            gathered.drain()

    def _state_dict(self) -> dict[str, torch.Tensor]:
        """Full CPU tensors in the servers' dtype of an unsharded model."""
        from stagectl.learner import adapter

        dtype = self.storage_dtype
        if self.sends_adapter:  # peft's names, float32: the servers merge onto their float32 base
            return adapter.adapter_state_dict(self.model)
        if adapter.has_adapter(self.model):  # the plain model: original names, the adapter merged in
            return adapter.merged_state_dict(self.model, dtype=dtype)
        return {
            name: t.detach().to("cpu", dtype=dtype) if dtype is not None else t.detach().to("cpu")
            for name, t in self.model.state_dict().items()
        }

    def _push(self, state_dict: WeightState, version: int | None = None) -> SyncOutcome:
        """Rank 0: push the weights as the next version. Normally `ver + 1`; after a failed push, one
        above the highest version any server reports, so servers that committed the failed push and
        servers that did not all move to one new version (none refuses it as not newer)."""
        started = time.perf_counter()
        try:
            target = self.ver + 1 if version is None else version
            if self._maybe_diverged:
                target = max(target, max(v.version for v in self.client.versions()) + 1)
            with torch.no_grad():
                report: PushReport = self.client.push_weights(state_dict, target, base_version=self.ver)
        except (WeightPushError, RolloutRequestError, httpx.TransportError) as exc:
            # by type: a lost server or connection skips this sync (the next retries); a refusal ends the run
            self._maybe_diverged = True
            unreachable = isinstance(exc, httpx.TransportError) or (
                isinstance(exc, WeightPushError) and exc.unreachable
            )
            kind = "unreachable" if unreachable else "error"
            return SyncOutcome(kind, str(exc), seconds=time.perf_counter() - started)
        self._maybe_diverged = False
        seconds = time.perf_counter() - started
        return SyncOutcome("ok", "", report.num_bytes, seconds, report.state_bytes, report.delta, target)

    def totals(self) -> dict[str, Any]:
        """The run's weight-sync totals so far (saved with a checkpoint, `carry_totals`' input)."""
        return {
            "num_syncs": self.num_syncs,
            "num_failures": self.num_failures,
            "bytes_total": self.bytes_total,
            "seconds_total": self.seconds_total,
        }

    def carry_totals(self, saved: Mapping[str, Any]) -> None:
        """A resumed run's totals go on from its checkpoint's `totals()` (they restarted at the resume's own
        sync, so the run's report counted only the syncs since); absent from checkpoints written before."""
        self.num_syncs += int(saved.get("num_syncs", 0))
        self.num_failures += int(saved.get("num_failures", 0))
        self.bytes_total += int(saved.get("bytes_total", 0))
        self.seconds_total += float(saved.get("seconds_total", 0.0))

    def metrics(self, outcome: SyncOutcome | None) -> dict[str, Any]:
        """Per-sync figures of `outcome` (this step's sync, if any) and the running totals. The learner
        loop adds `weight_sync/step_fraction` (sync seconds / step seconds) to the row."""
        row: dict[str, Any] = {
            "weight_sync/total": self.num_syncs,
            "weight_sync/fail_total": self.num_failures,
            "weight_sync/bytes_total": self.bytes_total,
        }
        if outcome is not None and outcome.status == "ok":
            row["weight_sync/bytes"] = outcome.num_bytes
            row["weight_sync/state_bytes"] = outcome.state_bytes
            row["weight_sync/delta"] = int(outcome.delta)
            row["time/weight_sync_s"] = outcome.seconds
            row["weight_sync/mb_per_s"] = (
                outcome.num_bytes / 1e6 / outcome.seconds if outcome.seconds else 0.0
            )
        return row


def connection_metrics(client: RolloutClient, publisher: WeightPublisher) -> dict[str, Any]:
    """The rollout client's and the weight sync's running counters (every step's row with servers)."""
    row: dict[str, Any] = {f"rollout_client/{k}": v for k, v in client.counters().items()}
    row["weight_sync/delta_fallbacks"] = publisher.client.counters()["delta_fallbacks"]
    return row
