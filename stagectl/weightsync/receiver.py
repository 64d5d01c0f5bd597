"""The server side of a weight sync: one staging area, streamed in and verified chunk by chunk, swapped on
commit; plus the `disk` snapshot load.

Protocol (one sync at a time): chunks `0, 1, 2, ...` of a `sync_id` arrive with their XXH3-128 digest and
the target version (and, for a delta, the base version); each is streamed into the staging
(`staging.ChunkReceiver`: header checked against names, shapes and dtypes before any byte is copied,
digest compared at its end). `commit` checks that every chunk (and for a full sync every tensor)
arrived, then hands the touched tensors to `engine.apply_weights`, which swaps them under the generation
lock. Any failure discards the staging and leaves the serving weights and version untouched. A chunk
with a new `sync_id` supersedes an unfinished sync (its client died).

The staging buffers persist between syncs: after a successful http sync they hold exactly the
serving weights (`_mirror_version`), which is what makes a delta possible (its untouched rows keep the
serving values) and spares re-faulting fresh pages on every sync. The price is one host-memory copy of
the weights on the server. A delta is refused (`DeltaBaseError`, HTTP 409) unless its base version is
the serving version and the staging mirrors it; the learner then sends a full sync.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from stagectl.rollout.engine import Engine
from stagectl.rollout.paths import resolve_under_roots
from stagectl.rollout.protocol import SyncResponse
from stagectl.weightsync.collective import GroupError, GroupInfo, WeightGroup
from stagectl.weightsync.errors import DeltaBaseError, NoGroupError, WeightSyncError
from stagectl.weightsync.staging import ChunkReceiver, StagedWeights, verify_full

log = logging.getLogger("stagectl.weightsync.receiver")


class WeightSync:
    def __init__(self, engine: Engine, weight_dirs: Sequence[Path]) -> None:
        self.engine = engine
        self.weight_dirs = list(weight_dirs)
        self._lock = threading.Lock()  # guards the state below; never held while bytes stream in
        self._sync_id: str | None = None
        self._target_version = -1
        self._base_version: int | None = None  # a delta's base; None for a full sync
        self._next_index = 0
        self._staged: StagedWeights | None = None
        self._active: ChunkReceiver | None = None  # the chunk streaming in now
        self._buffers: dict[str, torch.Tensor] = {}  # persistent staging (see the module docstring)
        self._mirror_version = -1  # the version `_buffers` holds exactly; -1: none
        self._group: WeightGroup | None = None  # transport: collective (the learner's weight group)
        self._receiving: _Receiving | None = None  # a collective sync's broadcasts in flight
        self.num_syncs = 0
        self.num_failed_syncs = 0

    # --- http chunks -----------------------------------------------------------------------------

    def begin_chunk(
        self, sync_id: str, chunk_index: int, digest: str, version: int, base_version: int | None = None
    ) -> ChunkReceiver:
        """Check and open chunk `chunk_index` of `sync_id`; feed it the body, then `finish_chunk`."""
        with self._lock:
            if sync_id != self._sync_id:
                if self._sync_id is not None:
                    log.warning("weight sync %s superseded by %s before its commit", self._sync_id, sync_id)
                    self._fail("superseded")
                self._start(sync_id, version, base_version)
            try:
                self._check_chunk(chunk_index, version, base_version)
            except WeightSyncError as exc:
                self._fail(f"chunk {chunk_index}: {exc}")
                raise type(exc)(
                    f"{exc}; sync {sync_id} aborted, still serving version {self.engine.version}"
                ) from None
            assert self._staged is not None
            self._next_index += 1
            self._active = ChunkReceiver(self._staged, digest)
            return self._active

    def finish_chunk(self, receiver: ChunkReceiver) -> int:
        """End a chunk begun by `begin_chunk`: the number of tensors in it, or `WeightSyncError`."""
        with self._lock:
            sync_id = self._sync_id
            if receiver is not self._active:
                raise WeightSyncError(
                    f"chunk of a weight sync that was aborted or superseded; still serving version {self.engine.version}"
                )
            self._active = None
            try:
                return receiver.finish()
            except WeightSyncError as exc:
                self._fail(str(exc))
                raise WeightSyncError(
                    f"{exc}; sync {sync_id} aborted, still serving version {self.engine.version}"
                ) from None

    def fail_chunk(self, receiver: ChunkReceiver, reason: str) -> None:
        """A chunk's body never arrived whole (the client went away): drop its sync."""
        with self._lock:
            if receiver is self._active:
                self._fail(reason)

    def add_chunk(
        self,
        sync_id: str,
        chunk_index: int,
        digest: str,
        version: int,
        data: bytes,
        base_version: int | None = None,
    ) -> int:
        """One whole chunk at once (`begin_chunk` + feed + `finish_chunk`)."""
        receiver = self.begin_chunk(sync_id, chunk_index, digest, version, base_version)
        receiver.feed(data)
        return self.finish_chunk(receiver)

    def _start(self, sync_id: str, version: int, base_version: int | None) -> None:
        if base_version is not None and (
            base_version != self.engine.version or self._mirror_version != self.engine.version
        ):
            held = (
                f"serving version {self.engine.version}"
                if self._mirror_version == self.engine.version
                else f"serving version {self.engine.version} without a staged copy of it (it came from disk or a failed sync)"
            )
            raise DeltaBaseError(
                f"delta sync {sync_id} against base version {base_version} refused: the server holds {held}; "
                "send a full sync"
            )
        self._sync_id = sync_id
        self._target_version = version
        self._base_version = base_version
        self._next_index = 0
        self._mirror_version = -1  # the buffers are about to change
        self._staged = StagedWeights(
            self.engine.weight_specs(), self._buffers, delta=base_version is not None
        )

    def _check_chunk(self, chunk_index: int, version: int, base_version: int | None) -> None:
        if version != self._target_version:
            raise WeightSyncError(f"target version {version} differs from this sync's {self._target_version}")
        if base_version != self._base_version:
            raise WeightSyncError(
                f"base version {base_version} differs from this sync's {self._base_version}"
            )
        if version <= self.engine.version:
            raise WeightSyncError(
                f"target version {version} is not above the serving version {self.engine.version}"
            )
        if self._active is not None:
            raise WeightSyncError(f"chunk {chunk_index} began before chunk {self._next_index - 1} ended")
        if chunk_index != self._next_index:
            raise WeightSyncError(f"chunk index {chunk_index} out of order (expected {self._next_index})")

    def commit(self, sync_id: str, version: int, num_chunks: int) -> SyncResponse:
        with self._lock:
            if self._receiving is not None:
                raise WeightSyncError(f"sync {sync_id}: a collective sync ends with group/finish, not commit")
            return self._commit(sync_id, version, num_chunks)

    def _commit(self, sync_id: str, version: int, num_chunks: int) -> SyncResponse:
        """Commit `sync_id` (the lock held): every chunk and tensor arrived, then apply."""
        if sync_id != self._sync_id or self._staged is None:
            raise WeightSyncError(
                f"unknown weight sync {sync_id!r} (never started, aborted or superseded); "
                f"still serving version {self.engine.version}"
            )
        staged = self._staged
        try:
            if version != self._target_version:
                raise WeightSyncError(
                    f"commit version {version} differs from the chunks' {self._target_version}"
                )
            if num_chunks != self._next_index or self._active is not None:
                done = self._next_index - (self._active is not None)
                raise WeightSyncError(f"commit says {num_chunks} chunks, {done} arrived")
            if self._base_version is not None and self._base_version != self.engine.version:
                raise DeltaBaseError(
                    f"delta against base version {self._base_version}, but version {self.engine.version} "
                    "is serving now; send a full sync"
                )
            staged.check_complete()
        except WeightSyncError as exc:
            self._fail(str(exc))
            raise type(exc)(f"{exc}; still serving version {self.engine.version}") from None
        self._clear()
        response = self._apply(staged.tensors, version, staged.num_bytes)
        self._mirror_version = version
        return response

    def abort(self, sync_id: str) -> bool:
        """Drop the staging of `sync_id`; False when it is not the sync in progress."""
        with self._lock:
            if sync_id != self._sync_id:
                return False
            self._fail("aborted by the client")
            return True

    # --- collective (transport: collective) -------------------------------------------------------

    def group_init(self, info: GroupInfo) -> None:
        """Join the learner's weight group, replacing any earlier one (blocks until it formed)."""
        with self._lock:
            if self._receiving is not None:
                self._fail("a new weight group replaces the one this sync was receiving from")
            self._group = None
        group = WeightGroup(info)  # outside the lock: it waits for the learner and every other server
        with self._lock:
            self._group = group
        log.info(
            "joined weight group %s:%d as rank %d of %d",
            info.master_address,
            info.master_port,
            info.rank,
            info.world_size,
        )

    def group_start(
        self, sync_id: str, version: int, tensors: Sequence[tuple[str, str, tuple[int, ...]]]
    ) -> None:
        """Check the announced tensors (names, dtypes, shapes, every tensor once) before any byte moves,
        then receive their broadcasts into the staging on a thread of their own; `group_finish` applies."""
        with self._lock:
            if self._group is None:
                raise NoGroupError(
                    "no weight group on this server (it restarted, or a failed sync dropped it): the learner "
                    "re-initialises it with POST /update_weights/group/init/"
                )
            if self._sync_id is not None:
                log.warning("weight sync %s superseded by %s before its commit", self._sync_id, sync_id)
                self._fail("superseded")
            if version <= self.engine.version:
                raise WeightSyncError(
                    f"target version {version} is not above the serving version {self.engine.version}"
                )
            self._start(sync_id, version, None)
            assert self._staged is not None
            try:
                destinations = []
                for name, dtype, shape in tensors:
                    self._staged.reserve(name, None, dtype, tuple(shape))
                    destinations.append(self._staged.buffers[name])
                self._staged.check_complete()
            except WeightSyncError as exc:
                self._fail(str(exc))
                raise WeightSyncError(
                    f"{exc}; sync {sync_id} refused before any byte moved, still serving version {self.engine.version}"
                ) from None
            receiving = _Receiving(sync_id, self._group, destinations)
            self._receiving = receiving
        receiving.thread.start()

    def group_finish(self, sync_id: str, version: int) -> SyncResponse:
        """Wait for the broadcasts of `sync_id` to land, then check and apply as a commit does."""
        with self._lock:
            receiving = self._receiving
            if receiving is None or receiving.sync_id != sync_id:
                raise WeightSyncError(
                    f"unknown collective sync {sync_id!r} (never started, aborted or superseded); "
                    f"still serving version {self.engine.version}"
                )
        receiving.thread.join(receiving.group.info.timeout_s + 5.0)
        with self._lock:
            if self._receiving is not receiving:
                raise WeightSyncError(
                    f"collective sync {sync_id!r} was aborted while it received; still serving version {self.engine.version}"
                )
            error = receiving.error or ("still receiving" if receiving.thread.is_alive() else None)
            if error is not None:
                self._fail(error)
                raise WeightSyncError(
                    f"collective sync {sync_id}: {error}; the weight group is dropped (the learner "
                    f"re-initialises it), still serving version {self.engine.version}"
                )
            self._receiving = None
            return self._commit(sync_id, version, 0)

    # --- snapshots -------------------------------------------------------------------------------

    def load_from_disk(self, raw_path: str, version: int) -> SyncResponse:
        """Full sync from a safetensors snapshot under one of the weight directories."""
        path = resolve_under_roots(raw_path, self.weight_dirs, what="weights", roots_key="--weights-dir")
        with self._lock:
            try:
                if version <= self.engine.version:
                    raise WeightSyncError(
                        f"target version {version} is not above the serving version {self.engine.version}"
                    )
                if path.suffix != ".safetensors" or not path.is_file():
                    raise WeightSyncError(f"weights {raw_path!r}: not an existing .safetensors file")
                try:
                    tensors = load_file(str(path))
                except (SafetensorError, OSError) as exc:
                    raise WeightSyncError(f"weights {raw_path!r}: cannot load ({exc})") from None
                num_bytes = verify_full(self.engine.weight_specs(), tensors)
            except WeightSyncError as exc:
                self.num_failed_syncs += 1
                raise WeightSyncError(f"{exc}; still serving version {self.engine.version}") from None
            self._mirror_version = -1  # the staging buffers no longer hold the serving weights
            return self._apply(tensors, version, num_bytes)

    def _apply(self, tensors: dict[str, torch.Tensor], version: int, num_bytes: int) -> SyncResponse:
        start = time.perf_counter()
        self.engine.apply_weights(tensors, version)
        apply_s = time.perf_counter() - start
        self.num_syncs += 1
        log.info(
            "weights version %d applied: %d tensors, %d bytes, %.3f s",
            version,
            len(tensors),
            num_bytes,
            apply_s,
        )
        return SyncResponse(version=version, num_tensors=len(tensors), num_bytes=num_bytes, apply_s=apply_s)

    def _fail(self, reason: str) -> None:
        log.warning("weight sync %s failed: %s", self._sync_id, reason)
        self.num_failed_syncs += 1
        if self._active is not None:  # a chunk may still be streaming into the buffers: give them up
            self._buffers = {}
        if self._receiving is not None:
            # its broadcasts cannot be cancelled: they may still write into the buffers, and the group is
            # left mid-collective, so drop both (the learner re-initialises the group after a failure)
            self._buffers = {}
            self._group = None
            self._receiving = None
        self._clear()

    def _clear(self) -> None:
        self._sync_id = None
        self._staged = None
        self._active = None
        self._base_version = None
        self._next_index = 0
        self._target_version = -1


class _Receiving:
    """The broadcasts of one collective sync, received into staging buffers on a daemon thread."""

    def __init__(self, sync_id: str, group: WeightGroup, destinations: list[torch.Tensor]) -> None:
        self.sync_id = sync_id
        self.group = group
        self.error: str | None = None
        self.thread = threading.Thread(
            target=self._run, args=(destinations,), name=f"weight-group-{sync_id[:8]}", daemon=True
        )

    def _run(self, destinations: list[torch.Tensor]) -> None:
        try:
            for tensor in destinations:
                self.group.broadcast(tensor)
        except GroupError as exc:
            self.error = str(exc)
