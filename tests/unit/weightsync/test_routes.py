"""Each weight-sync transport brings its own server routes (`weightsync.{http,collective,disk}_routes`),
calling its own receiver off the event loop."""

from __future__ import annotations

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
