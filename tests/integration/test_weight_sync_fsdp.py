"""FSDP2 on 2 gloo ranks (`fsdp_sync_worker.py`): a model only rank 0 loads reaches every rank's shards
(`shard_from_rank0`); weight sync from the shards streamed a tensor at a time: every transport serves exactly the weights a whole-state-dict gather gives, and a push refused at its first
chunk ends the sync on every rank with the server's message instead of leaving a rank in an all-gather."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from stagectl.launch import kill_tree
from tests.integration.helpers import ROOT

TIMEOUT_S = 180


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_streamed_fsdp_sync_serves_the_gathered_weights_over_every_transport(tmp_path: Path) -> None:
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(_free_port()),
        str(ROOT / "tests" / "integration" / "fsdp_sync_worker.py"),
        str(tmp_path),  # reports, and the disk transport's snapshots (under the server's weight dir)
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=env,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:  # a rank left in an all-gather: the bug this test is here for
        kill_tree(proc.pid, grace_s=0.0)
        stdout, stderr = proc.communicate()
        raise AssertionError(f"the ranks hung:\n{stdout[-2000:]}\n{stderr[-4000:]}") from None
    assert proc.returncode == 0, stderr[-4000:]
    rows = [
        json.loads(line)
        for rank in (0, 1)
        for line in (tmp_path / f"rank{rank}.jsonl").read_text().splitlines()
    ]
    loads = sorted((r["rank"], r["loaded_equal"], r["buffers_equal"]) for r in rows if "loaded_equal" in r)
    assert loads == [(0, True, True), (1, True, True)]  # rank 1 built on meta, filled from rank 0
    syncs = [r for r in rows if "transport" in r]
    assert [r["transport"] for r in syncs] == ["http", "collective", "disk"]
    for k, row in enumerate(syncs):
        assert row["status"] == "ok" and row["version"] == k + 1
        assert len(row["names"]) == 9 and row["equal"] == row["names"], row
    refusals = sorted((r["rank"], r["refused"]) for r in rows if "refused" in r)
    assert [rank for rank, _ in refusals] == [0, 1]
    assert all("embed.weight" in message and "failed on rank 0" in message for _, message in refusals)
