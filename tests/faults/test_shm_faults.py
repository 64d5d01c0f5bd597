"""`transport: shm` under faults: a corrupted or truncated snapshot, the server SIGKILLed while it maps
one, the learner SIGKILLed with one written. Each time the old version keeps serving (or, for the dead
server, never applied the sync) and no snapshot of ours stays in /dev/shm."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from stagectl.rollout.app import build_app
from stagectl.rollout.engines.fake import FakeEngine, default_weights
from stagectl.rollout.launcher import ServerProcess
from stagectl.rollout.service import RolloutService, ServerSettings
from stagectl.rollout.serving import ThreadedServer
from stagectl.weightsync.client import WeightSyncClient
from stagectl.weightsync.errors import WeightPushError
from stagectl.weightsync.shm import SHM_DIR, shm_path, write_snapshot
from tests.faults.helpers import INJECT_DIR
from tests.integration.helpers import ROOT

pytestmark = pytest.mark.skipif(not SHM_DIR.is_dir(), reason="needs /dev/shm")


def _snapshots_of(pid: int) -> list[Path]:
    return sorted(SHM_DIR.glob(f"stagectl-{pid}-*.safetensors"))


def _state(value: float) -> dict[str, torch.Tensor]:
    return {name: torch.full_like(t, value) for name, t in default_weights(num_mib=1, block_mib=1).items()}


@pytest.fixture
def served() -> Iterator[tuple[str, FakeEngine]]:
    engine = FakeEngine(default_weights(num_mib=1, block_mib=1))
    server = ThreadedServer(build_app(RolloutService(engine, ServerSettings()))).start()
    try:
        yield server.url, engine
    finally:
        server.stop()


def _version(url: str) -> int:
    return int(httpx.get(f"{url}/version/").json()["version"])


def test_corrupted_or_truncated_snapshot_keeps_the_old_version(served: tuple[str, FakeEngine]) -> None:
    url, engine = served
    with WeightSyncClient([url], transport="shm") as client:
        client.push_weights(_state(1.0), 1)
    assert _version(url) == 1 and bool((engine.weights["block0"] == 1.0).all())
    for damage, sync_id in (("flip", "c0ffee01"), ("truncate", "c0ffee02")):
        path = shm_path(sync_id)
        digest, _ = write_snapshot(path, _state(2.0))
        with path.open("r+b") as f:
            if damage == "flip":
                f.seek(-100, os.SEEK_END)
                f.write(b"\x7f")
            else:
                f.truncate(path.stat().st_size - 4096)
        body = {"path": str(path), "version": 2, "digest": digest}
        response = httpx.post(f"{url}/update_weights/from_shm/", json=body)
        path.unlink(missing_ok=True)
        assert response.status_code == 400, response.text
        detail = response.json()["detail"]
        assert ("checksum mismatch" if damage == "flip" else "truncated chunk") in detail
        assert "still serving version 1" in detail
        assert _version(url) == 1 and bool((engine.weights["block0"] == 1.0).all())
    # a snapshot outside /dev/shm, or not named like ours, is refused before it is opened
    response = httpx.post(
        f"{url}/update_weights/from_shm/", json={"path": "/etc/passwd", "version": 2, "digest": "0" * 32}
    )
    assert response.status_code == 400 and "not a stagectl snapshot" in response.json()["detail"]
    with WeightSyncClient([url], transport="shm") as client:
        client.push_weights(_state(3.0), 2)
    assert _version(url) == 2 and bool((engine.weights["block0"] == 3.0).all())
    assert _snapshots_of(os.getpid()) == []


def _fake_server(tmp_path: Path, fault: str) -> ServerProcess:
    env = {
        "PYTHONPATH": os.pathsep.join([str(INJECT_DIR), str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "STAGECTL_FAULT_DIR": str(tmp_path),
        "STAGECTL_FAULT": fault,
    }
    argv = [sys.executable, "-m", "tests.faults.fake_server"]
    return ServerProcess(argv, env=env, cwd=ROOT, log_path=tmp_path / "server.log")


def test_server_killed_while_mapping_a_snapshot(tmp_path: Path) -> None:
    server = _fake_server(tmp_path, "kill_in_sync:2:0")  # dies when it opens the second sync
    try:
        url = server.wait_listening(60)
        with WeightSyncClient([url], transport="shm") as client:
            client.push_weights(_state(1.0), 1)
            assert _version(url) == 1
            with pytest.raises(WeightPushError):
                client.push_weights(_state(2.0), 2)
        assert server.proc.wait(30) == -9
        assert list(tmp_path.glob("fault-*.json"))  # it was the injected kill
        assert _snapshots_of(os.getpid()) == []  # the learner removed its snapshot
    finally:
        server.stop()


LEARNER = """
import sys, torch
from stagectl.weightsync.client import WeightSyncClient
from stagectl.rollout.engines.fake import default_weights
state = {n: torch.full_like(t, 5.0) for n, t in default_weights(num_mib=1, block_mib=1).items()}
with WeightSyncClient([sys.argv[1]], transport="shm") as client:
    client.push_weights(state, int(sys.argv[2]))
"""


def test_learner_killed_with_a_snapshot_written(served: tuple[str, FakeEngine], tmp_path: Path) -> None:
    url, engine = served
    with WeightSyncClient([url], transport="shm") as client:
        client.push_weights(_state(1.0), 1)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(INJECT_DIR), str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "STAGECTL_FAULT_DIR": str(tmp_path),
        "STAGECTL_FAULT": "kill_in_shm_push:1",
    }
    learner = subprocess.run(
        [sys.executable, "-c", LEARNER, url, "2"], env=env, capture_output=True, timeout=120
    )
    assert learner.returncode == -9, learner.stderr.decode()[-2000:]
    (pid_record,) = [p for p in tmp_path.glob("fault-*.json")]
    dead_pid = int(pid_record.stem.split("-")[1])
    assert len(_snapshots_of(dead_pid)) == 1  # SIGKILL left it behind...
    assert _version(url) == 1 and bool((engine.weights["block0"] == 1.0).all())  # ...and nothing changed
    with WeightSyncClient([url], transport="shm") as client:  # the next start cleans up after the dead
        assert _snapshots_of(dead_pid) == []
        client.push_weights(_state(2.0), 2)
    assert _version(url) == 2
