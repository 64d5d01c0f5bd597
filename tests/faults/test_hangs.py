"""Never hangs: a rank frozen mid-step or mid-sync, a killed launcher, a killed "node" — every process of
the run ends, non-zero, within the watchdog deadline plus a few seconds, with the phase named; and the
soak of ordinary 2-rank runs (`STAGECTL_SOAK_RUNS`, default 2; the async one trains
`STAGECTL_SOAK_ASYNC_STEPS`, default 4, steps a run) that must all exit 0 and leave nothing.

A frozen rank (SIGSTOP) is the hard case: it keeps its sockets open, so its peers see no error; only
their watchdog ends them, and only the launcher can end the frozen one (SIGKILL)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from tests.faults.helpers import FaultRun, fault_run, report
from tests.integration.helpers import (
    async_config,
    read_metrics,
    stage_b_config,
    tiny_train_config,
    write_config,
)

STEP_S = 5.0  # the watchdog deadline these tests set (real runs: 600 s; a tiny step takes under 1 s)
SLACK_S = 10.0  # "every process gone within the deadline + 10 s"


def _watchdog(**over: float) -> dict[str, float]:
    return {"startup_s": 300.0, "step_s": STEP_S, "weight_sync_s": STEP_S, "shutdown_s": 60.0, **over}


def _all_gone_after_fault(run: FaultRun, deadline_s: float) -> float:
    """Seconds from the injected fault until no process of the run is left (fails past the deadline)."""
    (fault_at,) = run.fault_times()
    left = run.wait_no_leftovers(max(0.0, fault_at + deadline_s - time.time()) + 1.0)
    assert not left, [(e["pid"], e["argv"][:4]) for e in left]
    return time.time() - fault_at


def test_rank_frozen_mid_step_ends_every_process_with_the_phase_named(tmp_path: Path) -> None:
    cfg = tiny_train_config(
        tmp_path,
        stage2_ab={"schedule": {"b_ratio": 0.0}},
        training={"max_steps": 20},
        launch={"nproc_per_node": 2, "watchdog": _watchdog()},
    )
    config = write_config(tmp_path / "cfg.yaml", cfg)
    with fault_run(["train-ab", str(config)], tmp_path, fault="stop_in_micro_step:1:3") as run:
        code = run.finish(STEP_S + SLACK_S + 120)
        gone_s = _all_gone_after_fault(run, STEP_S + SLACK_S)
    output = run.output()
    assert code != 0, output[-3000:]
    assert (
        f"watchdog: phase 'forward/backward' did not finish within {STEP_S:g} s (launch.watchdog.step_s)"
        in output
    )
    assert "blocked in collective DDP gradient all-reduce" in output
    assert "rank 1 (local rank 1" in output and "killed by SIGKILL" in output  # the frozen one, named
    assert "Traceback" not in output.split("this rank's stacks follow")[0]
    assert "ChildFailedError" not in output
    report(
        fault="train-ab 2 ranks: rank 1 frozen (SIGSTOP) mid-step",
        failed_cleanly=True,
        exit_code=code,
        all_processes_gone_s=round(gone_s, 1),
        processes=run.num_processes(),
    )


def test_rank_frozen_mid_weight_sync_ends_every_process(tmp_path: Path) -> None:
    cfg = async_config(tmp_path, training={"max_steps": 30}, launch={"watchdog": _watchdog()})
    config = write_config(tmp_path / "cfg.yaml", cfg)
    with fault_run(["train-ab", str(config)], tmp_path, fault="stop_in_push:1") as run:
        code = run.finish(STEP_S + SLACK_S + 180)
        gone_s = _all_gone_after_fault(run, STEP_S + SLACK_S)
        assert run.num_processes() == 5  # CLI, server, torchrun, 2 ranks
    output = run.output()
    assert code != 0
    assert (
        f"watchdog: phase 'weight sync' did not finish within {STEP_S:g} s (launch.watchdog.weight_sync_s)"
        in output
    )
    assert "ChildFailedError" not in output
    report(
        fault="train-ab async: rank 0 frozen (SIGSTOP) inside a weight push",
        failed_cleanly=True,
        exit_code=code,
        all_processes_gone_s=round(gone_s, 1),
        processes=5,
    )


def test_sigkill_of_the_launcher_leaves_no_process(tmp_path: Path) -> None:
    """The CLI is SIGKILLed mid-run (a test harness timing out, an OOM killer): torchrun dies with it,
    each rank's watchdog sees its parent gone, and the embedded rollout server stops."""
    cfg = async_config(tmp_path, training={"max_steps": 200}, launch={"watchdog": _watchdog()})
    config = write_config(tmp_path / "cfg.yaml", cfg)
    with fault_run(["train-ab", str(config)], tmp_path) as run:
        run.wait_for(lambda: (tmp_path / "run" / "metrics.jsonl").exists(), 240, "the first metrics row")
        killed_at = time.time()
        os.kill(run.proc.pid, signal.SIGKILL)
        run.proc.wait()
        left = run.wait_no_leftovers(SLACK_S)
        gone_s = time.time() - killed_at
    assert not left, [(e["pid"], e["argv"][:4]) for e in left]
    report(
        fault="train-ab async: the stagectl launcher SIGKILLed mid-run",
        failed_cleanly=True,
        exit_code=-int(signal.SIGKILL),
        all_processes_gone_s=round(gone_s, 1),
        processes=run.num_processes(),
    )


# ------------------------------------------------------------------ soak

SOAK_RUNS = int(os.environ.get("STAGECTL_SOAK_RUNS", "2"))
# The async soak checks the shutdown of a run with syncs and rollouts in flight, which every step of its
# B-only, sync-every-step setup has; the step count only lengthens each run (the long soak: 24).
SOAK_ASYNC_STEPS = int(os.environ.get("STAGECTL_SOAK_ASYNC_STEPS", "4"))


def _soak(tmp_path: Path, args: list[str], name: str, timeout_s: float) -> list[float]:
    seconds = []
    for k in range(SOAK_RUNS):
        started = time.monotonic()
        # the same run again: --overwrite moves the previous one aside (a no-op on the first)
        with fault_run([*args, "--overwrite"], tmp_path, name=f"{name}-{k}") as run:
            code = run.finish(timeout_s)
            assert code == 0, f"{name} run {k + 1} of {SOAK_RUNS} exited {code}:\n{run.tail()}"
            left = run.wait_no_leftovers(5.0)
            assert not left, f"{name} run {k + 1}: left {[(e['pid'], e['argv'][:4]) for e in left]}"
            assert "Traceback" not in run.output() and "terminate called" not in run.output()
        seconds.append(time.monotonic() - started)
    return seconds


def test_soak_two_rank_a_only_train_ab(tmp_path: Path) -> None:
    cfg = tiny_train_config(
        tmp_path,
        stage2_ab={"schedule": {"b_ratio": 0.0}},
        training={"max_steps": 3, "save_steps": 0},
        launch={"nproc_per_node": 2, "watchdog": _watchdog(step_s=120.0)},
    )
    config = write_config(tmp_path / "cfg.yaml", cfg)
    seconds = _soak(tmp_path, ["train-ab", str(config)], "a-only", 120)
    report(fault=f"soak: 2-rank A-only train-ab x{SOAK_RUNS}", runs=SOAK_RUNS, max_s=round(max(seconds), 1))


def test_soak_two_rank_stage_b(tmp_path: Path) -> None:
    config = write_config(tmp_path / "cfg.yaml", stage_b_config(tmp_path))
    seconds = _soak(tmp_path, ["stage-b", str(config), "--nproc", "2"], "stage-b", 120)
    report(fault=f"soak: 2-rank stage-b x{SOAK_RUNS}", runs=SOAK_RUNS, max_s=round(max(seconds), 1))


@pytest.mark.slow
def test_soak_async_shutdown(tmp_path: Path) -> None:
    """The configuration that once died with SIGABRT after "done" (about one run in five, at teardown):
    batch 1, decode 8, queue 3, target 2, sync every step, B only; 4 steps a run, each with a sync and
    rollouts in flight, so every run ends in the teardown that aborted (the bug report's 24 steps with
    `STAGECTL_SOAK_ASYNC_STEPS=24`)."""
    cfg = async_config(
        tmp_path,
        global_max_length=2048,
        training={"per_device_train_batch_size": 1, "max_steps": SOAK_ASYNC_STEPS},
        stage2_ab={
            "schedule": {"b_ratio": 1.0},
            "channel_b": {
                "rollout_decode_batch_size": 8,
                "async": {"queue_limit": 3, "prefetch_target_packs": 2, "sync_every_steps": 1},
            },
        },
        launch={"watchdog": _watchdog(step_s=120.0)},
    )
    config = write_config(tmp_path / "cfg.yaml", cfg)
    seconds = _soak(tmp_path, ["train-ab", str(config)], "async", 300)
    rows = read_metrics(tmp_path / "run")
    assert len(rows) == SOAK_ASYNC_STEPS
    report(fault=f"soak: async shutdown x{SOAK_RUNS}", runs=SOAK_RUNS, max_s=round(max(seconds), 1))
