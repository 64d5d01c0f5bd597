"""The server side of a full weight sync: one staging area, verified chunk by chunk, swapped on commit.

Protocol (one sync at a time): chunks `0, 1, 2, ...` of a `sync_id` arrive with their sha256 and the
target version; each is checked (checksum, names, shapes, dtypes) and staged. `commit` checks that
every chunk and every tensor arrived, then hands the tensors to `engine.apply_weights`, which swaps
them under the generation lock. Any failure discards the staging and leaves the serving weights and
version untouched. A chunk with a new `sync_id` supersedes an unfinished sync (its client died).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from safetensors import SafetensorError
from safetensors.torch import load_file

from stagectl.rollout.engine import Engine
from stagectl.rollout.paths import resolve_under_roots
from stagectl.rollout.protocol import SyncResponse
from stagectl.rollout.weights import StagedWeights, WeightSyncError, decode_chunk, sha256_hex, verify_full

log = logging.getLogger("stagectl.rollout.sync")


class WeightSync:
    def __init__(self, engine: Engine, weight_dirs: Sequence[Path]) -> None:
        self.engine = engine
        self.weight_dirs = list(weight_dirs)
        self._lock = threading.Lock()  # one staging operation at a time
        self._sync_id: str | None = None
        self._target_version = -1
        self._next_index = 0
        self._staged: StagedWeights | None = None
        self.num_syncs = 0
        self.num_failed_syncs = 0

    def add_chunk(self, sync_id: str, chunk_index: int, sha256: str, version: int, data: bytes) -> int:
        """Verify and stage one chunk; returns the number of tensors in it."""
        with self._lock:
            if sync_id != self._sync_id:
                if self._sync_id is not None:
                    log.warning("weight sync %s superseded by %s before its commit", self._sync_id, sync_id)
                self._start(sync_id, version)
            try:
                return self._add(chunk_index, sha256, version, data)
            except WeightSyncError as exc:
                self._fail(f"chunk {chunk_index}: {exc}")
                raise WeightSyncError(
                    f"{exc}; sync {sync_id} aborted, still serving version {self.engine.version}"
                ) from None

    def _start(self, sync_id: str, version: int) -> None:
        self._sync_id = sync_id
        self._target_version = version
        self._next_index = 0
        self._staged = StagedWeights(self.engine.weight_specs())

    def _add(self, chunk_index: int, sha256: str, version: int, data: bytes) -> int:
        assert self._staged is not None
        if version != self._target_version:
            raise WeightSyncError(f"target version {version} differs from this sync's {self._target_version}")
        if version <= self.engine.version:
            raise WeightSyncError(
                f"target version {version} is not above the serving version {self.engine.version}"
            )
        if chunk_index != self._next_index:
            raise WeightSyncError(f"chunk index {chunk_index} out of order (expected {self._next_index})")
        actual = sha256_hex(data)
        if actual != sha256.lower():
            raise WeightSyncError(f"sha256 mismatch (header {sha256}, body {actual})")
        pieces = decode_chunk(data)
        for piece in pieces:
            self._staged.add(piece)
        self._next_index += 1
        return len(pieces)

    def commit(self, sync_id: str, version: int, num_chunks: int) -> SyncResponse:
        with self._lock:
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
                if num_chunks != self._next_index:
                    raise WeightSyncError(f"commit says {num_chunks} chunks, {self._next_index} arrived")
                staged.check_complete()
            except WeightSyncError as exc:
                self._fail(str(exc))
                raise WeightSyncError(f"{exc}; still serving version {self.engine.version}") from None
            self._clear()
            return self._apply(staged.tensors, version, staged.num_bytes)

    def abort(self, sync_id: str) -> bool:
        """Drop the staging of `sync_id`; False when it is not the sync in progress."""
        with self._lock:
            if sync_id != self._sync_id:
                return False
            self._fail("aborted by the client")
            return True

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
            return self._apply(tensors, version, num_bytes)

    def _apply(self, tensors: dict, version: int, num_bytes: int) -> SyncResponse:
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
        self._clear()

    def _clear(self) -> None:
        self._sync_id = None
        self._staged = None
        self._next_index = 0
        self._target_version = -1
