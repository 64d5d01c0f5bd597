"""Channel-B when a rollout server dies (issue 41), on the real CLI with the tiny model: one of two servers
SIGKILLed (the other carries the rollouts) and started again on its port is re-synced and used again; a
server gone for good ends a 2-rank run with a clear error after the bounded wait, a checkpoint written
first; with `on_rollout_loss: continue_a_only` the run goes on A-only, warning for every skipped B step.
The detection and re-admission logic itself runs in process in
tests/integration/test_rollout_readmission.py."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx

from stagectl.learner.checkpoint import list_checkpoints
from stagectl.server.launcher import ServerProcess, start_server_process
from tests.faults.helpers import _entries, fault_run, report
from tests.integration.helpers import ROOT, async_config, read_metrics, write_config


def _server(port: int = 0, log_path: Path | None = None) -> ServerProcess:
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
    return start_server_process(args, cwd=ROOT, env={"OMP_NUM_THREADS": "1"}, log_path=log_path)


def _config(tmp_path: Path, urls: list[str], *, ranks: int = 1, **channel_b: Any) -> Path:
    """GAS 1, a sync after every step, external servers `urls`, 12 steps (a checkpoint every 4)."""
    cfg = async_config(
        tmp_path,
        training={"max_steps": 12, "gradient_accumulation_steps": 1, "save_steps": 4},
        launch={"nproc_per_node": ranks},
        rollout_server={"embedded": False},
        custom={
            "extra": {
                "rollout_matching": {
                    "vllm": {"server": {"servers": [{"base_url": u} for u in urls], "timeout_s": 20}}
                }
            }
        },
        stage2_ab={"channel_b": {"async": {"sync_every_steps": 1}, **channel_b}},
    )
    return write_config(tmp_path / "cfg.yaml", cfg)


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _b_samples(run: Path) -> list[dict[str, Any]]:
    return [row for row in _rows(run / "samples.jsonl") if row["channel"] == "B"]


def _b_steps(out: Path) -> dict[str, Any]:
    b_steps: dict[str, Any] = json.loads((out / "final_state.json").read_text())["b_steps"]
    return b_steps


def test_one_of_two_servers_killed_then_restarted_is_resynced_and_used_again(tmp_path: Path) -> None:
    """SIGKILL server 1 of 2 after the first B step: it takes no more requests and server 0 carries the B
    steps; start server 1 again on its port (the learner paused meanwhile: the tiny run would end before
    a server starts): the learner sees the new instance, pushes the current weights in full and sends it
    rollouts again; every B step trained after the restart has rollouts of the current version
    (`samples.jsonl`). (`wait_for_packs`: a B step waits for its packs, so the tiny run's fast steps
    cannot outrun the prefetcher.)"""
    servers = [_server(), _server()]
    urls = [str(s.url) for s in servers]
    port = int(urls[1].rsplit(":", 1)[1])
    config = _config(tmp_path, urls)
    out = tmp_path / "run"
    restarted_log = tmp_path / "restarted_server.log"

    def served_alone() -> bool:  # a B step trained after a step that found server 1 down
        alone = [r["step"] for r in _rows(out / "metrics.jsonl") if r["stage2_ab/async/servers_serving"] == 1]
        return bool(alone) and any(r["step"] > alone[0] for r in _b_samples(out))

    try:
        with fault_run(["train-ab", str(config)], tmp_path, fault="wait_for_packs:8") as run:
            run.wait_for(lambda: bool(_b_samples(out)), 240, "a B step")
            servers[1].proc.send_signal(signal.SIGKILL)
            servers[1].proc.wait()
            run.wait_for(served_alone, 120, "a B step on server 0 alone")
            ver_before = max(r["gen_version"] for r in _b_samples(out))
            os.killpg(run.proc.pid, signal.SIGSTOP)
            try:
                restarted_after = max(r["step"] for r in _rows(out / "samples.jsonl"))
                servers[1] = _server(port, restarted_log)
            finally:
                os.killpg(run.proc.pid, signal.SIGCONT)
            code = run.finish(300)
            assert not run.wait_no_leftovers(10)
            restarted_requests = httpx.get(f"{urls[1]}/stats/", timeout=10).json()["num_requests"]
    finally:
        for server in servers:
            server.stop()
    output = run.output()
    assert code == 0, output[-3000:]
    rows = read_metrics(out)
    assert (
        rows[-1]["stage2_ab/async/server_resync_total"] >= 1
        and rows[-1]["stage2_ab/async/servers_serving"] == 2
    )
    assert "weights version" in restarted_log.read_text()  # re-synced
    assert restarted_requests > 0  # re-admitted: it served rollouts
    after = [r for r in _b_samples(out) if r["step"] > restarted_after + 1]
    assert after, output[-3000:]
    assert all(r["gen_version"] > ver_before for r in after)  # rollouts of the re-synced weights
    assert all(0 <= r["train_version"] - r["gen_version"] <= 1 for r in after)
    b_steps = _b_steps(out)
    assert b_steps["b_steps_wanted"] == sum(r["policy_wants_b"] for r in rows) == 6
    assert b_steps["b_steps_trained"] == sum(r["kind"] == "B" for r in rows)
    # every B step the schedule wanted trained: the one in flight at the kill kept its packs (its burst
    # re-sent server 1's share to server 0 in the same call: rollout client failover), and the
    # re-admission's full push (a new version) waited for an A step, so no queued pack went stale
    wanted_before = [r["step"] for r in rows if r["policy_wants_b"] and r["step"] <= restarted_after]
    kind = {r["step"]: r["kind"] for r in rows}
    assert len(wanted_before) >= 2 and all(kind[s] == "B" for s in wanted_before), (kind, output[-3000:])
    assert rows[-1]["rollout_client/failovers"] >= 1 or rows[-1]["rollout_client/failed_calls"] == 0
    assert b_steps["b_steps_trained"] == 6 and not b_steps["b_steps_as_a"], (b_steps, kind, output[-3000:])
    assert "B steps: 6 wanted, 6 trained" in output


def test_killed_server_stops_the_run_with_the_servers_error_and_checkpoint(tmp_path: Path) -> None:
    """2 learner ranks, the only server SIGKILLed for good after the first B step: within the bounded wait
    (`rollout_loss_timeout_s`) every rank stops, rc 1, no "done", the message names the server, the last
    error, the step and the checkpoint written for it, which is complete."""
    server = _server()
    assert server.url is not None
    config = _config(tmp_path, [server.url], ranks=2, rollout_loss_timeout_s=8)
    out = tmp_path / "run"
    try:
        with fault_run(["train-ab", str(config)], tmp_path) as run:
            run.wait_for(lambda: bool(_b_samples(out)), 240, "a B step")
            server.proc.send_signal(signal.SIGKILL)
            killed_at = time.monotonic()
            code = run.finish(120)
            elapsed = time.monotonic() - killed_at
            assert not run.wait_no_leftovers(10)
    finally:
        server.stop()
    output = run.output()
    assert code == 1, output[-3000:]
    assert "done," not in output and "Traceback" not in output, output[-3000:]
    assert f"no rollout server can serve ({server.url})" in output
    assert "rollout_loss_timeout_s 8" in output and "last error:" in output and "ConnectError" in output
    stopped_before = int(output.split("stopped before step ")[1].split()[0])
    latest = list_checkpoints(out)[-1]
    assert f"the latest checkpoint is {latest}" in output
    assert latest.name == f"checkpoint-{stopped_before - 1}"  # written for the stop (save_steps is 4)
    assert elapsed < 8 + 60, elapsed
    report(
        fault="the only rollout server SIGKILLed for good (2 ranks)",
        failed_cleanly=True,
        exit_s=round(elapsed, 1),
    )


def test_continue_a_only_trains_a_without_a_server_warning_every_skipped_b_step(tmp_path: Path) -> None:
    """`on_rollout_loss: continue_a_only`, the only server SIGKILLed for good: the run completes (rc 0),
    every wanted B step after the kill trains as A with a warning line, and the summary, final_state.json
    and the off-schedule warning say how many and why (`no_server`)."""
    server = _server()
    assert server.url is not None
    config = _config(tmp_path, [server.url], on_rollout_loss="continue_a_only", rollout_loss_timeout_s=2)
    out = tmp_path / "run"
    try:
        with fault_run(["train-ab", str(config)], tmp_path) as run:
            run.wait_for(lambda: bool(_b_samples(out)), 240, "a B step")
            server.proc.send_signal(signal.SIGKILL)
            code = run.finish(240)
            assert not run.wait_no_leftovers(10)
    finally:
        server.stop()
    output = run.output()
    assert code == 0, output[-3000:]
    b_steps = _b_steps(out)
    no_server = b_steps["b_steps_as_a"].get("no_server", 0)
    assert no_server >= 2, b_steps
    assert output.count("trains as Channel-A: no rollout server can serve") == no_server
    assert f"B steps: 6 wanted, {b_steps['b_steps_trained']} trained" in output
    assert f"no_server {no_server}" in output and "warning: realized b_ratio" in output


def test_embedded_server_killed_is_restarted_resynced_and_used(tmp_path: Path) -> None:
    """The embedded server SIGKILLed after the first B step: train-ab starts it again on its port, the
    learner re-syncs the new process in full and B steps train again on rollouts of the current version."""
    cfg = async_config(
        tmp_path,
        training={"max_steps": 12, "gradient_accumulation_steps": 1},
        launch={"nproc_per_node": 1},
        stage2_ab={"channel_b": {"async": {"sync_every_steps": 1}}},
    )
    config = write_config(tmp_path / "cfg.yaml", cfg)
    out = tmp_path / "run"
    with fault_run(["train-ab", str(config)], tmp_path, fault="wait_for_packs:8") as run:
        run.wait_for(lambda: bool(_b_samples(out)), 240, "a B step")
        (server,) = [e for e in _entries(run.record_dir, "pid") if "rollout-server" in e["argv"]]
        os.kill(server["pid"], signal.SIGKILL)
        killed_after = max(r["step"] for r in _rows(out / "samples.jsonl"))
        ver_before = max(r["gen_version"] for r in _b_samples(out))
        code = run.finish(300)
        assert not run.wait_no_leftovers(10)
    output = run.output()
    assert code == 0, output[-3000:]
    assert "embedded rollout server exited (code -9); restarting it on port" in output
    assert read_metrics(out)[-1]["stage2_ab/async/server_resync_total"] >= 1
    after = [r for r in _b_samples(out) if r["step"] > killed_after + 1]
    assert after, output[-3000:]
    assert all(r["gen_version"] > ver_before for r in after)
    assert all(0 <= r["train_version"] - r["gen_version"] <= 1 for r in after)
