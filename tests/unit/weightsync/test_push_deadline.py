"""A weight push to a server that accepts the connection and trickles its answer (a byte every 0.1 s: no
per-read timeout ever fires) fails at the push's whole-call bound, on the app port (`Servers`, httpx) and
on the weight-stream port (`ChunkSender`, `http.client`); both hung forever."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
import torch

from stagectl.weightsync.client import WeightSyncClient
from stagectl.weightsync.errors import WeightPushError
from stagectl.weightsync.http import ChunkSender
from stagectl.weightsync.wire import encode_chunks
from tests.helpers import returns_within, trickle_server

HEADS = [b"HTTP/1.1 200 OK\r\n", b"HTTP/1.1 200 OK\r\nContent-Length: 99\r\n\r\n"]  # in the headers, the body


@pytest.mark.parametrize("head", HEADS)
def test_a_push_to_a_trickling_server_fails_at_the_read_timeout(head: bytes) -> None:
    state = {"w": torch.zeros(4)}
    refused = r"/version/: CallDeadlineError: .*no whole answer within 0\.5 s"
    with trickle_server(every_s=0.1, head=head) as url:
        client = WeightSyncClient([url], read_timeout_s=0.5)
        with pytest.raises(WeightPushError, match=refused):
            returns_within(3.0, lambda: client.push_weights(state, 1))
    client.close()  # after the server is gone: a call it still held has ended


@pytest.mark.parametrize("head", HEADS)
def test_a_chunk_to_a_trickling_weight_stream_port_fails_at_its_timeout(head: bytes) -> None:
    (chunk,) = encode_chunks({"w": torch.zeros(4)}, 1 << 20)
    with (
        trickle_server(every_s=0.1, head=head) as url,
        ChunkSender({}, 0.5) as sender,
        pytest.raises(WeightPushError, match=r"TimeoutError: no whole answer within 0\.5 s") as raised,
    ):
        returns_within(3.0, lambda: sender.post(0, f"{url}/update_weights/chunk/", {"sync_id": "s"}, chunk))
    assert raised.value.unreachable


def _in_thread(call: Callable[[], object]) -> tuple[threading.Thread, list[BaseException]]:
    raised: list[BaseException] = []

    def run() -> None:
        try:
            call()
        except BaseException as exc:  # handed to the test thread
            raised.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    time.sleep(0.5)  # the call is in flight, reading a byte every 0.1 s
    return thread, raised


def test_close_ends_a_push_still_waiting_on_trickling_servers() -> None:
    """Closing the client (what a second Ctrl-C runs on its way out) ends the calls its threads still wait
    in at once, instead of waiting out the 30 s timeout (600 s by default), and the push fails."""
    state = {"w": torch.zeros(4)}
    with trickle_server(every_s=0.1) as first, trickle_server(every_s=0.1) as second:
        client = WeightSyncClient([first, second], read_timeout_s=30.0)
        pushing, raised = _in_thread(lambda: client.push_weights(state, 1))
        _, seconds = returns_within(3.0, client.close)
        pushing.join(3.0)
    assert seconds < 2.0
    assert len(raised) == 1 and isinstance(raised[0], WeightPushError), raised


def test_closing_a_chunk_sender_ends_an_upload_still_waiting_for_its_answer() -> None:
    (chunk,) = encode_chunks({"w": torch.zeros(4)}, 1 << 20)
    with trickle_server(every_s=0.1) as url:
        sender = ChunkSender({}, 30.0)
        posting, raised = _in_thread(
            lambda: sender.post(0, f"{url}/update_weights/chunk/", {"sync_id": "s"}, chunk)
        )
        _, seconds = returns_within(3.0, sender.close)
        posting.join(3.0)
        assert not posting.is_alive(), "the upload still waits for its answer"
    assert seconds < 2.0
    assert len(raised) == 1 and isinstance(raised[0], WeightPushError), raised
