"""The weight-stream listener (`weightsync.stream`): the client's http sync goes through it, and it keeps every
guard of the app's chunk endpoint (token, size limit, checksum, body deadline, truncated bodies, bad query,
connection cap) with the old weights serving after any failure."""

from __future__ import annotations

import json
import logging
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
import torch

import stagectl.weightsync.stream as stream
from stagectl.engines.fake import FakeEngine, default_weights
from stagectl.server.app import build_app
from stagectl.server.service import RolloutService, ServerSettings
from stagectl.server.serving import ThreadedServer
from stagectl.weightsync.client import WeightSyncClient
from stagectl.weightsync.errors import WeightPushError
from stagectl.weightsync.wire import encode_chunks

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
KIB = 1024


@dataclass
class Served:
    url: str
    stream_url: str
    engine: FakeEngine


def _settings(**kwargs: object) -> ServerSettings:
    return ServerSettings(auth_token=TOKEN, max_weight_chunk_bytes=256 * KIB, **kwargs)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    engine = FakeEngine(default_weights(num_mib=1, block_mib=1))
    server = ThreadedServer(build_app(RolloutService(engine, _settings(body_timeout_s=2.0)))).start()
    port = httpx.get(f"{server.url}/version/", headers=AUTH).json()["weight_stream_port"]
    assert isinstance(port, int) and port > 0
    yield Served(server.url, f"http://127.0.0.1:{port}/update_weights/", engine)
    server.stop()


def _version(served: Served) -> int:
    return int(httpx.get(f"{served.url}/version/", headers=AUTH).json()["version"])


def _weights(served: Served, value: float) -> dict[str, torch.Tensor]:
    return {k: torch.full_like(v, value) for k, v in served.engine.weights.items()}


def _params(chunk_digest: str, version: int, sync_id: str = "s") -> dict[str, object]:
    return {"sync_id": sync_id, "chunk_index": 0, "digest": chunk_digest, "version": version}


def test_the_client_sends_chunks_to_the_stream_port(served: Served, caplog: pytest.LogCaptureFixture) -> None:
    before = _version(served)
    with (
        caplog.at_level(logging.INFO, logger="stagectl.rollout.access"),
        WeightSyncClient([served.url], auth_token=TOKEN, chunk_bytes=128 * KIB) as client,
    ):
        report = client.push_weights(_weights(served, 0.5), before + 1)
    assert _version(served) == before + 1
    assert torch.equal(served.engine.weights["block0"], torch.full((256, 1024), 0.5))
    entries = [json.loads(r.getMessage()) for r in caplog.records if r.name == "stagectl.rollout.access"]
    on_stream = [e for e in entries if e.get("port") == "weight-stream"]
    assert len(on_stream) == report.num_chunks > 1
    assert all(e["status"] == 200 and e["path"] == "/update_weights/" for e in on_stream)
    assert not [e for e in entries if e["path"] == "/update_weights/" and e.get("port") is None]


def test_a_server_without_the_stream_port_takes_chunks_on_its_app_port() -> None:
    engine = FakeEngine(default_weights(num_mib=1, block_mib=1))
    server = ThreadedServer(build_app(RolloutService(engine, _settings(weight_stream_port=None)))).start()
    try:
        assert httpx.get(f"{server.url}/version/", headers=AUTH).json()["weight_stream_port"] is None
        with WeightSyncClient([server.url], auth_token=TOKEN, chunk_bytes=128 * KIB) as client:
            client.push_weights({k: torch.full_like(v, 2.0) for k, v in engine.weights.items()}, 1)
        assert torch.equal(engine.weights["block0"], torch.full((256, 1024), 2.0))
    finally:
        server.stop()


@pytest.mark.parametrize(
    "headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {TOKEN}"}]
)
def test_the_stream_port_needs_the_token(served: Served, headers: dict[str, str]) -> None:
    response = httpx.post(served.stream_url, params=_params("0" * 32, 99), content=b"x", headers=headers)
    assert response.status_code == 401 and "bearer token" in response.json()["detail"]


def test_bad_checksum_keeps_the_old_weights(served: Served) -> None:
    before = _version(served)
    old = served.engine.weights["block0"].clone()
    (chunk, *_rest) = encode_chunks(_weights(served, 5.0), 128 * KIB)
    response = httpx.post(
        served.stream_url, params=_params("a" * 32, before + 1), content=chunk.data, headers=AUTH
    )
    assert response.status_code == 400 and "checksum mismatch" in response.json()["detail"]
    commit = {"sync_id": "s", "version": before + 1, "num_chunks": 1}
    assert httpx.post(f"{served.url}/update_weights/commit/", json=commit, headers=AUTH).status_code == 400
    assert _version(served) == before and torch.equal(served.engine.weights["block0"], old)


def test_the_same_connection_serves_the_next_chunk_after_a_refusal(served: Served) -> None:
    # a refused chunk's body is drained, so a keep-alive client can go on
    (chunk, *_rest) = encode_chunks(_weights(served, 5.0), 128 * KIB)
    with httpx.Client(headers=AUTH) as http:
        bad = http.post(served.stream_url, params=_params("a" * 32, 10**6, "x"), content=chunk.data)
        again = http.post(served.stream_url, params=_params(chunk.digest, 10**6, "y"), content=chunk.data)
    assert bad.status_code == 400 and again.status_code == 200


@pytest.mark.parametrize(
    ("query", "field"),
    [
        ({"chunk_index": 0, "digest": "0" * 32, "version": 1}, "sync_id"),
        ({"sync_id": "s", "chunk_index": -1, "digest": "0" * 32, "version": 1}, "chunk_index"),
        ({"sync_id": "s", "chunk_index": 0, "digest": "xyz", "version": 1}, "digest"),
        ({"sync_id": "s", "chunk_index": 0, "digest": "0" * 32}, "version"),
    ],
)
def test_a_bad_query_is_422_naming_the_field(served: Served, query: dict[str, object], field: str) -> None:
    response = httpx.post(served.stream_url, params=query, content=b"x" * 10, headers=AUTH)
    assert response.status_code == 422 and response.json()["detail"].startswith(field)


def test_a_chunk_above_the_limit_is_413(served: Served) -> None:
    response = httpx.post(
        served.stream_url, params=_params("0" * 32, 99), content=b"x" * (300 * KIB), headers=AUTH
    )
    assert response.status_code == 413 and "exceeds" in response.json()["detail"]


def test_other_paths_and_methods_are_refused(served: Served) -> None:
    base = served.stream_url.removesuffix("/update_weights/")
    assert httpx.post(f"{base}/update_weights/commit/", json={}, headers=AUTH).status_code == 404
    assert httpx.get(served.stream_url).status_code == 405


def _raw(served: Served, head: bytes) -> socket.socket:
    port = httpx.URL(served.stream_url).port
    assert port is not None
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(head)
    return sock


def _head(served: Served, length: int, digest: str, version: int, sync_id: str) -> bytes:
    query = f"sync_id={sync_id}&chunk_index=0&digest={digest}&version={version}"
    return (
        f"POST /update_weights/?{query} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
        f"Content-Length: {length}\r\n\r\n"
    ).encode()


def _answer(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_a_truncated_body_fails_the_sync_and_the_next_one_works(served: Served) -> None:
    before = _version(served)
    (chunk, *_rest) = encode_chunks(_weights(served, 7.0), 128 * KIB)
    with _raw(served, _head(served, chunk.num_bytes, chunk.digest, before + 1, "cut")) as sock:
        sock.sendall(bytes(chunk.data)[: chunk.num_bytes // 2])
        sock.shutdown(socket.SHUT_WR)  # the learner died half way
        assert b" 400 " in _answer(sock).split(b"\r\n")[0]
    assert _version(served) == before
    with WeightSyncClient([served.url], auth_token=TOKEN, chunk_bytes=128 * KIB) as client:
        client.push_weights(_weights(served, 3.0), before + 1)
    assert _version(served) == before + 1


def test_a_body_slower_than_its_deadline_is_408(served: Served) -> None:
    (chunk, *_rest) = encode_chunks(_weights(served, 7.0), 128 * KIB)
    with _raw(served, _head(served, chunk.num_bytes, chunk.digest, 10**6, "slow")) as sock:
        for _ in range(4):  # trickle a few bytes for 1.5 s, then nothing: the 2 s body deadline answers,
            sock.sendall(b"\0" * 8)  # not the 10 s read timeout (a read used to wait for a full buffer)
            time.sleep(0.5)
        answer = _answer(sock)
    assert b" 408 " in answer.split(b"\r\n")[0]
    assert b"request body not received within 2 s" in answer, answer


def test_connections_beyond_the_cap_get_503(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stream, "MAX_CONNECTIONS", 2)
    service = RolloutService(FakeEngine(default_weights(num_mib=1, block_mib=1)), _settings())
    assert service.http is not None
    server = stream.WeightStreamServer(service.http, service.settings).start()
    held = [socket.create_connection(("127.0.0.1", server.port), timeout=10) for _ in range(2)]
    try:
        time.sleep(0.2)  # both accepted and holding their slots
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as third:
            assert _answer(third).startswith(b"HTTP/1.1 503 ")
    finally:
        for sock in held:
            sock.close()
        server.stop()
        service.close()


def test_a_failed_push_over_the_stream_port_raises_and_keeps_serving(served: Served) -> None:
    before = _version(served)
    small = WeightSyncClient([served.url], auth_token=TOKEN, chunk_bytes=1024 * KIB)  # chunks above the limit
    with small, pytest.raises(WeightPushError, match="HTTP 413"):
        small.push_weights(_weights(served, 1.0), before + 1)
    assert _version(served) == before


def test_a_chunk_refused_before_its_body_is_read_is_reported_with_the_servers_answer(served: Served) -> None:
    # 8 MiB chunks against a 256 KiB limit: the server answers 413 and closes while the learner is still
    # writing, which must not read as a lost connection (that would skip the sync instead of failing it)
    before = _version(served)
    big = {
        "block0": torch.zeros(2048, 1024),
        **{k: v for k, v in _weights(served, 1.0).items() if k != "block0"},
    }
    client = WeightSyncClient([served.url], auth_token=TOKEN, chunk_bytes=8 * 1024 * KIB)
    with client, pytest.raises(WeightPushError, match="HTTP 413") as refused:
        client.push_weights(big, before + 1)
    assert not refused.value.unreachable
    assert _version(served) == before
