"""The whole-call deadline (`wire.deadline`): a peer trickling a byte every 0.1 s never trips a per-read
timeout, so only a bound on the whole call ends it; nested deadlines keep the earlier; a socket read by
code that is not ours (`http.client`) is cut at the deadline too."""

from __future__ import annotations

import contextlib
import http.client
import socket
import time
from collections.abc import Callable
from typing import ClassVar
from urllib.parse import urlsplit

import httpx
import pytest

from stagectl.config.plan import ServerList
from stagectl.wire import deadline
from stagectl.wire.deadline import CallDeadlineError, DeadlineClient, bound, socket_deadline, within
from stagectl.wire.http import not_answering
from tests.helpers import loopback_peer, returns_within, trickle_server


def _get_within(client: httpx.Client, url: str, total_s: float) -> httpx.Response:
    with within(total_s):  # a deadline is the calling thread's: set where the call runs
        return client.get(url)


HEADS = [b"HTTP/1.1 200 OK\r\n", b"HTTP/1.1 200 OK\r\nContent-Length: 99\r\n\r\n"]  # in the headers, the body


def test_nested_deadlines_keep_the_earlier_and_none_adds_none() -> None:
    assert bound(7.0) == 7.0 and bound(None) is None  # no deadline: the timeout as given
    with within(10.0):
        assert bound(None) is not None and 9.0 < bound(None) <= 10.0  # type: ignore[operator]
        with within(0.5):
            assert bound(7.0) <= 0.5  # type: ignore[operator]
            with within(30.0), within(None):
                assert bound(7.0) <= 0.5  # type: ignore[operator]
        assert bound(7.0) == 7.0
    with within(0.0), pytest.raises(TimeoutError, match="no whole answer within 0 s"):
        time.sleep(0.01)
        bound(1.0)


@pytest.mark.parametrize("head", HEADS)
def test_a_trickled_answer_ends_at_the_clients_deadline(head: bytes) -> None:
    with trickle_server(every_s=0.1, head=head) as url, DeadlineClient(total_s=0.5, timeout=2.0) as client:
        with pytest.raises(
            CallDeadlineError, match=r"GET .*/health/: no whole answer within 0\.5 s"
        ) as raised:
            returns_within(2.0, lambda: client.get(f"{url}/health/"))
        assert isinstance(raised.value, httpx.TimeoutException)  # every `except httpx.HTTPError` still holds
        with pytest.raises(CallDeadlineError, match=r"within 0\.3 s"):  # an enclosing one, earlier
            returns_within(2.0, lambda: _get_within(client, f"{url}/health/", 0.3))


def test_a_client_without_a_total_still_ends_inside_within() -> None:
    with (
        trickle_server(every_s=0.1) as url,
        DeadlineClient(total_s=None, timeout=2.0) as client,
        pytest.raises(CallDeadlineError, match=r"within 0\.4 s"),
    ):
        returns_within(2.0, lambda: _get_within(client, f"{url}/version/", 0.4))


def test_an_answer_in_time_is_read_whole() -> None:
    head = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
    with trickle_server(every_s=0.1, head=head) as url, DeadlineClient(total_s=1.0, timeout=2.0) as client:
        response, _ = returns_within(2.0, lambda: client.get(f"{url}/health/"))
    assert response.status_code == 200 and response.text == "ok"


@pytest.mark.parametrize("head", HEADS)
def test_a_socket_read_by_http_client_is_cut_at_the_deadline(head: bytes) -> None:
    with trickle_server(every_s=0.1, head=head) as url:
        parts = urlsplit(url)
        connection = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=2.0)

        def exchange() -> bytes:
            with within(0.5):
                connection.connect()
                assert connection.sock is not None
                with socket_deadline(connection.sock):
                    connection.request("GET", "/")
                    return connection.getresponse().read()

        with pytest.raises(TimeoutError, match=r"no whole answer within 0\.5 s"):
            returns_within(2.0, exchange)
        connection.close()


def test_socket_deadline_without_a_deadline_changes_nothing() -> None:
    left, right = socket.socketpair()
    with left, right, socket_deadline(left):
        right.sendall(b"x")
        assert left.recv(1) == b"x"


def test_train_abs_look_at_the_servers_health_ends_on_a_trickling_server() -> None:
    """train-ab's one `/health/` look before the model loads (`not_answering`) hung on such a server."""
    with trickle_server(every_s=0.1) as url:
        (down,), seconds = returns_within(
            2.0, lambda: not_answering(ServerList(base_urls=(url,)), timeout_s=0.5)
        )
    assert down.startswith(f"{url} (CallDeadlineError: ") and "no whole answer within 0.5 s" in down
    assert seconds < 1.5


class _LateTimer:
    """A `threading.Timer` whose thread had passed its wait when the block ended: `cancel` comes too late
    to stop it, and it runs after `socket_deadline` has checked whether it fired."""

    made: ClassVar[list[_LateTimer]] = []

    def __init__(self, interval: float, function: Callable[[], None]) -> None:
        self.function = function
        self.daemon = False
        _LateTimer.made.append(self)

    def start(self) -> None:
        pass

    def cancel(self) -> None:
        pass


def test_a_deadline_reached_as_the_block_ends_leaves_the_socket_to_its_next_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A block that ended in time keeps its socket: the weight stream reuses it for the next chunk, which
    failed (`unreachable`) when the timer, firing just as the block ended, shut it down afterwards."""
    _LateTimer.made.clear()
    monkeypatch.setattr(deadline.threading, "Timer", _LateTimer)
    left, right = socket.socketpair()
    with left, right:
        with within(5.0), socket_deadline(left):
            right.sendall(b"x")
            assert left.recv(1) == b"x"
        (late,) = _LateTimer.made
        late.function()  # the timer's thread goes on now
        left.sendall(b"y")  # the next call on the reused connection
        assert right.recv(1) == b"y"


def test_a_call_an_aborted_client_starts_afterwards_ends_at_once() -> None:
    """`abort` (a `RolloutClient` closing) shut only the connections open then: a call that opened a new one
    afterwards (the split of a chunk that failed twice) waited out the whole deadline on a trickling server,
    and the owner's close waited with it."""
    with trickle_server(every_s=0.1) as url, DeadlineClient(total_s=3.0, timeout=1.0) as client:
        client.abort()
        with pytest.raises(httpx.TransportError, match="aborted"):
            returns_within(1.0, lambda: client.get(url))


def _answer_once_then_listen(peer: socket.socket) -> None:
    """Answer the connection's first request, then read on without a word: a kept connection a load
    balancer or NAT dropped while idle (no FIN reaches the client)."""
    with contextlib.suppress(OSError):
        peer.recv(1 << 16)
        peer.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        while peer.recv(1 << 16):
            pass


def test_a_connection_idle_past_httpxs_keepalive_expiry_is_not_reused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """httpx's own pool drops a connection idle for 5 s and opens a new one; the pool DeadlineClient put in
    its place (httpcore's defaults) kept them forever, so after a long idle the next call (an `/infer/`
    between training steps) went into a connection a middlebox had dropped and waited out its deadline."""
    import httpcore._sync.http11 as http11

    skew = [0.0]

    class _Clock:
        @staticmethod
        def monotonic() -> float:
            return time.monotonic() + skew[0]

    monkeypatch.setattr(http11, "time", _Clock)
    with loopback_peer(_answer_once_then_listen) as url, DeadlineClient(total_s=1.5, timeout=5.0) as client:
        assert client.get(url).text == "ok"
        skew[0] = 10.0  # idle for 10 s
        response, _ = returns_within(3.0, lambda: client.get(url))
    assert response.text == "ok"
