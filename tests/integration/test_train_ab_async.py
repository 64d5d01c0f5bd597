"""Async actor-learner end to end on one CPU machine: 2 torchrun learner ranks + a rollout server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from stagectl.rollout.launcher import start_server_process
from stagectl.schedule import channel_for_step
from tests.faults.helpers import fault_run
from tests.integration.helpers import (
    ROOT,
    check_phase_times,
    read_metrics,
    run_cli,
    tiny_train_config,
    write_config,
)


def async_config(tmp_path: Path, **sections: object) -> dict:
    base = tiny_train_config(
        tmp_path,
        training={"per_device_train_batch_size": 1, "gradient_accumulation_steps": 2, "max_steps": 8},
        launch={"nproc_per_node": 2, "watchdog": {"step_s": 120}},
        custom={
            "extra": {
                "rollout_matching": {
                    "rollout_backend": "vllm",
                    "max_new_tokens": 24,
                    "vllm": {"mode": "server", "server": {"timeout_s": 60}},
                }
            }
        },
        stage2_ab={
            "schedule": {"b_ratio": 0.5},
            "channel_b": {
                "mode": "async",
                "rollout_decode_batch_size": 4,
                "async": {
                    "queue_limit": 8,
                    "version_window": 1,
                    "prefetch_target_packs": 4,
                    "sync_every_steps": 2,
                },
            },
        },
        rollout_server={"embedded": True, "max_batch_size": 8},
    )
    from tests.integration.helpers import deep_merge

    return deep_merge(base, sections)  # type: ignore[arg-type]


def check_async_invariants(rows: list[dict], window: int) -> None:
    for r in rows:
        wanted = channel_for_step(r["step"], 0.5)
        assert r["policy_wants_b"] == (wanted == "B")
        if r["stage2_ab/async/b_step_skipped_due_to_queue"]:
            assert wanted == "B" and r["kind"] == "A"
        else:
            assert r["kind"] == wanted
        if r["kind"] == "B":
            assert 0 <= r["stage2_ab/async/ver_lag"] <= window
            assert r["num_backward"] == 2  # rank 0: one forward/backward per micro-step (GAS = 2)
            assert r["packing/n_packs"] == 2 * 2  # one pack per micro-step on each of the 2 ranks
            assert "rollout/f1" in r


def test_example_async_config_completes(tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = run_cli(
        "train-ab", "examples/tiny/train_ab_async.yaml", "--set", f"training.output_dir={out}", timeout=360
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "embedded rollout server: http://127.0.0.1:" in result.stderr
    rows = read_metrics(out)
    assert len(rows) == 16
    check_async_invariants(rows, window=1)
    check_phase_times(rows)
    synced = [r for r in rows if "weight_sync/bytes" in r]
    assert synced and all(r["time/weight_sync_s"] > 0 for r in synced)
    assert sum(r["time/prefetch_build_s"] for r in rows) > 0  # the prefetcher thread built the packs
    assert sum(r["kind"] == "B" for r in rows) >= 3
    digests = json.loads((out / "final_state.json").read_text())["rank_weight_digests"]
    assert len(digests) == 2 and digests[0] == digests[1]
    assert rows[-1]["stage2_ab/async/sync_total"] >= 4
    last = rows[-1]
    assert last["stage2_ab/async/rollouts_requested_total"] > 0
    # every burst makes 1..3 requests, and they are part of the prefetcher's busy time
    assert (
        0
        < last["stage2_ab/async/rollout_requests_total"]
        <= 3 * last["stage2_ab/async/prefetch_success_total"]
    )
    assert 0 < last["stage2_ab/async/rollout_request_s"] <= last["stage2_ab/async/prefetch_busy_s"]
    assert last["stage2_ab/async/drop_oldest_total"] == 0  # pacing never overfills the queue
    # one ready pack per micro-step, filled by tokens; a burst cut short by a waiting sync packs its first
    # request only (0.8 of the estimated need), so its packs may be less full
    floor = 0.8 if last["stage2_ab/async/bursts_cut_short_total"] == 0 else 0.6
    for r in (r for r in rows if r["kind"] == "B"):
        assert r["packing/fill"] >= floor
    assert (out / "rollout_server.log").read_text().count('"path": "/infer/"') > 0


def test_killed_server_skips_b_and_never_hangs(tmp_path: Path) -> None:
    """An external server is SIGKILLed mid-run: B steps are skipped (counted), Channel-A goes on, and
    the run ends on its own (completes, or exits with the outage error) well within the timeout."""
    server = start_server_process(
        [
            "--model",
            "builtin:tiny-qwen2.5-vl",
            "--port",
            "0",
            "--set",
            f"rollout_server.image_roots=[{Path.home()}]",
        ],
        cwd=ROOT,
        env={"OMP_NUM_THREADS": "1"},
    )
    cfg = async_config(
        tmp_path,
        training={"max_steps": 30},
        rollout_server={"embedded": False},
        custom={
            "extra": {
                "rollout_matching": {
                    "vllm": {"server": {"servers": [{"base_url": server.url}], "timeout_s": 20}}
                }
            }
        },
    )
    config = write_config(tmp_path / "cfg.yaml", cfg)
    proc = subprocess.Popen(
        [sys.executable, "-m", "stagectl", "train-ab", str(config)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        start_new_session=True,
    )
    metrics = tmp_path / "run" / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 180
        while not (metrics.exists() and metrics.read_text().count('"kind": "B"') >= 1):
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "no B step before the kill"
            time.sleep(0.2)
        server.proc.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        _, stderr = proc.communicate(timeout=240)
        elapsed = time.monotonic() - killed_at
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        server.stop()
    rows = read_metrics(tmp_path / "run")
    after = [r for r in rows if r["stage2_ab/async/prefetch_fail_total"] > 0]
    assert after, "the learner never noticed the dead server"
    assert any(r["stage2_ab/async/b_step_skipped_due_to_queue"] for r in after)
    assert any(r["kind"] == "A" for r in after)
    if proc.returncode != 0:
        assert "unreachable" in stderr or "weight sync" in stderr, stderr[-3000:]
    assert elapsed < 200


def test_injected_prefetch_fault_ends_every_rank(tmp_path: Path) -> None:
    cfg = async_config(tmp_path, training={"max_steps": 30})
    started = time.monotonic()
    args = ["train-ab", str(write_config(tmp_path / "cfg.yaml", cfg))]
    with fault_run(args, tmp_path, fault="raise_in_prefetch:1") as run:
        code = run.finish(240)
        assert not run.wait_no_leftovers(20)
    output = run.output()
    assert code != 0
    assert "prefetcher on rank 1 failed" in output and "injected prefetch fault" in output
    assert "Traceback" not in output  # one line, from rank 0
    assert time.monotonic() - started < 200
    rows = read_metrics(tmp_path / "run") if (tmp_path / "run" / "metrics.jsonl").exists() else []
    assert len(rows) < 30


def _sync_rows(rows: list[dict]) -> list[dict]:
    return [r for r in rows if "weight_sync/bytes" in r]


def test_async_with_delta_sync(tmp_path: Path) -> None:
    """The async example's setup with `sync.delta: true`: the first sync is full (no base yet), later
    ones are deltas against the version the server serves; every sync is logged with its figures. The
    embedded server holds a bearer token, so every call of the learner (rollouts, versions, chunks on the
    weight-stream port, commits) must carry it."""
    token = {"auth_token_env": "STAGECTL_TEST_EMBEDDED_TOKEN"}
    cfg = async_config(
        tmp_path,
        training={"max_steps": 6},
        custom={"extra": {"rollout_matching": {"vllm": {"sync": {"delta": True}, "server": token}}}},
        rollout_server=token,
    )
    out = tmp_path / "run"
    env = {"STAGECTL_TEST_EMBEDDED_TOKEN": "embedded-secret"}
    result = run_cli("train-ab", str(write_config(tmp_path / "cfg.yaml", cfg)), timeout=360, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    syncs = _sync_rows(read_metrics(out))
    assert len(syncs) >= 2
    assert syncs[0]["weight_sync/delta"] == 0  # nothing pushed before: full
    assert all(r["weight_sync/delta"] == 1 for r in syncs[1:])
    for r in syncs:
        assert 0 < r["weight_sync/bytes"] <= r["weight_sync/state_bytes"] + 64 * 1024  # + chunk headers
        assert 0 < r["weight_sync/step_fraction"] < 1 and r["weight_sync/mb_per_s"] > 0
    assert read_metrics(out)[-1]["rollout_client/delta_fallbacks"] == 0


def test_async_with_shm_sync(tmp_path: Path) -> None:
    cfg = async_config(
        tmp_path,
        training={"max_steps": 4},
        custom={"extra": {"rollout_matching": {"vllm": {"sync": {"transport": "shm"}}}}},
    )
    out = tmp_path / "run"
    before = set(Path("/dev/shm").glob("stagectl-*.safetensors"))
    result = run_cli("train-ab", str(write_config(tmp_path / "cfg.yaml", cfg)), timeout=360)
    assert result.returncode == 0, result.stderr[-3000:]
    syncs = _sync_rows(read_metrics(out))
    assert len(syncs) >= 1 and all(r["weight_sync/bytes"] == r["weight_sync/state_bytes"] for r in syncs)
    assert set(Path("/dev/shm").glob("stagectl-*.safetensors")) <= before  # every snapshot removed


def test_async_with_collective_sync(tmp_path: Path) -> None:
    """The async example over `transport: collective`: the learner forms a gloo weight group with the
    embedded server at its first sync and broadcasts every sync through it."""
    cfg = async_config(
        tmp_path,
        training={"max_steps": 4},
        custom={"extra": {"rollout_matching": {"vllm": {"sync": {"transport": "collective"}}}}},
    )
    out = tmp_path / "run"
    result = run_cli("train-ab", str(write_config(tmp_path / "cfg.yaml", cfg)), timeout=360)
    assert result.returncode == 0, result.stderr[-3000:]
    syncs = _sync_rows(read_metrics(out))
    assert len(syncs) >= 1 and all(r["weight_sync/bytes"] == r["weight_sync/state_bytes"] for r in syncs)
    server_log = (out / "rollout_server.log").read_text()
    assert server_log.count("joined weight group") == 1  # formed once, reused by every sync
    assert "/update_weights/group/finish/" in server_log and '"path": "/update_weights/"' not in server_log
