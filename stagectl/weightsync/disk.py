"""Transport `disk`: `DiskSender` writes one safetensors snapshot under `disk_dir` (a directory every server
can read, e.g. a shared filesystem) and each server loads it by path (`WeightSync.load_from_disk`, under
the server's `weight_dirs`)."""

from __future__ import annotations

import os
from pathlib import Path

from stagectl.weightsync.base import Sent, Servers, Transport, check_versions, state_bytes
from stagectl.weightsync.shm import write_snapshot
from stagectl.weightsync.wire import WeightState


class DiskSender:
    transport: Transport = "disk"

    def __init__(self, servers: Servers, disk_dir: Path | None) -> None:
        self.servers = servers
        self.disk_dir = disk_dir

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
