"""The learner's side of the weight-stream port: `POST /update_weights/` chunks over one keep-alive
connection per server, the tensors' memory handed to `socket.sendall` as whole views.

Why not httpx here: its HTTP/1.1 layer (h11) joins every body piece into a new bytes object before the
write (one more copy of every byte, in Python); `http.client` writes the request head and then `sendall`s
each view with no copy in Python (the side-by-side figures: CHANGELOG.md, the weight-stream port entry).
"""

from __future__ import annotations

import http.client
import json
import socket
import ssl
import threading
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlencode, urlsplit

from stagectl.rollout.errors import DeltaRefused, WeightPushError
from stagectl.rollout.weights import WeightChunk


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
            body = response.read()
            if response.will_close:
                self._drop(key, origin)
        except (OSError, http.client.HTTPException) as exc:
            self._drop(key, origin)
            raise WeightPushError(f"{url}: {type(exc).__name__}: {exc}", unreachable=True) from exc
        detail = _detail(body)
        if response.status == 409:
            raise DeltaRefused(f"{url}: HTTP 409: {detail}")
        if response.status != 200:
            raise WeightPushError(f"{url}: HTTP {response.status}: {detail}")
        try:
            return json.loads(body)
        except ValueError:
            raise WeightPushError(f"{url}: answered a body that is not JSON: {body[:200]!r}") from None

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
