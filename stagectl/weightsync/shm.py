"""Transport `shm` (learner and servers on one node): `ShmSender` writes one snapshot that every server maps
(`WeightSync.load_from_shm` on the server side reads it).

Snapshot files: safetensors snapshots in `/dev/shm` named `stagectl-<owner pid>-<sync id>.safetensors`.

The learner writes one (`write_snapshot`, the tensors' own bytes, no serialisation copy) and removes it
when the push ends however it ends; the server removes it once read. A process killed with SIGKILL
cannot clean up, so every client and server start removes the snapshots whose owner pid is no longer
alive (`remove_stale`). A recycled pid keeps a stale file until the next start after that process dies.
"""

from __future__ import annotations

import logging
import os
import re
import uuid
from pathlib import Path

import xxhash

from stagectl.weightsync.base import Sent, Servers, Transport, check_versions, state_bytes
from stagectl.weightsync.wire import TensorStream, WeightState, byte_view, encode_chunks, safetensors_prefix

log = logging.getLogger("stagectl.weightsync.shm")
SHM_DIR = Path("/dev/shm")
_NAME = re.compile(r"^stagectl-(\d{1,10})-([0-9a-f]{1,64})\.safetensors$")


def shm_path(sync_id: str, shm_dir: Path = SHM_DIR) -> Path:
    return shm_dir / f"stagectl-{os.getpid()}-{sync_id}.safetensors"


def parse_shm_name(name: str) -> int | None:
    """The owner pid of a snapshot name, or None when `name` is not one."""
    match = _NAME.match(name)
    return int(match.group(1)) if match else None


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def remove_stale(shm_dir: Path = SHM_DIR) -> list[Path]:
    """Remove the snapshots of dead owners; returns what was removed."""
    removed: list[Path] = []
    if not shm_dir.is_dir():
        return removed
    for path in shm_dir.glob("stagectl-*.safetensors"):
        pid = parse_shm_name(path.name)
        if pid is not None and not pid_alive(pid):
            path.unlink(missing_ok=True)
            removed.append(path)
    if removed:
        log.warning("removed %d stale weight snapshot(s) of dead processes from %s", len(removed), shm_dir)
    return removed


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


class ShmSender:
    """One snapshot in shared memory, mapped by every server (all on this node); removed here whatever
    happens (a SIGKILL leaves it to the next start's `remove_stale`)."""

    transport: Transport = "shm"

    def __init__(self, servers: Servers, shm_dir: Path = SHM_DIR) -> None:
        if not shm_dir.is_dir():
            raise ValueError(f"weight sync transport shm needs {shm_dir} (a tmpfs); use http or disk here")
        remove_stale(shm_dir)  # snapshots of learners killed before they could clean up
        self.servers = servers
        self.shm_dir = shm_dir

    def keeps_delta_base(self) -> bool:
        return False

    def push(self, state: WeightState, version: int, base_version: int | None) -> Sent:
        path = shm_path(uuid.uuid4().hex, self.shm_dir)
        total = state_bytes(state)
        try:
            digest, num_bytes = write_snapshot(path, state)
            body = {"path": str(path), "version": version, "digest": digest}
            responses = self.servers.on_every(
                lambda k: self.servers.post(k, "/update_weights/from_shm/", json=body)
            )
            check_versions(responses, version)
        finally:
            path.unlink(missing_ok=True)
        return Sent(num_bytes, 1, total)

    def close(self) -> None:
        pass
