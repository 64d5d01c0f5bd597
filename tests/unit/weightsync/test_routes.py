"""Each weight-sync transport brings its own server routes (`weightsync.{http,collective,disk}_routes`),
calling its own receiver off the event loop."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from fastapi.testclient import TestClient
from starlette.routing import Route

from stagectl.weightsync import collective_routes, disk_routes, http_routes


async def inline(func: Callable[..., Any], *args: Any) -> Any:
    return func(*args)


def _paths(router: Any) -> set[str]:
    return {route.path for route in router.routes if isinstance(route, Route)}


def test_each_transport_serves_its_own_paths_only() -> None:
    mine = {
        "http": _paths(http_routes.routes(None, inline)),  # type: ignore[arg-type]
        "collective": _paths(collective_routes.routes(None, inline)),  # type: ignore[arg-type]
        "disk": _paths(disk_routes.routes(None, inline)),  # type: ignore[arg-type]
    }
    assert mine == {
        "http": {"/update_weights/", "/update_weights/commit/"},
        "collective": {
            "/update_weights/group/init/",
            "/update_weights/group/start/",
            "/update_weights/group/finish/",
        },
        "disk": {"/update_weights/from_disk/"},
    }


def test_a_route_hands_its_body_to_its_receiver() -> None:
    calls: list[tuple[str, int]] = []

    class Receiver:
        def load_from_disk(self, path: str, version: int) -> dict[str, Any]:
            calls.append((path, version))
            return {"version": version, "num_tensors": 2, "num_bytes": 16, "apply_s": 0.0}

    app = FastAPI()
    app.include_router(disk_routes.routes(Receiver(), inline))  # type: ignore[arg-type]
    answer = TestClient(app).post("/update_weights/from_disk/", json={"path": "/w/v3", "version": 3})
    assert answer.status_code == 200, answer.text
    assert calls == [("/w/v3", 3)] and answer.json()["version"] == 3


def test_a_chunk_cut_off_mid_body_fails_its_sync_and_raises_nothing_to_the_server() -> None:
    """The learner dies mid-chunk: the chunk's sync is failed and the route answers 400 to the gone sender.
    The route used to let starlette's `ClientDisconnect` escape: a 60-line "Exception in ASGI application"
    traceback in the server's log for every sync cut short."""
    failed: list[str] = []

    class Chunk:
        def feed(self, data: bytes) -> None:
            pass

    class Receiver:
        def begin_chunk(self, *args: Any) -> Chunk:
            return Chunk()

        def fail_chunk(self, chunk: Chunk, reason: str) -> None:
            failed.append(reason)

    app = FastAPI()
    app.include_router(http_routes.routes(Receiver(), inline))  # type: ignore[arg-type]
    query = f"sync_id=s&chunk_index=0&digest={'0' * 32}&version=1"
    scope = {
        "type": "http",
        "method": "POST",
        "path": "/update_weights/",
        "raw_path": b"/update_weights/",
        "query_string": query.encode(),
        "headers": [(b"content-length", b"1000")],
        "http_version": "1.1",
        "scheme": "http",
        "server": ("127.0.0.1", 1),
        "client": ("127.0.0.1", 2),
        "root_path": "",
    }
    messages = [
        {"type": "http.request", "body": b"x" * 10, "more_body": True},
        {"type": "http.disconnect"},
    ]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return messages.pop(0)

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))  # raised ClientDisconnect before the fix
    assert failed == ["the chunk's body did not arrive whole"]
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 400
