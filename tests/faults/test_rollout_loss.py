"""Channel-B when a rollout server dies (issue 41), on the real CLI with the tiny model on one rank: a
server SIGKILLed and started again on its port is re-synced and used again; a server gone for good ends
the run with a clear error after the bounded wait. The detection and re-admission logic itself is tested
in process (tests/unit/learner/test_server_health.py)."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any

from stagectl.rollout.server.launcher import ServerProcess, start_server_process
from tests.faults.helpers import fault_run
from tests.integration.helpers import ROOT, async_config, read_metrics, write_config


def _server(port: int = 0) -> ServerProcess:
    args = [
        "--model",
        "builtin:tiny-qwen2.5-vl",
        "--port",
        str(port),
        "--set",
        "rollout_server.max_batch_size=8",
        "--set",
        f"rollout_server.image_roots=[{Path.home()}]",
    ]
    return start_server_process(args, cwd=ROOT, env={"OMP_NUM_THREADS": "1"})


def _one_rank_config(tmp_path: Path, urls: list[str], **over: Any) -> Path:
    """One learner rank, GAS 1, a sync after every step, external servers `urls`."""
    cfg = async_config(
        tmp_path,
        training={"max_steps": 12, "gradient_accumulation_steps": 1, "save_steps": 4},
        launch={"nproc_per_node": 1},
        rollout_server={"embedded": False},
        custom={
            "extra": {
                "rollout_matching": {
                    "vllm": {"server": {"servers": [{"base_url": u} for u in urls], "timeout_s": 20}}
                }
            }
        },
        stage2_ab={"channel_b": {"async": {"sync_every_steps": 1}, **over}},
    )
    return write_config(tmp_path / "cfg.yaml", cfg)


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _b_samples(run: Path) -> list[dict[str, Any]]:
    return [row for row in _rows(run / "samples.jsonl") if row["channel"] == "B"]


def test_server_killed_and_restarted_is_resynced_and_used_again(tmp_path: Path) -> None:
    """SIGKILL the only server after the first B step, start it again on its port: the learner sees the
    new instance, pushes the current weights in full, and B steps train again on rollouts of the current
    version (`samples.jsonl`); the summary counts what was wanted and trained. (`wait_for_packs`: a B step
    waits for its packs, so the tiny run's fast steps cannot outrun the prefetcher.)"""
    server = _server()
    assert server.url is not None
    port = int(server.url.rsplit(":", 1)[1])
    config = _one_rank_config(tmp_path, [server.url])
    out = tmp_path / "run"
    try:
        with fault_run(["train-ab", str(config)], tmp_path, fault="wait_for_packs:20") as run:
            run.wait_for(
                lambda: any(r["channel"] == "B" for r in _rows(out / "samples.jsonl")), 240, "a B step"
            )
            server.proc.send_signal(signal.SIGKILL)
            server.proc.wait()
            killed_after = max(r["step"] for r in _rows(out / "samples.jsonl"))
            ver_before = max(r["gen_version"] for r in _b_samples(out))
            time.sleep(1)
            server = _server(port)
            code = run.finish(300)
            assert not run.wait_no_leftovers(10)
    finally:
        server.stop()
    output = run.output()
    assert code == 0, output[-3000:]
    rows = read_metrics(out)
    assert rows[-1]["stage2_ab/async/server_resync_total"] >= 1
    after = [r for r in _b_samples(out) if r["step"] > killed_after + 1]
    assert after, output[-3000:]
    assert all(r["gen_version"] > ver_before for r in after)  # rollouts of the re-synced weights
    assert all(0 <= r["train_version"] - r["gen_version"] <= 1 for r in after)
    b_steps = json.loads((out / "final_state.json").read_text())["b_steps"]
    assert b_steps["b_steps_trained"] == sum(r["kind"] == "B" for r in rows)
    assert b_steps["b_steps_wanted"] == sum(r["policy_wants_b"] for r in rows)
    assert f"B steps: {b_steps['b_steps_wanted']} wanted, {b_steps['b_steps_trained']} trained" in output
