"""`transport: disk` under faults (in process, what the shm fault tests covered for the removed
shm transport): a truncated snapshot keeps the old version; a push the server refuses, or a server that is
gone, leaves no snapshot in `disk_dir`; a killed learner's leftovers are removed by the next sender."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from stagectl.engines.fake import FakeEngine, default_weights
from stagectl.server.app import build_app
from stagectl.server.service import RolloutService, ServerSettings
from stagectl.server.serving import ThreadedServer
from stagectl.weightsync.client import WeightSyncClient
from stagectl.weightsync.disk import write_snapshot
from stagectl.weightsync.errors import WeightPushError


def _state(value: float) -> dict[str, torch.Tensor]:
    return {name: torch.full_like(t, value) for name, t in default_weights(num_mib=1, block_mib=1).items()}


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[str, FakeEngine, ThreadedServer]]:
    engine = FakeEngine(default_weights(num_mib=1, block_mib=1))
    settings = ServerSettings(weight_dirs=[tmp_path])
    server = ThreadedServer(build_app(RolloutService(engine, settings))).start()
    try:
        yield server.url, engine, server
    finally:
        server.stop()


def _version(url: str) -> int:
    return int(httpx.get(f"{url}/version/").json()["version"])


def test_truncated_snapshot_keeps_the_old_version(
    served: tuple[str, FakeEngine, ThreadedServer], tmp_path: Path
) -> None:
    url, engine, _ = served
    with WeightSyncClient([url], transport="disk", disk_dir=tmp_path / "sync") as client:
        client.push_weights(_state(1.0), 1)
    assert _version(url) == 1 and bool((engine.weights["block0"] == 1.0).all())
    path = tmp_path / "truncated.safetensors"
    write_snapshot(path, _state(2.0))
    with path.open("r+b") as f:
        f.truncate(path.stat().st_size - 4096)
    response = httpx.post(f"{url}/update_weights/from_disk/", json={"path": str(path), "version": 2})
    assert response.status_code == 400, response.text
    assert _version(url) == 1 and bool((engine.weights["block0"] == 1.0).all())


def test_a_failed_push_leaves_no_snapshot(
    served: tuple[str, FakeEngine, ThreadedServer], tmp_path: Path
) -> None:
    url, _, server = served
    sync_dir = tmp_path / "sync"
    with WeightSyncClient([url], transport="disk", disk_dir=sync_dir) as client:
        client.push_weights(_state(1.0), 1)
        assert list(sync_dir.iterdir()) == []  # removed once every server loaded it
        with pytest.raises(WeightPushError):
            client.push_weights(_state(2.0), 1)  # refused: not above the serving version
        assert list(sync_dir.iterdir()) == []
        server.stop()
        with pytest.raises(WeightPushError):
            client.push_weights(_state(2.0), 2)  # the server is gone
        assert list(sync_dir.iterdir()) == []


def test_a_killed_learners_leftovers_are_removed_by_the_next_sender(
    served: tuple[str, FakeEngine, ThreadedServer], tmp_path: Path
) -> None:
    url, _, _ = served
    sync_dir = tmp_path / "sync"
    sync_dir.mkdir()
    left = [sync_dir / "weights_v3.safetensors", sync_dir / "weights_v4.tmp"]  # what SIGKILL mid-push leaves
    for path in left:
        write_snapshot(path, _state(3.0))
    unrelated = sync_dir / "notes.txt"
    unrelated.write_text("not ours")
    with WeightSyncClient([url], transport="disk", disk_dir=sync_dir) as client:
        assert not any(path.exists() for path in left)
        client.push_weights(_state(1.0), 1)
    assert list(sync_dir.iterdir()) == [unrelated] and _version(url) == 1
