"""Transport `disk`: `DiskSender` writes one safetensors snapshot under `disk_dir` (a directory every server
can read, e.g. a shared filesystem) and each server loads it by path (`DiskReceiver.load_from_disk`, under
the server's `weight_dirs`; a full state, applied at once, so it leaves the staging no mirror to build a
delta on). With `disk_dir` on a tmpfs (e.g. `/dev/shm/stagectl`) the snapshot stays in
memory: one copy that every server on the node loads (what the removed `shm` transport was for).

Snapshot files: `weights_v<version>.safetensors`, written as `.tmp` and renamed, removed when the push ends
however it ends. A learner killed mid-push (SIGKILL) cannot clean up: the next sender built on that
`disk_dir` removes every `weights_v*.safetensors` / `weights_v*.tmp` left there (`remove_leftovers`), so
one learner owns its `disk_dir`."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import xxhash
from safetensors import SafetensorError
from safetensors.torch import load_file

from stagectl.weightsync.base import Sent, Servers, Transport, check_versions, state_bytes
from stagectl.weightsync.errors import WeightSyncError
from stagectl.weightsync.protocol import SyncResponse
from stagectl.weightsync.receiver import WeightSync
from stagectl.weightsync.staging import verify_full
from stagectl.weightsync.wire import TensorStream, WeightState, byte_view, encode_chunks, safetensors_prefix
from stagectl.wire.paths import resolve_under_roots


def write_snapshot(path: Path, state: WeightState) -> tuple[str, int]:
    """Write `state` as one safetensors file (created exclusively, mode 0600); returns (XXH3-128 digest
    of the file, tensor bytes). A `TensorStream` is written a tensor at a time as it arrives (its header
    comes from its specs), so no more than one of its tensors is held here."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f:
        if isinstance(state, TensorStream):
            prefix = safetensors_prefix(state.specs.items(), {})
            digest = xxhash.xxh3_128(prefix)
            f.write(prefix)
            for _, tensor in state.checked():
                view = byte_view(tensor)
                digest.update(view)
                f.write(view)
                del tensor, view
            return digest.hexdigest(), state.num_bytes
        (chunk,) = encode_chunks(state, 2**62)
        for part in chunk.parts(64 << 20):
            f.write(part)
    return chunk.digest, chunk.num_bytes - len(chunk.header)


def remove_leftovers(disk_dir: Path) -> list[Path]:
    """Remove the snapshots (and half-written `.tmp`s) a killed push left in `disk_dir`; returns them."""
    if not disk_dir.is_dir():
        return []
    removed = [*disk_dir.glob("weights_v*.safetensors"), *disk_dir.glob("weights_v*.tmp")]
    for path in removed:
        path.unlink(missing_ok=True)
    return removed


class DiskSender:
    transport: Transport = "disk"

    def __init__(self, servers: Servers, disk_dir: Path | None) -> None:
        self.servers = servers
        self.disk_dir = disk_dir
        if disk_dir is not None:
            remove_leftovers(disk_dir)  # snapshots of a learner killed before it could clean up

    def keeps_delta_base(self) -> bool:
        return False

    def push(self, state: WeightState, version: int, base_version: int | None) -> Sent:
        if self.disk_dir is None:
            raise ValueError("disk weight sync needs custom.extra.rollout_matching.vllm.sync.disk_dir")
        total = state_bytes(state)
        self.disk_dir.mkdir(parents=True, exist_ok=True)
        path = (self.disk_dir / f"weights_v{version}.safetensors").absolute()
        tmp = path.with_suffix(".tmp")
        tmp.unlink(missing_ok=True)  # a crashed push's leftover
        _, num_bytes = write_snapshot(tmp, state)
        os.replace(tmp, path)  # servers never see a half-written snapshot
        try:
            body = {"path": str(path), "version": version}
            responses = self.servers.on_every(
                lambda k: self.servers.post(k, "/update_weights/from_disk/", json=body)
            )
            check_versions(responses, version)
        finally:
            path.unlink(missing_ok=True)
        return Sent(num_bytes, 1, total)

    def close(self) -> None:
        pass


class DiskReceiver:
    """Transport `disk`, the server's side: a full sync from a safetensors snapshot under one of the
    server's weight directories, verified against the serving model and applied under the sync lock."""

    def __init__(self, sync: WeightSync, weight_dirs: Sequence[Path]) -> None:
        self.sync = sync
        self.weight_dirs = list(weight_dirs)

    def load_from_disk(self, raw_path: str, version: int) -> SyncResponse:
        path = resolve_under_roots(raw_path, self.weight_dirs, what="weights", roots_key="--weights-dir")
        sync = self.sync
        with sync.lock:
            try:
                sync.check_above_serving(version)
                if path.suffix != ".safetensors" or not _is_file(path):
                    raise WeightSyncError(f"weights {raw_path[:200]!r}: not an existing .safetensors file")
                try:
                    tensors = load_file(str(path))
                except (SafetensorError, OSError) as exc:
                    raise WeightSyncError(f"weights {raw_path!r}: cannot load ({exc})") from None
                num_bytes = verify_full(sync.engine.weight_specs(), tensors)
            except WeightSyncError as exc:
                sync.num_failed_syncs += 1
                raise WeightSyncError(f"{exc}; still serving version {sync.engine.version}") from None
            return sync.apply_snapshot(tensors, version, num_bytes)


def _is_file(path: Path) -> bool:
    """`path.is_file()`, False where the system cannot even look (a name too long, no permission): that
    OSError escaped as a 500 with a traceback."""
    try:
        return path.is_file()
    except OSError:
        return False
