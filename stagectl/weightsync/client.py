"""`WeightSyncClient`: the learner's (rank 0's) weight sync to every rollout server.

`push_weights(state, version)` hands the state dict (or a `TensorStream`) to the configured transport's
sender (`weightsync.factory`); a failure aborts the sync everywhere and raises `WeightPushError`, every
server still serving its previous version. `versions()` reads what every server serves. The token (when
given) goes on every request; `https://` servers are verified against the system's trust store or
`tls_ca_file`, and only left unverified with `tls_skip_verify`.

Inference is `inference.client.RolloutClient`; the two share no connection, so a prefetcher thread may run
rollouts while the main thread pushes weights.
"""

from __future__ import annotations

import logging
import ssl
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from stagectl.config.plan import ServerRollouts
from stagectl.config.rollout import CollectiveSync, DiskSync, HttpSync
from stagectl.weightsync.base import PushReport, Servers, Transport
from stagectl.weightsync.factory import build_sender
from stagectl.weightsync.http import HttpSender
from stagectl.weightsync.wire import WeightState
from stagectl.wire.errors import RolloutRequestError
from stagectl.wire.http import server_version
from stagectl.wire.protocol import VersionResponse, read_token
from stagectl.wire.tls import client_context

log = logging.getLogger("stagectl.weightsync.client")
MIB = 1024 * 1024


class WeightSyncClient:
    def __init__(
        self,
        base_urls: Sequence[str],
        *,
        transport: Transport = "http",
        timeout_s: float = 120.0,
        read_timeout_s: float | None = 600.0,
        auth_token: str | None = None,
        chunk_bytes: int = 64 * MIB,
        disk_dir: str | Path | None = None,
        connect_timeout_s: float = 10.0,
        delta: bool = False,
        group_address: str = "127.0.0.1",
        tls_ca_file: Path | None = None,
        tls_skip_verify: bool = False,
    ) -> None:
        if not base_urls:
            raise ValueError("WeightSyncClient needs at least one server base URL")
        urls = [url.rstrip("/") for url in base_urls]
        tls: ssl.SSLContext | None = None  # for https:// servers (and their weight-stream ports)
        if any(url.startswith("https://") for url in urls):
            tls = client_context(tls_ca_file, skip_verify=tls_skip_verify)
        read = read_timeout_s if read_timeout_s is not None and read_timeout_s > 0 else None
        timeout = httpx.Timeout(connect_timeout_s, read=read, write=read, pool=None)
        headers = {"Authorization": f"Bearer {auth_token}"} if auth_token else {}
        self.base_urls = urls
        self.transport: Transport = transport
        self.chunk_bytes = chunk_bytes
        self.disk_dir = Path(disk_dir) if disk_dir is not None else None
        self.servers = Servers(urls, headers, timeout, tls, timeout_s=timeout_s)
        try:
            self.sender = build_sender(
                transport,
                self.servers,
                chunk_bytes=chunk_bytes,
                delta=delta,
                disk_dir=self.disk_dir,
                group_address=group_address,
            )
        except ValueError:
            self.servers.close()
            raise
        self.num_pushes = 0
        self.last_push: PushReport | None = None

    @classmethod
    def for_rollouts(cls, rollouts: ServerRollouts) -> WeightSyncClient:
        """The weight sync to `rollouts.servers` over `rollouts.sync`'s transport (a disk sync's directory
        is resolved by the plan: `vllm.sync.disk_dir`, default `{output_dir}/weight_sync`)."""
        servers, sync = rollouts.servers, rollouts.sync
        own: dict[str, Any] = {}  # the keys of the configured transport's section (each has only its own)
        if isinstance(sync, HttpSync):
            own = {"chunk_bytes": int(sync.chunk_mb * MIB), "delta": sync.delta}
        elif isinstance(sync, CollectiveSync):
            own = {"group_address": sync.group_address}
        elif isinstance(sync, DiskSync):
            own = {"disk_dir": sync.disk_dir}
        return cls(
            servers.base_urls,
            transport=sync.transport,
            timeout_s=servers.wait_healthy_s,
            read_timeout_s=servers.infer_timeout_s,
            auth_token=read_token(servers.auth_token_env, servers.token_key),
            tls_ca_file=servers.tls_ca_file,
            tls_skip_verify=servers.tls_skip_verify,
            **own,
        )

    def versions(self) -> list[VersionResponse]:
        """Every active server's weight version (a server without `/version/` is refused: see
        `server_version`)."""
        return [server_version(self.servers.clients[k], self.base_urls[k]) for k in self.servers.active]

    def probe(self) -> list[VersionResponse | str]:
        """Every server's `/version/`, or the error of a call that failed (`learner.channel_b.health`)."""
        out: list[VersionResponse | str] = []
        for http, url in zip(self.servers.clients, self.base_urls, strict=True):
            try:
                out.append(server_version(http, url))
            except (httpx.HTTPError, RolloutRequestError, ValueError) as exc:
                out.append(f"{type(exc).__name__}: {exc}")
        return out

    def use_servers(self, indices: Sequence[int]) -> None:
        """Push to these servers only (a down one is left out until it is back). An empty list keeps the
        last servers (their pushes fail, counted, until one is back). The `collective` transport's weight
        group holds every server: it keeps pushing to all."""
        if indices and self.transport != "collective":
            self.servers.active = sorted(indices)

    def forget_delta_base(self) -> None:
        """The next push is a full one: a restarted server no longer holds the base a delta needs."""
        if isinstance(self.sender, HttpSender):
            self.sender.forget_base()

    def keeps_delta_base(self) -> bool:
        """True when a push keeps a host copy of the whole state dict for delta sync (http with delta)."""
        return self.sender.keeps_delta_base()

    def counters(self) -> dict[str, int]:
        """Cumulative counts for metrics: pushes, and the delta syncs a server refused (sent in full)."""
        fallbacks = self.sender.delta_fallbacks if isinstance(self.sender, HttpSender) else 0
        return {"pushes": self.num_pushes, "delta_fallbacks": fallbacks}

    def push_weights(
        self, state_dict: WeightState, version: int, *, base_version: int | None = None
    ) -> PushReport:
        """Sync `state_dict` (every tensor the servers' models have, same names/shapes/dtypes) to every
        server as `version`; raises `WeightPushError` (old weights keep serving) on failure.

        A `TensorStream` (the learner's FSDP shards gathered a tensor at a time) is sent as it arrives by
        every transport, holding a chunk (http) or a tensor (collective, disk) at a time. The one
        exception is a delta sync, which compares whole tensors against its host copy of the last push:
        it collects the stream into a dict first. A push that fails part-way leaves the rest of the
        stream untaken; the caller drains it (its tensors may be collectives other ranks wait in).
        `base_version`: the version the servers serve (what a delta is computed against)."""
        start = time.perf_counter()
        sent = self.sender.push(state_dict, version, base_version)
        report = PushReport(
            version,
            self.transport,
            sent.num_bytes,
            sent.num_chunks,
            time.perf_counter() - start,
            state_bytes=sent.state_bytes,
            delta=sent.delta,
        )
        self.num_pushes += 1
        self.last_push = report
        log.info(
            "weights version %d pushed over %s%s: %.1f MB of %.1f MB in %.2f s",
            version,
            self.transport,
            " (delta)" if sent.delta else "",
            sent.num_bytes / 1e6,
            sent.state_bytes / 1e6,
            report.seconds,
        )
        return report

    def close(self) -> None:
        self.sender.close()
        self.servers.close()

    def __enter__(self) -> WeightSyncClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
