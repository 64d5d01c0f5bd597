"""Async actor-learner end to end on one CPU machine: 2 torchrun learner ranks + a rollout server."""

from __future__ import annotations

import json
import time
from pathlib import Path

from stagectl import metric_keys
from tests.faults.helpers import fault_run
from tests.integration.helpers import (
    async_config,
    check_async_invariants,
    check_phase_times,
    read_metrics,
    run_cli,
    write_config,
)


def test_example_async_config_completes_with_delta_sync_behind_a_token(tmp_path: Path) -> None:
    """The async example (2 ranks, embedded server, http sync) with `sync.delta: true` and a bearer token
    on the embedded server: the one end-to-end run of this topology. Every call of the learner (rollouts,
    versions, chunks on the weight-stream port, commits) must carry the token; the first sync is full (no
    base yet), later ones are deltas against the version the server serves, each logged with its figures.
    The other transports are covered in process: `test_weight_sync_collective.py` (a gloo weight group
    formed once and reused), `tests/faults/test_disk_faults.py` (disk pushes, no snapshot left behind),
    and `test_weight_sync_fsdp.py` (every transport from inside 2 torchrun ranks)."""
    out = tmp_path / "run"
    sets = {
        "training.output_dir": str(out),
        "custom.extra.rollout_matching.vllm.sync.delta": "true",
        "custom.extra.rollout_matching.vllm.server.auth_token_env": "STAGECTL_TEST_EMBEDDED_TOKEN",
        "rollout_server.auth_token_env": "STAGECTL_TEST_EMBEDDED_TOKEN",
    }
    overrides = [arg for key, value in sets.items() for arg in ("--set", f"{key}={value}")]
    env = {"STAGECTL_TEST_EMBEDDED_TOKEN": "embedded-secret"}
    result = run_cli("train-ab", "examples/tiny/train_ab_async.yaml", *overrides, timeout=360, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "embedded rollout server: http://127.0.0.1:" in result.stderr
    rows = read_metrics(out)
    assert len(rows) == 16
    # every key the run wrote is declared once in the catalog docs/reference/metrics.md is generated from
    assert metric_keys.undeclared(key for row in rows for key in row) == []
    check_async_invariants(rows, window=1)
    check_phase_times(rows)
    synced = [r for r in rows if "weight_sync/bytes" in r]
    assert synced and all(r["time/weight_sync_s"] > 0 for r in synced)
    assert sum(r["time/prefetch_build_s"] for r in rows) > 0  # the prefetcher thread built the packs
    assert sum(r["kind"] == "B" for r in rows) >= 3
    assert rows[1]["kind"] == "B"  # the first B step waits for the first burst (it raced it before)
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
    # one ready pack per micro-step, filled by tokens: a burst's first request asks for its whole need, so
    # a burst cut short by a sync still fills its packs (B fill 0.92-0.94 a run; 0.74-0.77 when it asked for
    # 80% of the need rounded down to whole batches); every B row logs it as packing/b_fill
    b_fills = [r["packing/b_fill"] for r in rows if r["kind"] == "B"]
    assert b_fills == [r["packing/fill"] for r in rows if r["kind"] == "B"]
    assert min(b_fills) >= 0.8 and sum(b_fills) / len(b_fills) >= 0.85
    assert all("packing/b_fill" not in r for r in rows if r["kind"] == "A")
    assert (out / "rollout_server.log").read_text().count('"path": "/infer/"') > 0
    assert synced[0]["weight_sync/delta"] == 0  # nothing pushed before: full
    assert all(r["weight_sync/delta"] == 1 for r in synced[1:])
    for r in synced:
        assert 0 < r["weight_sync/bytes"] <= r["weight_sync/state_bytes"] + 64 * 1024  # + chunk headers
        assert 0 < r["weight_sync/step_fraction"] < 1 and r["weight_sync/mb_per_s"] > 0
    assert last["weight_sync/delta_fallbacks"] == 0
    # the Channel-B gallery (gallery_steps defaults to 4): rank 0 recorded trained B steps after their update
    b_rows = {r["step"]: r for r in rows if r["kind"] == "B"}
    records = [json.loads(line) for line in (out / "b_gallery" / "records.jsonl").read_text().splitlines()]
    assert records and all(
        rec["step"] in b_rows and b_rows[rec["step"]]["time/b_gallery_s"] > 0 for rec in records
    )
    assert all((out / "b_gallery" / rec["image"]).is_file() and rec["tokens"] for rec in records)
    # each names the policy version its rollout came from: the version of the packs its step trained
    assert all(rec["gen_version"] == b_rows[rec["step"]]["stage2_ab/async/ver_trained"] for rec in records)


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
