"""The weight-stream listener: `POST /update_weights/` (the same chunk endpoint, query and answers as the
app's) on a port of its own, served by blocking threads that read each chunk's body straight from the
socket into a reused buffer and feed it to the staging through the app's own `http.HttpReceiver` (one copy
and one XXH3 pass per byte).

Why a second listener: on the app's port a chunk's bytes go through uvicorn's pure-Python HTTP parser and
the event loop in pieces of at most 256 KiB, which held `http` sync far below what a plain loopback
socket carries (BENCHMARKS.md, "Weight sync"). Here the body is read with `readinto1` (one socket read
of up to 8 MiB at a time, each under the body deadline); the request line and headers still go through the
standard library's HTTP parser.

Guards, the app's own (`wire.guards`): the bearer token (`check_token`, 401), the chunk-size limit and
the deadline for the whole body (`BodyBudget`: 413, 408), the query model (`protocol.ChunkQuery`, 422);
and for this port alone a per-read socket timeout and a cap on open connections (503 beyond it). With
`rollout_server.tls_certfile` the listening socket is wrapped with `ssl`; each connection's handshake runs
on its own thread under the read timeout, so a client that never finishes it holds no other connection. The server advertises the
port in `/version/` (`weight_stream_port`); `rollout_server.weight_stream_port: null` turns it off, and the
client then sends chunks to the app's port as before.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import ssl
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import parse_qs, urlsplit

from pydantic import ValidationError

from stagectl.weightsync.errors import WeightSyncError, status_of
from stagectl.weightsync.http import HttpReceiver
from stagectl.weightsync.protocol import WEIGHT_CHUNK_PATH, ChunkQuery
from stagectl.weightsync.staging import ChunkReceiver
from stagectl.wire.guards import (
    BodyBudget,
    BodyTimeout,
    BodyTooLarge,
    Unauthorized,
    check_token,
    validation_detail,
)
from stagectl.wire.tls import server_context

access_log = logging.getLogger("stagectl.rollout.access")
log = logging.getLogger(__name__)
PIECE_BYTES = 8 << 20  # the most one socket read takes
HEADER_READ = 64 << 10  # reads while a chunk's safetensors header arrives (then tensors are read in place)
READ_TIMEOUT_S = 10.0  # one read of the request line, a header or a piece of the body
MAX_CONNECTIONS = 32  # open connections at once (a learner opens one per rank pushing; 503 beyond)
_BUSY_BODY = json.dumps({"detail": f"more than {MAX_CONNECTIONS} weight-stream connections"}).encode()
_BUSY = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
    + f"Content-Length: {len(_BUSY_BODY)}\r\n\r\n".encode()
    + _BUSY_BODY
)


class StreamSettings(Protocol):
    """What the port reads of the server's settings (`server.service.ServerSettings` has them all)."""

    @property
    def auth_token(self) -> str | None: ...
    @property
    def max_weight_chunk_bytes(self) -> int: ...
    @property
    def body_timeout_s(self) -> float: ...
    @property
    def tls_certfile(self) -> Path | None: ...
    @property
    def tls_keyfile(self) -> Path | None: ...


class _Refused(Exception):
    """An answer other than 200: `status`, `detail`, and whether the connection must close."""

    def __init__(self, status: int, detail: str, *, close: bool = False) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail
        self.close = close


def _query(raw: str) -> ChunkQuery:
    """The chunk's query, checked by the app's own model (`ChunkQuery`: 422 naming the field)."""
    values = {k: v[-1] for k, v in parse_qs(raw, keep_blank_values=True).items()}
    try:
        return ChunkQuery.model_validate(values)
    except ValidationError as exc:
        raise _Refused(422, validation_detail(exc.errors())[0]) from None


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: one connection carries every chunk of a sync
    timeout = READ_TIMEOUT_S
    # the answer's head and body are two small writes: with Nagle on, the body waits for the client's
    # delayed ACK of the head (40 ms a chunk on Linux: 0.6 s of a 1 GB sync in 64 MiB chunks)
    disable_nagle_algorithm = True
    server: WeightStreamServer
    _buffer: memoryview | None = None  # this connection's read buffer, made at its first body

    def do_POST(self) -> None:
        start = time.perf_counter()
        try:
            status, body = 200, self._chunk()
        except _Refused as exc:
            status, body = exc.status, {"detail": exc.detail}
            if exc.close:
                self.close_connection = True
        except Exception as exc:  # a bug: answer 500, keep serving, say what happened
            log.exception("weight-stream request failed")
            status, body = 500, {"detail": f"internal error: {type(exc).__name__}: {exc}"}
            self.close_connection = True
        self._access(status, start)
        self._answer(status, body)

    def do_GET(self) -> None:
        self.close_connection = True
        self._answer(405, {"detail": "this port takes POST /update_weights/ only"})

    def _chunk(self) -> dict[str, Any]:
        url = urlsplit(self.path)
        if url.path != WEIGHT_CHUNK_PATH:
            self.close_connection = True
            raise _Refused(404, f"not found: {url.path} (this port takes POST {WEIGHT_CHUNK_PATH} only)")
        try:
            check_token(self.headers.get("Authorization"), self.server.settings.auth_token)
        except Unauthorized as exc:
            raise _Refused(401, str(exc), close=True) from None
        budget = BodyBudget(self.server.settings.max_weight_chunk_bytes, self.server.settings.body_timeout_s)
        length = self._content_length(budget)
        try:
            query = _query(url.query)
        except _Refused:
            self._drain(length, budget)
            raise
        http = self.server.http
        try:
            receiver = http.begin_chunk(
                query.sync_id, query.chunk_index, query.digest, query.version, query.base_version
            )
        except WeightSyncError as exc:
            # Refused before the body (e.g. a delta against another base: 409). Drain it, so the answer
            # goes out on a connection the client can keep using.
            self._drain(length, budget)
            raise _Refused(status_of(exc), str(exc)) from None
        self._receive(receiver, length, budget)
        try:
            num = http.finish_chunk(receiver)
        except WeightSyncError as exc:
            raise _Refused(status_of(exc), str(exc)) from None
        return {"sync_id": query.sync_id, "chunk_index": query.chunk_index, "num_tensors": num}

    def _content_length(self, budget: BodyBudget) -> int:
        if self.headers.get("Transfer-Encoding"):
            raise _Refused(
                411, "a weight chunk needs Content-Length (chunked bodies are not taken)", close=True
            )
        text = (self.headers.get("Content-Length") or "").strip()
        if not text.isdigit():
            raise _Refused(411, "a weight chunk needs Content-Length", close=True)
        length = int(text)
        try:
            budget.declared(length)
        except BodyTooLarge as exc:
            raise _Refused(413, str(exc), close=True) from None
        return length

    def _read_body(self, length: int, receiver: ChunkReceiver | None, budget: BodyBudget) -> None:
        """Read `length` body bytes within the body deadline: straight into the staging where the receiver
        says where they go (`destination`), else through this connection's buffer into `feed` (the
        header, an errored chunk) or nowhere (`receiver` None: draining a refused body)."""
        remaining = length
        try:
            while remaining:
                try:
                    left_s = budget.remaining_s()
                except BodyTimeout as exc:
                    raise _Refused(408, str(exc), close=True) from None
                # one socket read at a time (`readinto1`), under whichever ends first of the read timeout and
                # the body deadline: `readinto` would loop on a trickling client until its target is full
                self.connection.settimeout(min(READ_TIMEOUT_S, left_s))
                target = receiver.destination() if receiver is not None else None
                direct = target is not None
                if target is None:
                    if self._buffer is None:
                        self._buffer = memoryview(bytearray(PIECE_BYTES))
                    # the header comes in small reads, so the tensors that follow it are read in place
                    in_header = receiver is not None and receiver.error is None
                    target = self._buffer[:HEADER_READ] if in_header else self._buffer
                target = target[: min(remaining, PIECE_BYTES)]
                try:
                    n = self.rfile.readinto1(target)  # type: ignore[attr-defined]
                except TimeoutError:
                    if left_s < READ_TIMEOUT_S:
                        raise _Refused(408, str(budget.expired()), close=True) from None
                    raise _Refused(408, f"no body bytes for {READ_TIMEOUT_S:g} s", close=True) from None
                except OSError as exc:
                    raise _Refused(400, f"connection failed mid-body: {exc}", close=True) from None
                if not n:
                    raise _Refused(
                        400, f"body ended after {length - remaining} of {length} bytes", close=True
                    )
                remaining -= n
                if receiver is None:
                    continue
                if direct:
                    receiver.received(n)
                else:
                    receiver.feed(target[:n])
        finally:  # the next request of a kept-alive connection gets the full read timeout again
            self.connection.settimeout(READ_TIMEOUT_S)

    def _drain(self, length: int, budget: BodyBudget) -> None:
        self._read_body(length, None, budget)

    def _receive(self, receiver: ChunkReceiver, length: int, budget: BodyBudget) -> None:
        finished = False
        try:
            self._read_body(length, receiver, budget)
            finished = True
        finally:
            if not finished:
                self.server.http.fail_chunk(receiver, "the chunk's body did not arrive whole")

    def _answer(self, status: int, body: dict[str, Any]) -> None:
        payload = json.dumps(body).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(payload)
        except OSError:  # the client went away; nothing to tell it
            self.close_connection = True

    def _access(self, status: int, start: float) -> None:
        entry = {
            "ts": round(time.time(), 3),
            "event": "access",
            "method": self.command,
            "path": urlsplit(self.path).path,
            "status": status,
            "ms": round((time.perf_counter() - start) * 1000, 2),
            "client": f"{self.client_address[0]}:{self.client_address[1]}",
            "port": "weight-stream",
        }
        access_log.info(json.dumps(entry))

    def log_message(self, format: str, *args: Any) -> None:
        pass  # one JSON access line per request instead (`_access`); parse errors are answered in HTTP

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        # the standard library's parse errors (bad request line, too many headers): JSON like every answer
        self.close_connection = True
        self._answer(code, {"detail": message or HTTPStatus(code).phrase})


class WeightStreamServer(ThreadingHTTPServer):
    """The weight-stream listener on `host:port` (0: a free port); `start()` serves on a daemon thread,
    `stop()` closes it. Each connection has its own thread and, while it reads a body, its own buffer."""

    daemon_threads = True
    block_on_close = False

    def __init__(
        self, http: HttpReceiver, settings: StreamSettings, host: str = "127.0.0.1", port: int = 0
    ) -> None:
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        context = None
        if settings.tls_certfile is not None and settings.tls_keyfile is not None:
            context = server_context(settings.tls_certfile, settings.tls_keyfile)  # before binding anything
        try:
            super().__init__((host, port), _Handler)
        except OSError as exc:
            raise ValueError(f"cannot bind the weight-stream port {host}:{port}: {exc.strerror}") from None
        self.http = http  # the chunks go to the http receiver the app's port shares
        self.settings = settings
        if context is not None:
            self.socket = context.wrap_socket(self.socket, server_side=True, do_handshake_on_connect=False)
        self.port: int = self.server_address[1]
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._thread = threading.Thread(target=self.serve_forever, name="weight-stream", daemon=True)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            if not isinstance(request, ssl.SSLSocket):  # no handshake on the accepting thread: just close
                with contextlib.suppress(OSError):
                    request.sendall(_BUSY)
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            if isinstance(request, ssl.SSLSocket):
                request.settimeout(READ_TIMEOUT_S)
                try:
                    request.do_handshake()
                except (OSError, ssl.SSLError) as exc:  # not TLS, a certificate it refused, or too slow
                    log.info("weight-stream TLS handshake with %s failed: %s", client_address[0], exc)
                    self.shutdown_request(request)
                    return
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def start(self) -> WeightStreamServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread.is_alive():
            self.shutdown()
        self.server_close()
