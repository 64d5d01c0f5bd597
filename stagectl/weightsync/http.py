"""Transport `http`. The learner's side: `HttpSender` streams safetensors chunks (zero-copy views of the
tensors, XXH3-128 per chunk) to every server and commits only after every server staged every chunk,
sending only the changed elements when delta sync is on (`weightsync.delta`). The server's side:
`HttpReceiver`, fed by the weight-stream port (`weightsync.stream`) or the app's `POST /update_weights/`,
streams each chunk into the shared staging (`weightsync.receiver.WeightSync`) and commits.

Protocol (one sync at a time): chunks `0, 1, 2, ...` of a `sync_id` arrive with their XXH3-128 digest and
the target version (and, for a delta, the base version); each is streamed into the staging
(`staging.ChunkReceiver`: header checked against names, shapes and dtypes before any byte is copied,
digest compared at its end). `commit` checks that every chunk arrived, then the shared commit applies.
A chunk with a new `sync_id` supersedes an unfinished sync (its client died).

`ChunkSender`: `POST /update_weights/` chunks to the weight-stream port over one keep-alive connection per
server, the tensors' memory handed to `socket.sendall` as whole views.

Why not httpx here: its HTTP/1.1 layer (h11) joins every body piece into a new bytes object before the
write (one more copy of every byte, in Python); `http.client` writes the request head and then `sendall`s
each view with no copy in Python (the side-by-side figures: CHANGELOG.md, the weight-stream port entry).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import socket
import ssl
import threading
import uuid
from collections.abc import Iterator, Mapping
from functools import partial
from typing import Any
from urllib.parse import urlencode, urlsplit

import httpx

from stagectl.weightsync.base import Sent, Servers, Transport, check_versions, state_bytes
from stagectl.weightsync.delta import DeltaTracker
from stagectl.weightsync.errors import DeltaRefused, NotInGroup, WeightPushError, WeightSyncError
from stagectl.weightsync.protocol import WEIGHT_CHUNK_PATH, SyncResponse
from stagectl.weightsync.receiver import WeightSync
from stagectl.weightsync.staging import ChunkReceiver
from stagectl.weightsync.wire import TensorStream, WeightChunk, WeightState, encode_chunks, encode_pieces
from stagectl.wire.deadline import socket_deadline, within
from stagectl.wire.protocol import VersionResponse

log = logging.getLogger("stagectl.weightsync.http")


class HttpSender:
    """Transport `http`. With `delta` on and `base_version` equal to the version of this sender's last
    successful push, only the changed elements are sent (see `weightsync.delta`); a server that refuses the
    base (`DeltaRefused`, HTTP 409) gets a full sync instead (counted in `delta_fallbacks`)."""

    transport: Transport = "http"

    def __init__(self, servers: Servers, chunk_bytes: int, *, delta: bool = False) -> None:
        self.servers = servers
        self.chunk_bytes = chunk_bytes
        self._delta = DeltaTracker() if delta else None
        self.delta_fallbacks = 0

    def keeps_delta_base(self) -> bool:
        return self._delta is not None

    def forget_base(self) -> None:
        """Send the next push in full (the servers no longer hold the last one)."""
        if self._delta is not None:
            self._delta.reset()

    def push(self, state: WeightState, version: int, base_version: int | None) -> Sent:
        if self._delta is None:
            num_bytes, num_chunks = self._send(encode_chunks(state, self.chunk_bytes), version, None)
            return Sent(num_bytes, num_chunks, state_bytes(state))
        # a delta compares whole tensors against its host copy of the last push: collect a stream first
        whole = dict(state.checked()) if isinstance(state, TensorStream) else state
        plan = None
        try:
            sent = None
            if base_version is not None and self._delta.ver == base_version:
                plan = self._delta.plan(whole, self.chunk_bytes)
                try:
                    sent = self._send(encode_pieces(plan.pieces, self.chunk_bytes), version, base_version)
                except DeltaRefused as exc:
                    plan = None
                    self.delta_fallbacks += 1
                    log.warning("delta sync refused (%s); sending a full sync", exc)
            if sent is None:
                sent = self._send(encode_chunks(whole, self.chunk_bytes), version, None)
        except WeightPushError:
            self._delta.reset()
            raise
        self._delta.pushed(version, whole, plan)
        total = plan.total_bytes if plan is not None else state_bytes(whole)
        return Sent(sent[0], sent[1], total, delta=plan is not None)

    def _send(self, chunks: Iterator[WeightChunk], version: int, base_version: int | None) -> tuple[int, int]:
        """Stream `chunks` to every server and commit. Pipeline: the next chunk's header and digest are
        prepared on a pool thread while the current one is on the wire, and each server checks, hashes
        and stages a chunk as its bytes arrive. The bytes go from the tensors' memory to the socket (one
        copy in the HTTP stack). Returns (bytes sent, chunks)."""
        servers = self.servers
        sync_id = uuid.uuid4().hex
        num_bytes = num_chunks = 0
        sender = ChunkSender(servers.headers, servers.timeout.read, servers.tls)
        try:
            chunk_urls = dict(zip(servers.active, servers.on_every(self._chunk_url), strict=True))
            upcoming = servers.pool.submit(next, chunks, None)
            while (chunk := upcoming.result()) is not None:
                upcoming = servers.pool.submit(next, chunks, None)
                params: dict[str, Any] = {
                    "sync_id": sync_id,
                    "chunk_index": chunk.index,
                    "digest": chunk.digest,
                    "version": version,
                }
                if base_version is not None:
                    params["base_version"] = base_version
                servers.on_every(
                    partial(self._post_chunk, urls=chunk_urls, params=params, chunk=chunk, sender=sender)
                )
                num_bytes += chunk.num_bytes
                num_chunks += 1
            commit = {"sync_id": sync_id, "version": version, "num_chunks": num_chunks}
            responses = servers.on_every(lambda k: servers.post(k, "/update_weights/commit/", json=commit))
        except WeightPushError:
            servers.on_every(lambda k: servers.abort(k, sync_id))
            raise
        finally:
            sender.close()
        check_versions(responses, version)
        return num_bytes, num_chunks

    def _chunk_url(self, k: int) -> tuple[str, bool]:
        """Where server `k` takes weight chunks: its weight-stream port when it advertises one (asked at
        every sync: a restarted server has a new one), else its app port; and whether it is the former."""
        base_url = self.servers.base_urls[k]
        try:
            port = VersionResponse.model_validate(self.servers.get(k, "/version/")).weight_stream_port
        except ValueError as exc:  # a bad body
            raise WeightPushError(f"{base_url}/version/: {exc}") from exc
        if port is None:
            return f"{base_url}{WEIGHT_CHUNK_PATH}", False
        return str(httpx.URL(base_url).copy_with(port=port).join(WEIGHT_CHUNK_PATH)), True

    def _post_chunk(
        self,
        k: int,
        *,
        urls: Mapping[int, tuple[str, bool]],
        params: dict[str, Any],
        chunk: WeightChunk,
        sender: ChunkSender,
    ) -> Any:
        url, streamed = urls[k]
        if streamed:
            return sender.post(k, url, params, chunk)
        headers = {"Content-Type": "application/octet-stream", "Content-Length": str(chunk.num_bytes)}
        return self.servers.post_url(url, k, params=params, content=chunk.parts(), headers=headers)

    def close(self) -> None:
        pass


class ChunkSender:
    """One sync's uploads (a fresh connection per server per sync: the server closes idle ones)."""

    def __init__(
        self, headers: Mapping[str, str], timeout_s: float | None, tls: ssl.SSLContext | None = None
    ) -> None:
        self.headers = dict(headers)
        self.timeout_s = timeout_s
        self.tls = tls  # https:// URLs: TLS with this context (the client's verification settings)
        self._connections: dict[tuple[int, str], http.client.HTTPConnection] = {}
        self._lock = threading.Lock()  # guards the dict; each connection is used by one thread at a time

    def post(self, key: int, url: str, params: Mapping[str, Any], chunk: WeightChunk) -> Any:
        """Send `chunk` to `url` (server `key`'s weight-stream endpoint) and return the JSON answer;
        `DeltaRefused` on 409, `WeightPushError` otherwise (`unreachable` when the connection failed)."""
        parts = urlsplit(url)
        origin = f"{parts.hostname}:{parts.port}"
        target = f"{parts.path}?{urlencode(params)}"
        https = parts.scheme == "https"
        if https and self.tls is None:
            raise WeightPushError(f"{url}: an https:// weight-stream URL needs the client's TLS settings")
        connection = self._connection(
            key, origin, parts.hostname or "", parts.port or (443 if https else 80), https
        )
        try:
            with within(self.timeout_s):  # the whole upload and its answer: a trickling peer cannot hold it
                if connection.sock is None:
                    connection.connect()
                assert connection.sock is not None
                with socket_deadline(connection.sock):
                    body, response = self._exchange(connection, target, chunk)
            if response.will_close:
                self._drop(key, origin)
        except (OSError, http.client.HTTPException) as exc:
            self._drop(key, origin)
            raise WeightPushError(f"{url}: {type(exc).__name__}: {exc}", unreachable=True) from exc
        detail = _detail(body)
        if response.status == 409:
            raise DeltaRefused(f"{url}: HTTP 409: {detail}")
        if response.status == 412:
            raise NotInGroup(f"{url}: HTTP 412: {detail}")
        if response.status != 200:
            raise WeightPushError(f"{url}: HTTP {response.status}: {detail}")
        try:
            return json.loads(body)
        except ValueError:
            raise WeightPushError(f"{url}: answered a body that is not JSON: {body[:200]!r}") from None

    def _exchange(
        self, connection: http.client.HTTPConnection, target: str, chunk: WeightChunk
    ) -> tuple[bytes, http.client.HTTPResponse]:
        """Send one chunk on `connection` and read the whole answer."""
        connection.putrequest("POST", target, skip_accept_encoding=True)
        for name, value in self.headers.items():
            connection.putheader(name, value)
        connection.putheader("Content-Type", "application/octet-stream")
        connection.putheader("Content-Length", str(chunk.num_bytes))
        connection.endheaders()
        sock = connection.sock
        assert sock is not None
        try:
            sock.sendall(chunk.header)
            for view in chunk.views:
                sock.sendall(view)
        except OSError:
            # the server may have refused the chunk before reading its body (413, 401) and closed
            # the connection: its answer is still there to read, and it says more than a broken pipe
            pass
        response = connection.getresponse()
        return response.read(), response

    def _connection(
        self, key: int, origin: str, host: str, port: int, https: bool
    ) -> http.client.HTTPConnection:
        with self._lock:
            connection = self._connections.get((key, origin))
            if connection is None:
                if https:
                    connection = _NoDelayTLSConnection(host, port, timeout=self.timeout_s, context=self.tls)
                else:
                    connection = _NoDelayConnection(host, port, timeout=self.timeout_s)
                self._connections[(key, origin)] = connection
            return connection

    def _drop(self, key: int, origin: str) -> None:
        with self._lock:
            connection = self._connections.pop((key, origin), None)
        if connection is not None:
            connection.close()

    def __enter__(self) -> ChunkSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
            connections, self._connections = list(self._connections.values()), {}
        for connection in connections:
            if connection.sock is not None:  # an upload still waiting on its server (another thread) ends now
                with contextlib.suppress(OSError):
                    socket.socket.shutdown(connection.sock, socket.SHUT_RDWR)
            connection.close()


class _NoDelayConnection(http.client.HTTPConnection):
    """TCP_NODELAY: the request head goes out at once instead of waiting on the previous answer's ACK."""

    def connect(self) -> None:
        super().connect()
        assert self.sock is not None
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class _NoDelayTLSConnection(http.client.HTTPSConnection):
    """The same over TLS (the views still go to `sendall` whole; the ssl layer encrypts them)."""

    def connect(self) -> None:
        super().connect()
        assert self.sock is not None
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _detail(body: bytes) -> str:
    try:
        detail = json.loads(body).get("detail")
    except (ValueError, AttributeError):
        detail = None
    return str(detail) if detail is not None else body[:300].decode("utf-8", errors="replace")


class HttpReceiver:
    """Transport `http`, the server's side: the chunks of a sync streamed into the shared staging, then
    `commit`. One per server, shared by the app's port and the weight-stream port (the commit, on the
    app's port, counts the chunks either port received)."""

    def __init__(self, sync: WeightSync) -> None:
        self.sync = sync
        self._next_index = 0  # the chunk the http sync in progress expects next

    def begin_chunk(
        self, sync_id: str, chunk_index: int, digest: str, version: int, base_version: int | None = None
    ) -> ChunkReceiver:
        """Check and open chunk `chunk_index` of `sync_id`; feed it the body, then `finish_chunk`."""
        sync = self.sync
        with sync.lock:
            if sync_id != sync.sync_id:
                sync.supersede(sync_id)
                sync.start(sync_id, "http", version, base_version)
                self._next_index = 0
            try:
                self._check_chunk(chunk_index, version, base_version)
            except WeightSyncError as exc:
                sync.fail(f"chunk {chunk_index}: {exc}")
                raise type(exc)(
                    f"{exc}; sync {sync_id} aborted, still serving version {sync.engine.version}"
                ) from None
            assert sync.staged is not None
            self._next_index += 1
            receiver = ChunkReceiver(sync.staged, digest)
            sync.writer = receiver
            return receiver

    def finish_chunk(self, receiver: ChunkReceiver) -> int:
        """End a chunk begun by `begin_chunk`: the number of tensors in it, or `WeightSyncError`."""
        sync = self.sync
        with sync.lock:
            sync_id = sync.sync_id
            if receiver is not sync.writer:
                raise WeightSyncError(
                    f"chunk of a weight sync that was aborted or superseded; still serving version {sync.engine.version}"
                )
            sync.writer = None
            try:
                return receiver.finish()
            except WeightSyncError as exc:
                sync.fail(str(exc))
                raise WeightSyncError(
                    f"{exc}; sync {sync_id} aborted, still serving version {sync.engine.version}"
                ) from None

    def fail_chunk(self, receiver: ChunkReceiver, reason: str) -> None:
        """A chunk's body never arrived whole (the client went away): drop its sync."""
        with self.sync.lock:
            if receiver is self.sync.writer:
                self.sync.fail(reason)

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

    def _check_chunk(self, chunk_index: int, version: int, base_version: int | None) -> None:
        sync = self.sync
        if version != sync.target_version:
            raise WeightSyncError(f"target version {version} differs from this sync's {sync.target_version}")
        if base_version != sync.base_version:
            raise WeightSyncError(f"base version {base_version} differs from this sync's {sync.base_version}")
        sync.check_above_serving(version)
        if sync.writer is not None:
            raise WeightSyncError(f"chunk {chunk_index} began before chunk {self._next_index - 1} ended")
        if chunk_index != self._next_index:
            raise WeightSyncError(f"chunk index {chunk_index} out of order (expected {self._next_index})")

    def commit(self, sync_id: str, version: int, num_chunks: int) -> SyncResponse:
        sync = self.sync
        with sync.lock:
            if sync.transport is not None and sync.transport != "http":
                raise WeightSyncError(
                    f"sync {sync_id}: the sync in progress came on transport {sync.transport!r}, which ends it "
                    "itself (collective: group/finish), not with an http commit"
                )

            def every_chunk_arrived() -> None:
                if num_chunks != self._next_index or sync.writer is not None:
                    done = self._next_index - (sync.writer is not None)
                    raise WeightSyncError(f"commit says {num_chunks} chunks, {done} arrived")

            return sync.commit(sync_id, version, every_chunk_arrived)
