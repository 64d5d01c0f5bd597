"""Multi-node as it runs on a cluster, simulated on loopback: two `stagectl train-ab` launches with
`launch.nnodes: 2` (one rank each, one playing each node) meet at one rendezvous endpoint, each with a
node-local output directory. Global rank 0 (whichever node the rendezvous makes it) writes everything;
the other node writes nothing. Killing one "node" ends the other with an error naming the phase."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from stagectl.config import StagectlConfig
from stagectl.launch import data_image_roots, free_port
from tests.faults.helpers import fault_run
from tests.integration.helpers import (
    async_config,
    check_async_invariants,
    in_process_server,
    read_metrics,
    tiny_train_config,
    write_config,
)


def _two_node_config(tmp_path: Path, cfg: dict[str, Any]) -> tuple[Path, int]:
    port = free_port()
    cfg["launch"] = {
        **cfg.get("launch", {}),
        "nnodes": 2,
        "nproc_per_node": 1,
        "rdzv_endpoint": f"127.0.0.1:{port}",
        "watchdog": {"startup_s": 300, "step_s": 60},
    }
    return write_config(tmp_path / "cfg.yaml", cfg), port


def _run_two_nodes(tmp_path: Path, config: Path, timeout_s: float) -> tuple[list[int], list[str]]:
    codes, outputs = [], []
    with (
        fault_run(
            ["train-ab", str(config), "--set", f"training.output_dir={tmp_path / 'a'}"], tmp_path, name="a"
        ) as a,
        fault_run(
            ["train-ab", str(config), "--set", f"training.output_dir={tmp_path / 'b'}"], tmp_path, name="b"
        ) as b,
    ):
        for node in (a, b):
            codes.append(node.finish(timeout_s))
            outputs.append(node.output())
        assert not a.wait_no_leftovers(10) and not b.wait_no_leftovers(10)
    return codes, outputs


def _writer_and_silent(tmp_path: Path) -> tuple[Path, Path]:
    """(the node-local dir global rank 0 wrote, the other one, which must not exist)."""
    a, b = tmp_path / "a", tmp_path / "b"
    writer, silent = (a, b) if (a / "metrics.jsonl").exists() else (b, a)
    assert (writer / "metrics.jsonl").exists() and (writer / "config.yaml").exists()
    assert not silent.exists()  # the launcher's write check leaves no directory; nothing else writes there
    return writer, silent


def test_two_nodes_async_against_one_shared_rollout_server(tmp_path: Path) -> None:
    """The one completed 2-node run (async, both nodes against one external server): both launches relaunch
    under torchrun with `--nnodes=2` at the endpoint, end with identical weights, only global rank 0
    writes, and a step's packs are summed over the nodes (this run also covers what a separate 2-node
    A-only run used to: its steps are Channel-A as often as B)."""
    cfg = async_config(tmp_path, training={"max_steps": 6}, rollout_server={"embedded": False})
    roots = [str(p) for p in data_image_roots(StagectlConfig.model_validate(cfg).data)]
    # the shared server in this process (the same app as `stagectl rollout-server`, one process fewer)
    with in_process_server("builtin:tiny-qwen2.5-vl", f"rollout_server.image_roots={roots!r}") as url:
        cfg["custom"]["extra"]["rollout_matching"]["vllm"]["server"]["servers"] = [{"base_url": url}]
        config, _ = _two_node_config(tmp_path, cfg)
        codes, outputs = _run_two_nodes(tmp_path, config, 400)
    assert codes == [0, 0], [o[-2000:] for o in outputs]
    assert all("--nnodes=2" in o and "--rdzv-endpoint=127.0.0.1:" in o for o in outputs)
    writer, _ = _writer_and_silent(tmp_path)
    rows = read_metrics(writer)
    assert [r["step"] for r in rows] == list(range(6)) and rows[-1]["stage2_ab/async/sync_total"] >= 1
    digests = json.loads((writer / "final_state.json").read_text())["rank_weight_digests"]
    assert len(digests) == 2 and digests[0] == digests[1]
    check_async_invariants(rows, window=1)  # a B step's packs: 2 micro-steps on each of the 2 nodes
    a_rows = [r for r in rows if r["kind"] == "A"]
    assert a_rows and all(r["packing/n_packs"] == 2 * 2 for r in a_rows)  # A too: summed over the nodes


def _listening(port: int) -> bool:
    """Whether some process listens on TCP `port` (read from /proc, without connecting to it)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":
                return True
    return False


@pytest.mark.parametrize("killed", ["store_host", "other_node"])
def test_killing_one_node_ends_the_other_with_a_named_error(tmp_path: Path, killed: str) -> None:
    """The node started first hosts the rendezvous store (torchrun's c10d backend: every node whose
    address is the endpoint tries to bind it, the first wins). Killing either node ends the other in
    well under a minute, with a line naming what was lost and no torch traceback."""
    cfg = tiny_train_config(tmp_path, stage2_ab={"schedule": {"b_ratio": 0.0}}, training={"max_steps": 400})
    config, port = _two_node_config(tmp_path, cfg)
    argv = ["train-ab", str(config), "--set"]
    with fault_run([*argv, f"training.output_dir={tmp_path / 'host'}"], tmp_path, name="host") as host:
        host.wait_for(lambda: _listening(port), 120, "the rendezvous store listening")
        with fault_run([*argv, f"training.output_dir={tmp_path / 'other'}"], tmp_path, name="other") as other:
            started = [tmp_path / "host" / "metrics.jsonl", tmp_path / "other" / "metrics.jsonl"]
            host.wait_for(lambda: any(p.exists() for p in started), 300, "the first metrics row")
            time.sleep(2)
            victim, survivor = (host, other) if killed == "store_host" else (other, host)
            os.kill(victim.proc.pid, signal.SIGKILL)  # the node is gone: launcher, torchrun, rank
            killed_at = time.monotonic()
            code = survivor.finish(120)
            survivor_s = time.monotonic() - killed_at
            assert not victim.wait_no_leftovers(15) and not survivor.wait_no_leftovers(15)
    output = survivor.output()
    assert code != 0
    assert survivor_s < 90, survivor_s
    named = ["a peer rank is gone", "its launcher was gone"]
    if killed == "store_host":  # the survivor's rank or its torchrun notices first, whichever
        named.append("lost the rendezvous store at 127.0.0.1:")
    assert any(text in output for text in named), output[-3000:]
    assert "ChildFailedError" not in output and "frame #" not in output, output[-3000:]
