"""`transport: collective`: the learner and the rollout servers in a gloo weight group of their own, every
tensor broadcast from the learner, against the real app over the fake engine (two servers), with the
control flow's failure branches: a metadata mismatch refused before a byte moves, a learner that dies
mid-broadcast, a restarted server; the old version serves after every failure and the next push works."""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Iterator
from dataclasses import asdict

import httpx
import pytest
import torch

from stagectl.engines.fake import FakeEngine, default_weights
from stagectl.server.app import build_app
from stagectl.server.service import RolloutService, ServerSettings
from stagectl.server.serving import ThreadedServer
from stagectl.weightsync.client import WeightSyncClient
from stagectl.weightsync.collective import GroupInfo, WeightGroup, host_store
from stagectl.weightsync.errors import WeightPushError

TOKEN = "tok"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _server(engine: FakeEngine, port: int = 0) -> ThreadedServer:
    return ThreadedServer(
        build_app(RolloutService(engine, ServerSettings(auth_token=TOKEN))), port=port
    ).start()


@pytest.fixture
def two() -> Iterator[tuple[list[FakeEngine], list[ThreadedServer]]]:
    engines = [FakeEngine(default_weights(num_mib=1, block_mib=1)) for _ in range(2)]
    servers = [_server(e) for e in engines]
    yield engines, servers
    for s in servers:
        s.stop()


def _weights(engine: FakeEngine, value: float) -> dict[str, torch.Tensor]:
    return {k: torch.full_like(v, value) for k, v in engine.weights.items()}


def _versions(servers: list[ThreadedServer]) -> list[int]:
    return [int(httpx.get(f"{s.url}/version/", headers=AUTH).json()["version"]) for s in servers]


def _client(servers: list[ThreadedServer], timeout_s: float = 20.0) -> WeightSyncClient:
    return WeightSyncClient(
        [s.url for s in servers], auth_token=TOKEN, transport="collective", timeout_s=timeout_s
    )


def test_broadcast_reaches_every_server_and_the_group_is_reused(
    two: tuple[list[FakeEngine], list[ThreadedServer]],
) -> None:
    engines, servers = two
    with _client(servers) as client:
        report = client.push_weights(_weights(engines[0], 0.5), 1)
        group = client.sender._group
        client.push_weights(_weights(engines[0], 1.5), 2)
        assert client.sender._group is group is not None  # formed once
    assert report.transport == "collective" and report.num_bytes == sum(
        t.numel() * t.element_size() for t in engines[0].weights.values()
    )
    assert _versions(servers) == [2, 2]
    for engine in engines:
        assert all(torch.equal(t, torch.full_like(t, 1.5)) for t in engine.weights.values())


def test_a_mismatch_is_refused_before_a_byte_moves_and_the_next_push_works(
    two: tuple[list[FakeEngine], list[ThreadedServer]],
) -> None:
    engines, servers = two
    with _client(servers) as client:
        client.push_weights(_weights(engines[0], 0.5), 1)
        wrong = {**_weights(engines[0], 9.0), "w0": torch.zeros(3, 3)}
        with pytest.raises(WeightPushError, match=r"w0: shape \[3, 3\].*refused before any byte moved"):
            client.push_weights(wrong, 2)
        assert _versions(servers) == [1, 1]
        assert all(torch.equal(t, torch.full_like(t, 0.5)) for t in engines[1].weights.values())
        client.push_weights(_weights(engines[0], 2.0), 2)
    assert _versions(servers) == [2, 2]


def test_a_learner_dead_mid_broadcast_leaves_the_old_version_serving(
    two: tuple[list[FakeEngine], list[ThreadedServer]],
) -> None:
    engines, servers = two
    weights = _weights(engines[0], 7.0)
    # a hand-driven learner: forms the group, announces every tensor, broadcasts one, then goes silent
    store = host_store("127.0.0.1", 3, 2.0)
    infos = [GroupInfo("127.0.0.1", store.port, rank, 3, 2.0) for rank in range(3)]
    with cf.ThreadPoolExecutor(3) as pool:
        joins = [
            pool.submit(
                httpx.post,
                f"{s.url}/update_weights/group/init/",
                json=asdict(infos[k + 1]),
                headers=AUTH,
                timeout=30,
            )
            for k, s in enumerate(servers)
        ]
        group = WeightGroup(infos[0], store)
        assert all(f.result().status_code == 200 for f in joins)
    announce = {
        "sync_id": "dying",
        "version": 1,
        "tensors": [{"name": n, "dtype": "float32", "shape": list(t.shape)} for n, t in weights.items()],
    }
    for s in servers:
        assert (
            httpx.post(f"{s.url}/update_weights/group/start/", json=announce, headers=AUTH).status_code == 200
        )
    group.broadcast(next(iter(weights.values())))
    finished = httpx.post(
        f"{servers[0].url}/update_weights/group/finish/",
        json={"sync_id": "dying", "version": 1},
        headers=AUTH,
        timeout=30,
    )
    assert finished.status_code == 400
    assert "still serving version 0" in finished.json()["detail"]
    assert _versions(servers) == [0, 0]
    assert not any(torch.equal(t, torch.full_like(t, 7.0)) for t in engines[0].weights.values())
    # a real learner afterwards: the servers re-join a new group and take the sync
    with _client(servers) as client:
        client.push_weights(_weights(engines[0], 3.0), 1)
    assert _versions(servers) == [1, 1]


def test_a_restarted_server_rejoins_without_failing_the_push(
    two: tuple[list[FakeEngine], list[ThreadedServer]],
) -> None:
    engines, servers = two
    with _client(servers) as client:
        client.push_weights(_weights(engines[0], 0.5), 1)
        port = httpx.URL(servers[1].url).port
        assert port is not None
        servers[1].stop()
        engines[1] = FakeEngine(default_weights(num_mib=1, block_mib=1))
        servers[1] = _server(engines[1], port=port)
        client.push_weights(_weights(engines[0], 4.0), 2)  # 412 from the new server -> group formed again
    assert _versions(servers) == [2, 2]
    assert all(torch.equal(t, torch.full_like(t, 4.0)) for t in engines[1].weights.values())


def test_group_endpoints_need_the_token(two: tuple[list[FakeEngine], list[ThreadedServer]]) -> None:
    _, servers = two
    for path in ("group/init/", "group/start/", "group/finish/"):
        assert httpx.post(f"{servers[0].url}/update_weights/{path}", json={}).status_code == 401


def test_any_dtype_and_empty_tensors_travel() -> None:
    # bf16 / float8 / bool / int64 / an empty tensor: broadcast as bytes (gloo itself refuses float8:
    # "Invalid scalar type")
    weights = {
        "w0": torch.zeros(4, 4),
        "half": torch.zeros(3, 5, dtype=torch.bfloat16),
        "mask": torch.zeros(7, dtype=torch.bool),
        "ids": torch.zeros(2, 3, dtype=torch.int64),
        "fp8": torch.zeros(4, 2).to(torch.float8_e4m3fn),
        "empty": torch.zeros(0, 4),
    }
    engine = FakeEngine({k: v.clone() for k, v in weights.items()})
    server = _server(engine)
    try:
        new = {
            "w0": torch.full((4, 4), 2.0),
            "half": torch.full((3, 5), 1.5, dtype=torch.bfloat16),
            "mask": torch.tensor([True, False] * 3 + [True]),
            "ids": torch.arange(6).reshape(2, 3),
            "fp8": torch.full((4, 2), 0.5).to(torch.float8_e4m3fn),
            "empty": torch.zeros(0, 4),
        }
        with _client([server]) as client:
            client.push_weights(new, 1)
        for name, value in new.items():  # compared as bytes (float8 has no equality kernel)
            assert torch.equal(engine.weights[name].view(torch.uint8), value.view(torch.uint8)), name
    finally:
        server.stop()
