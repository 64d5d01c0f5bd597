"""The whole-call deadline of every outbound HTTP call (the one guard, STYLE #11).

httpx's (and a socket's) timeouts bound each read and each write, not a call: a peer that accepts the
connection and trickles one byte every few seconds keeps a call alive forever under any read timeout.
`within(total_s)` puts a deadline on everything the calling thread sends and reads inside it; a
`DeadlineClient` (an `httpx.Client`) applies it to every request it sends, from the connect to the last
body byte, by bounding each socket operation by the time left (`bound`). A call that passes it raises
`CallDeadlineError`, an `httpx.TimeoutException`, so every `except httpx.TimeoutException` /
`httpx.HTTPError` keeps catching it. Deadlines nest: the earlier one holds.

Code that reads a plain socket itself (`http.client`, the weight stream's upload) runs inside
`socket_deadline(sock)`: at the deadline the socket is shut down, which ends a blocked read at once, and the
block raises `TimeoutError` naming the deadline.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import threading
import time
import weakref
from collections.abc import Iterable, Iterator
from contextvars import ContextVar
from typing import Any

import httpcore
import httpx

# (monotonic deadline, the total it was set from) of the current thread's call; None: no deadline
_DEADLINE: ContextVar[tuple[float, float] | None] = ContextVar("stagectl_call_deadline", default=None)


class CallDeadlineError(httpx.TimeoutException):
    """A call did not finish within its whole-call deadline (the peer may still be sending, slowly)."""


@contextlib.contextmanager
def within(total_s: float | None) -> Iterator[None]:
    """Every call the calling thread makes inside ends within `total_s` seconds (None: no deadline of
    its own; an enclosing one still holds)."""
    if total_s is None:
        yield
        return
    deadline = time.monotonic() + total_s
    outer = _DEADLINE.get()
    token = _DEADLINE.set(outer if outer is not None and outer[0] <= deadline else (deadline, total_s))
    try:
        yield
    finally:
        _DEADLINE.reset(token)


def bound(timeout_s: float | None) -> float | None:
    """`timeout_s` cut to the time left of the current deadline; `TimeoutError` once it has passed."""
    current = _DEADLINE.get()
    if current is None:
        return timeout_s
    left = current[0] - time.monotonic()
    if left <= 0:
        raise TimeoutError(f"no whole answer within {round(current[1], 2):g} s")
    return left if timeout_s is None else min(timeout_s, left)


def deadline_passed() -> float | None:
    """The total of the current deadline when it has passed (else None): a timeout then is the deadline's."""
    current = _DEADLINE.get()
    return current[1] if current is not None and time.monotonic() >= current[0] - 0.01 else None


@contextlib.contextmanager
def socket_deadline(sock: socket.socket) -> Iterator[None]:
    """The current deadline (of `within`) on what the block does with `sock` through code that is not ours:
    at the deadline `sock` is shut down (a blocked read or write returns at once) and the block raises
    `TimeoutError`, even when it ended well meanwhile (the connection is gone: the caller drops it)."""
    current = _DEADLINE.get()
    if current is None:
        yield
        return
    passed = threading.Event()
    over = False  # the block has ended: `sock` may already serve the next call (a kept connection)
    lock = threading.Lock()  # a timer that fires as the block ends cuts before `over`, or not at all

    def cut() -> None:
        with lock:
            if over:  # `cancel` came after the timer's wait: too late to stop its thread, not to stop it here
                return
            passed.set()
            with contextlib.suppress(OSError):  # already closed
                socket.socket.shutdown(sock, socket.SHUT_RDWR)  # the TCP socket under a TLS one too

    timer = threading.Timer(max(current[0] - time.monotonic(), 0.0), cut)
    timer.daemon = True
    timer.start()
    try:
        yield
    except Exception as exc:
        if passed.is_set():
            raise TimeoutError(f"no whole answer within {round(current[1], 2):g} s") from exc
        raise
    finally:
        with lock:
            over = True
        timer.cancel()
    if passed.is_set():
        raise TimeoutError(f"no whole answer within {round(current[1], 2):g} s")


class _Stream(httpcore.NetworkStream):
    def __init__(self, stream: httpcore.NetworkStream, backend: _Backend) -> None:
        self._stream = stream
        self._backend = backend  # a TLS stream made from this one is registered there too

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        try:
            return self._stream.read(max_bytes, bound(timeout))
        except TimeoutError as exc:
            raise httpcore.ReadTimeout(str(exc)) from None

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        try:
            self._stream.write(buffer, bound(timeout))
        except TimeoutError as exc:
            raise httpcore.WriteTimeout(str(exc)) from None

    def close(self) -> None:
        self._stream.close()

    def shut(self) -> None:
        """End a read or write blocked on this connection in another thread now (it raises there)."""
        sock = self._stream.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):  # already closed
                socket.socket.shutdown(sock, socket.SHUT_RDWR)

    def start_tls(
        self, ssl_context: ssl.SSLContext, server_hostname: str | None = None, timeout: float | None = None
    ) -> httpcore.NetworkStream:
        try:
            return self._backend.opened(self._stream.start_tls(ssl_context, server_hostname, bound(timeout)))
        except TimeoutError as exc:
            raise httpcore.ConnectTimeout(str(exc)) from None

    def get_extra_info(self, info: str) -> Any:
        return self._stream.get_extra_info(info)


class _Backend(httpcore.NetworkBackend):
    def __init__(self) -> None:
        self._backend = httpcore.SyncBackend()
        self._lock = threading.Lock()
        self._streams: weakref.WeakSet[_Stream] = weakref.WeakSet()  # every connection it opened, while alive
        self._aborted = False  # `shut_all` ran: a connection opened afterwards is closed at once

    def opened(self, stream: httpcore.NetworkStream) -> _Stream:
        opened = _Stream(stream, self)
        with self._lock:
            aborted = self._aborted
            if not aborted:
                self._streams.add(opened)
        if aborted:
            stream.close()
            raise httpcore.ConnectError("the client was aborted: it opens no new connection")
        return opened

    def shut_all(self) -> None:
        with self._lock:
            self._aborted = True
            streams = list(self._streams)
        for stream in streams:
            stream.shut()

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.NetworkStream:
        try:
            return self.opened(
                self._backend.connect_tcp(host, port, bound(timeout), local_address, socket_options)
            )
        except TimeoutError as exc:
            raise httpcore.ConnectTimeout(str(exc)) from None

    def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: Iterable[Any] | None = None
    ) -> httpcore.NetworkStream:
        try:
            return self.opened(self._backend.connect_unix_socket(path, bound(timeout), socket_options))
        except TimeoutError as exc:
            raise httpcore.ConnectTimeout(str(exc)) from None

    def sleep(self, seconds: float) -> None:
        self._backend.sleep(seconds)


# httpx's defaults (an idle connection closed after 5 s: one a load balancer or NAT dropped meanwhile
# without a word is not written into)
_LIMITS = httpx.Limits(max_connections=100, max_keepalive_connections=20, keepalive_expiry=5.0)


class _Transport(httpx.HTTPTransport):
    """httpx's own transport over a connection pool whose sockets honour the deadline (httpx has no
    setting for the network backend, so the pool it built is replaced by the same pool with ours)."""

    def __init__(self, verify: ssl.SSLContext | bool) -> None:
        context = httpx.create_ssl_context(verify=verify)
        super().__init__(verify=context, limits=_LIMITS)
        self.backend = _Backend()
        self._pool = httpcore.ConnectionPool(  # httpx's limits: httpcore's own keep idle connections forever
            ssl_context=context,
            max_connections=_LIMITS.max_connections,
            max_keepalive_connections=_LIMITS.max_keepalive_connections,
            keepalive_expiry=_LIMITS.keepalive_expiry,
            network_backend=self.backend,
        )


class DeadlineClient(httpx.Client):
    """An `httpx.Client` whose every request ends within `total_s` (None: only the per-read `timeout`),
    or within an enclosing `within`, whichever ends first. Proxies from the environment are not used:
    rollout servers are reached directly."""

    def __init__(self, *, total_s: float | None, verify: ssl.SSLContext | bool = True, **kwargs: Any) -> None:
        self._deadline_transport = _Transport(verify)
        super().__init__(transport=self._deadline_transport, **kwargs)
        self.total_s = total_s

    def abort(self) -> None:
        """End every call in flight now, from any thread: their connections are shut down, so a read
        blocked on a slow or trickling server returns at once and its call raises (an owner that is
        stopping, after a Ctrl-C, then does not wait out the deadline). A call made afterwards fails at once
        too (no new connection is opened): the client is done."""
        self._deadline_transport.backend.shut_all()

    def send(self, request: httpx.Request, **kwargs: Any) -> httpx.Response:
        with within(self.total_s):
            try:
                return super().send(request, **kwargs)
            except httpx.TimeoutException as exc:
                total = deadline_passed()
                if total is None:
                    raise
                raise CallDeadlineError(
                    f"{request.method} {request.url}: no whole answer within {round(total, 2):g} s",
                    request=request,
                ) from exc
