"""The one place a transport name becomes a sender."""

from __future__ import annotations

from pathlib import Path

from stagectl.weightsync.base import Servers, Transport, WeightSender
from stagectl.weightsync.collective import CollectiveSender
from stagectl.weightsync.disk import DiskSender
from stagectl.weightsync.http import HttpSender


def build_sender(
    transport: Transport,
    servers: Servers,
    *,
    chunk_bytes: int = 64 * 1024 * 1024,
    delta: bool = False,
    disk_dir: Path | None = None,
    group_address: str = "127.0.0.1",
) -> WeightSender:
    if transport == "http":
        return HttpSender(servers, chunk_bytes, delta=delta)
    if transport == "collective":
        return CollectiveSender(servers, group_address)
    if transport == "disk":
        return DiskSender(servers, disk_dir)
    raise ValueError(f"weight sync transport {transport!r} is not built (one of: http, collective, disk)")
