"""The server side of a weight sync, the part every transport shares: one staging area, filled by the
transport's receiver, verified, and swapped in on commit.

Each transport's receiver sits next to its sender: `http.HttpReceiver` (chunks, from the app's port or the
weight-stream port), `collective.GroupReceiver` (the weight group's broadcasts), `disk.DiskReceiver` (a
snapshot by path). The receivers a server mounts share one `WeightSync`: one lock, one sync in progress.
A sync that starts while another is unfinished supersedes it (its client died), whichever transport each
came on. `commit` checks the target version, the transport's own check (http: every chunk arrived), that
a delta's base still serves and that every tensor of a full sync arrived, then hands the touched tensors
to `engine.apply_weights`, which swaps them under the generation lock. Any failure discards the staging
and leaves the serving weights and version untouched.

The staging buffers persist between syncs: after a successful staged sync they hold exactly the serving
weights (`mirror_version`), which is what makes a delta possible (its untouched rows keep the serving
values) and spares re-faulting fresh pages on every sync. The price is one host-memory copy of the
weights on the server. A delta is refused (`DeltaBaseError`, HTTP 409) unless its base version is the
serving version and the staging mirrors it; the learner then sends a full sync.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol

import torch

from stagectl.weightsync.errors import DeltaBaseError, WeightSyncError
from stagectl.weightsync.gate import VersionGate, WeightTarget
from stagectl.weightsync.protocol import SyncResponse
from stagectl.weightsync.staging import StagedWeights

log = logging.getLogger("stagectl.weightsync.receiver")


class Writer(Protocol):
    """What may still write into the staging buffers of the sync in progress: a chunk streaming in (http),
    a collective sync's broadcasts."""

    def abandon(self) -> None:
        """Its sync failed (the lock held). The buffers it writes are given up by `WeightSync.fail`; drop
        whatever else it leaves in an unknown state."""
        ...


class WeightSync:
    """The staging and the sync in progress. Methods marked "the lock held" are called by the receivers
    inside `with sync.lock:`; the lock is never held while bytes stream in."""

    def __init__(self, engine: WeightTarget) -> None:
        self.engine = engine
        self.gate = VersionGate(engine)  # a commit swaps in between rollout calls (`weightsync.gate`)
        self.lock = threading.Lock()  # guards the state below
        self.sync_id: str | None = None
        self.transport: str | None = None  # the transport the sync in progress came on
        self.target_version = -1
        self.base_version: int | None = None  # a delta's base; None for a full sync
        self.staged: StagedWeights | None = None
        self.writer: Writer | None = None  # what may still write into the buffers (see `Writer`)
        self._buffers: dict[str, torch.Tensor] = {}  # persistent staging (see the module docstring)
        self.mirror_version = -1  # the version `_buffers` holds exactly; -1: none
        self.num_syncs = 0
        self.num_failed_syncs = 0

    def check_above_serving(self, version: int) -> None:
        committed = self.gate.committed_version
        if version <= committed:
            raise WeightSyncError(f"target version {version} is not above the serving version {committed}")

    def supersede(self, sync_id: str) -> None:
        """The lock held: drop the unfinished sync in progress, if any, for `sync_id`."""
        if self.sync_id is not None:
            log.warning("weight sync %s superseded by %s before its commit", self.sync_id, sync_id)
            self.fail("superseded")

    def start(self, sync_id: str, transport: str, version: int, base_version: int | None) -> StagedWeights:
        """The lock held, no sync in progress: stage `sync_id` (a delta only on the serving version's
        mirror: `DeltaBaseError` otherwise). A swap still pending reads the buffers: it goes first."""
        self.gate.wait_swapped()
        if base_version is not None and (
            base_version != self.engine.version or self.mirror_version != self.engine.version
        ):
            held = (
                f"serving version {self.engine.version}"
                if self.mirror_version == self.engine.version
                else f"serving version {self.engine.version} without a staged copy of it (it came from disk or a failed sync)"
            )
            raise DeltaBaseError(
                f"delta sync {sync_id} against base version {base_version} refused: the server holds {held}; "
                "send a full sync"
            )
        self.sync_id = sync_id
        self.transport = transport
        self.target_version = version
        self.base_version = base_version
        self.mirror_version = -1  # the buffers are about to change
        self.staged = StagedWeights(self.engine.weight_specs(), self._buffers, delta=base_version is not None)
        return self.staged

    def commit(self, sync_id: str, version: int, check: Callable[[], None] | None = None) -> SyncResponse:
        """The lock held: commit `sync_id` (the transport's own `check` passed, every tensor arrived),
        then apply."""
        if sync_id != self.sync_id or self.staged is None:
            raise WeightSyncError(
                f"unknown weight sync {sync_id!r} (never started, aborted or superseded); "
                f"still serving version {self.engine.version}"
            )
        staged = self.staged
        try:
            if version != self.target_version:
                raise WeightSyncError(
                    f"commit version {version} differs from the chunks' {self.target_version}"
                )
            if check is not None:
                check()
            if self.base_version is not None and self.base_version != self.engine.version:
                raise DeltaBaseError(
                    f"delta against base version {self.base_version}, but version {self.engine.version} "
                    "is serving now; send a full sync"
                )
            staged.check_complete()
        except WeightSyncError as exc:
            self.fail(str(exc))
            raise type(exc)(f"{exc}; still serving version {self.engine.version}") from None
        self._clear()
        response = self._apply(staged.tensors, version, staged.num_bytes)
        self.mirror_version = version
        return response

    def apply_snapshot(self, tensors: dict[str, torch.Tensor], version: int, num_bytes: int) -> SyncResponse:
        """The lock held: apply a verified full state that did not come through the staging."""
        self.mirror_version = -1  # the staging buffers no longer hold the serving weights
        return self._apply(tensors, version, num_bytes)

    def abort(self, sync_id: str) -> bool:
        """Drop the staging of `sync_id`; False when it is not the sync in progress."""
        with self.lock:
            if sync_id != self.sync_id:
                return False
            self.fail("aborted by the client")
            return True

    def fail(self, reason: str) -> None:
        """The lock held: count a failed sync and drop its staging."""
        log.warning("weight sync %s failed: %s", self.sync_id, reason)
        self.num_failed_syncs += 1
        if self.writer is not None:  # it may still write into the buffers: give them up
            self._buffers = {}
            self.writer.abandon()
        self._clear()

    def _apply(self, tensors: dict[str, torch.Tensor], version: int, num_bytes: int) -> SyncResponse:
        """Swap `version` in through the gate: now, or when the rollout calls in progress end (deferred:
        the response comes at once, `apply_s` 0)."""
        seconds = [0.0]

        def swap() -> None:
            start = time.perf_counter()
            self.engine.apply_weights(tensors, version)
            seconds[0] = time.perf_counter() - start
            log.info(
                "weights version %d applied: %d tensors, %d bytes, %.3f s",
                version,
                len(tensors),
                num_bytes,
                seconds[0],
            )

        now = self.gate.apply(version, swap)
        self.num_syncs += 1
        return SyncResponse(
            version=version,
            num_tensors=len(tensors),
            num_bytes=num_bytes,
            apply_s=seconds[0],
            deferred=not now,
        )

    def _clear(self) -> None:
        self.sync_id = None
        self.transport = None
        self.staged = None
        self.writer = None
        self.base_version = None
        self.target_version = -1
