"""Distinct weight-sync failures are distinct status codes on both server ports (one mapping,
`weightsync.errors.status_of`) and distinct exception types on the learner's side (`Servers`,
`ChunkSender`), so nothing dispatches on a message. Checked on the real app (uvicorn on 127.0.0.1 in a
thread, the fake engine, its weight-stream port on)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from stagectl.engines.fake import FakeEngine, default_weights
from stagectl.server.app import build_app
from stagectl.server.service import RolloutService, ServerSettings
from stagectl.server.serving import ThreadedServer
from stagectl.weightsync.base import Servers
from stagectl.weightsync.errors import (
    DeltaBaseError,
    DeltaRefused,
    NoGroupError,
    NotInGroup,
    WeightPushError,
    WeightSyncError,
    status_of,
)
from stagectl.weightsync.http import ChunkSender
from stagectl.weightsync.wire import encode_chunks


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    engine = FakeEngine(default_weights(), batch_wait_ms=0)
    server = ThreadedServer(build_app(RolloutService(engine, ServerSettings()))).start()
    assert server.url is not None
    yield server.url
    server.stop()


def _servers(url: str) -> Servers:
    return Servers([url], {}, httpx.Timeout(10.0), None, timeout_s=10.0)


def _stream_url(url: str) -> str:
    port = httpx.get(f"{url}/version/").json()["weight_stream_port"]
    assert port is not None
    return str(httpx.URL(url).copy_with(port=port).join("/update_weights/"))


def _chunk_params(base_version: int | None, digest: str | None = None) -> tuple[dict[str, object], object]:
    chunk = next(encode_chunks(default_weights(), 1 << 20))
    params: dict[str, object] = {
        "sync_id": "s",
        "chunk_index": 0,
        "digest": digest or chunk.digest,
        "version": 9,
    }
    if base_version is not None:
        params["base_version"] = base_version
    return params, chunk


def test_one_status_per_server_error() -> None:
    assert status_of(DeltaBaseError("x")) == 409
    assert status_of(NoGroupError("x")) == 412
    assert status_of(WeightSyncError("x")) == 400


def _post_chunk(servers: Servers, url: str, port: str, params: dict[str, object], chunk: Any) -> None:
    """One weight chunk to the app's `/update_weights/` or to the weight-stream port."""
    if port == "app":
        headers = {"Content-Type": "application/octet-stream"}
        servers.post_url(f"{url}/update_weights/", 0, params=params, content=chunk.data, headers=headers)
    else:
        with ChunkSender({}, 10.0) as sender:
            sender.post(0, _stream_url(url), params, chunk)


@pytest.mark.parametrize("port", ["app", "stream"])
def test_a_delta_against_another_base_is_409_and_delta_refused_on_both_ports(url: str, port: str) -> None:
    params, chunk = _chunk_params(base_version=5)  # the server serves version 0
    servers = _servers(url)
    try:
        with pytest.raises(DeltaRefused, match="HTTP 409: delta sync s against base version 5 refused"):
            _post_chunk(servers, url, port, params, chunk)
    finally:
        servers.close()


@pytest.mark.parametrize("port", ["app", "stream"])
def test_a_bad_chunk_is_400_and_a_plain_refusal_on_both_ports(url: str, port: str) -> None:
    params, chunk = _chunk_params(base_version=None, digest="0" * 32)
    servers = _servers(url)
    try:
        with pytest.raises(WeightPushError, match=r"HTTP 400: .*checksum mismatch") as refused:
            _post_chunk(servers, url, port, params, chunk)
        assert type(refused.value) is WeightPushError and not refused.value.unreachable
    finally:
        servers.close()


def test_a_server_outside_the_weight_group_is_412_and_not_in_group(url: str) -> None:
    announce = {
        "sync_id": "g",
        "version": 9,
        "tensors": [{"name": "w0", "dtype": "float32", "shape": [4, 4]}],
    }
    assert httpx.post(f"{url}/update_weights/group/start/", json=announce).status_code == 412
    servers = _servers(url)
    try:
        with pytest.raises(NotInGroup, match="HTTP 412: no weight group on this server"):
            servers.post(0, "/update_weights/group/start/", json=announce)
    finally:
        servers.close()


def test_a_server_that_is_not_there_is_unreachable() -> None:
    servers = _servers("http://127.0.0.1:9")  # discard port: nothing listens
    try:
        with pytest.raises(WeightPushError) as lost:
            servers.post(0, "/update_weights/commit/", json={})
        assert lost.value.unreachable
    finally:
        servers.close()


@pytest.mark.parametrize(
    ("query", "field"),
    [
        ({"chunk_index": 0, "digest": "0" * 32, "version": 1}, "sync_id"),
        ({"sync_id": "s", "chunk_index": -1, "digest": "0" * 32, "version": 1}, "chunk_index"),
        ({"sync_id": "s", "chunk_index": 0, "digest": "xyz", "version": 1}, "digest"),
        (
            {"sync_id": "s", "chunk_index": 0, "digest": "0" * 32, "version": 1, "base_version": "a"},
            "base_version",
        ),
    ],
)
def test_both_ports_check_a_chunk_query_with_one_model(
    url: str, query: dict[str, object], field: str
) -> None:
    """`protocol.ChunkQuery` on both ports: the same 422 and the same detail, naming the field."""
    answers = [
        httpx.post(target, params=query, content=b"x" * 8)  # type: ignore[arg-type]
        for target in (f"{url}/update_weights/", _stream_url(url))
    ]
    assert [a.status_code for a in answers] == [422, 422]
    app_detail, stream_detail = (a.json()["detail"] for a in answers)
    assert app_detail == stream_detail and app_detail.startswith(f"{field}: ")


def _weight_paths(transports: frozenset[str]) -> set[str]:
    engine = FakeEngine(default_weights(), batch_wait_ms=0)
    app = build_app(RolloutService(engine, ServerSettings(weight_transports=transports)))
    return set(app.openapi()["paths"]) & {  # the paths the app serves
        "/update_weights/",
        "/update_weights/commit/",
        "/update_weights/abort/",
        "/update_weights/group/init/",
        "/update_weights/group/start/",
        "/update_weights/group/finish/",
        "/update_weights/from_disk/",
    }


def test_the_app_mounts_only_the_configured_transports_routes() -> None:
    assert _weight_paths(frozenset({"disk"})) == {"/update_weights/abort/", "/update_weights/from_disk/"}
    assert _weight_paths(frozenset({"http"})) == {
        "/update_weights/",
        "/update_weights/commit/",
        "/update_weights/abort/",
    }
    assert len(_weight_paths(frozenset({"http", "collective", "disk"}))) == 7
    engine = FakeEngine(default_weights(), batch_wait_ms=0)
    disk_only = TestClient(
        build_app(RolloutService(engine, ServerSettings(weight_transports=frozenset({"disk"}))))
    )
    assert disk_only.post("/update_weights/commit/", json={}).status_code == 404  # not served at all
    assert (
        disk_only.post("/update_weights/from_disk/", json={}).status_code == 422
    )  # served: the body is wrong
