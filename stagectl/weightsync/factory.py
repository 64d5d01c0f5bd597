"""The one place a transport name becomes a sender (learner side) or a receiver (server side)."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import get_args

from stagectl.weightsync.base import Servers, Transport, WeightSender
from stagectl.weightsync.collective import CollectiveSender, GroupReceiver
from stagectl.weightsync.disk import DiskReceiver, DiskSender
from stagectl.weightsync.http import HttpReceiver, HttpSender
from stagectl.weightsync.receiver import WeightSync

BUILT: tuple[str, ...] = get_args(Transport)  # the transports this package has a sender and a receiver for


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
    raise ValueError(f"weight sync transport {transport!r} is not built (one of: {', '.join(BUILT)})")


@dataclass(frozen=True)
class Receivers:
    """A server's receivers: one per transport it accepts, None for the others (whose routes the app
    does not mount)."""

    http: HttpReceiver | None
    collective: GroupReceiver | None
    disk: DiskReceiver | None


def build_receivers(sync: WeightSync, transports: Collection[str], weight_dirs: Sequence[Path]) -> Receivers:
    """The receivers of `transports`, all filling the one staging of `sync`."""
    unknown = sorted(set(transports) - set(BUILT))
    if unknown:
        raise ValueError(f"weight sync transport(s) {unknown} are not built ({', '.join(BUILT)})")
    return Receivers(
        http=HttpReceiver(sync) if "http" in transports else None,
        collective=GroupReceiver(sync) if "collective" in transports else None,
        disk=DiskReceiver(sync, weight_dirs) if "disk" in transports else None,
    )
