"""`transport: collective` under faults: a rollout server SIGKILLed mid-broadcast. The learner's push fails
fast as *unreachable* (the run skips this sync, as for a lost connection), the surviving server keeps its
old version and weights, and a new group forms at the next push."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import httpx
import torch

from stagectl.engines.fake import FakeEngine, default_weights
from stagectl.server.app import build_app
from stagectl.server.launcher import ServerProcess
from stagectl.server.service import RolloutService, ServerSettings
from stagectl.server.serving import ThreadedServer
from stagectl.weightsync.client import WeightSyncClient
from stagectl.weightsync.errors import WeightPushError
from tests.faults.helpers import INJECT_DIR
from tests.integration.helpers import ROOT

MIB = 4  # the fake server's weights: w0 + 4 blocks = 5 tensors per sync


def _state(value: float) -> dict[str, torch.Tensor]:
    return {name: torch.full_like(t, value) for name, t in default_weights(num_mib=MIB, block_mib=1).items()}


def _version(url: str) -> int:
    return int(httpx.get(f"{url}/version/").json()["version"])


def test_server_killed_mid_broadcast(tmp_path: Path) -> None:
    env = {
        "PYTHONPATH": os.pathsep.join([str(INJECT_DIR), str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "STAGECTL_FAULT_DIR": str(tmp_path),
        "STAGECTL_FAULT": "kill_in_broadcast:8",  # the third tensor of the second sync
    }
    doomed = ServerProcess(
        [sys.executable, "-m", "tests.faults.fake_server", str(MIB)],
        env=env,
        cwd=ROOT,
        log_path=tmp_path / "server.log",
    )
    engine = FakeEngine(default_weights(num_mib=MIB, block_mib=1))
    survivor = ThreadedServer(build_app(RolloutService(engine, ServerSettings()))).start()
    try:
        urls = [survivor.url, doomed.wait_listening(60)]
        with WeightSyncClient(urls, transport="collective", timeout_s=30) as client:
            client.push_weights(_state(1.0), 1)
            assert [_version(u) for u in urls] == [1, 1]
            started = time.monotonic()
            try:
                client.push_weights(_state(2.0), 2)
                raise AssertionError("the push survived a dead group member")
            except WeightPushError as exc:
                error = exc
            assert time.monotonic() - started < 20  # the dead peer is noticed, not waited out
        assert error.unreachable, str(error)
        assert doomed.proc.wait(30) == -9 and list(tmp_path.glob("fault-*.json"))
        assert _version(survivor.url) == 1
        assert all(bool((t == 1.0).all()) for t in engine.weights.values())
        with WeightSyncClient([survivor.url], transport="collective", timeout_s=30) as client:
            client.push_weights(_state(3.0), 2)  # a new group, without the dead server
        assert _version(survivor.url) == 2 and all(bool((t == 3.0).all()) for t in engine.weights.values())
    finally:
        survivor.stop()
        doomed.stop()
