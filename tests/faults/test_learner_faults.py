"""Learner faults, on the real CLI with the tiny model: SIGKILL in the middle of a checkpoint write,
Ctrl-C of a multi-rank run, a disk that fills up or a directory that turns read-only at a save, and an
unwritable output directory at start-up. Whatever happens, the previous checkpoint stays whole and
loadable, no metrics row is lost or doubled, and no process is left behind."""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from stagectl.learner.checkpoint import list_checkpoints, load_trainer_state
from stagectl.schedule import channel_for_step
from tests.faults.helpers import fault_run, report
from tests.integration.helpers import (
    async_config,
    check_async_invariants,
    read_metrics,
    run_cli,
    tiny_train_config,
    write_config,
)


def assert_checkpoint_intact(path: Path, step: int) -> None:
    """Everything a resume reads is there and loads (weights_only, like the resume path)."""
    assert load_trainer_state(path).global_step == step
    assert load_file(str(path / "model" / "model.safetensors"))  # HF weights, not truncated
    assert json.loads((path / "model" / "config.json").read_text())["model_type"]
    for name in ("optimizer.pt", "scheduler.pt", "rng.pt"):
        torch.load(path / name, weights_only=True)


def test_sigkill_during_a_checkpoint_write_keeps_the_previous_one_and_resume_reproduces(
    tmp_path: Path,
) -> None:
    """Step mode, b_ratio 0.5, checkpoints every 2 steps; the learner is SIGKILLed half-way through
    writing checkpoint-4. checkpoint-2 is whole, `latest` resumes from it, and steps 2-3 come out
    again exactly as before the kill (same channels, losses, rollout seeds)."""
    cfg = tiny_train_config(tmp_path, training={"max_steps": 6, "save_steps": 2})
    config = write_config(tmp_path / "cfg.yaml", cfg)
    out = tmp_path / "run"
    with fault_run(["train-ab", str(config)], tmp_path, fault="kill_in_checkpoint:4", name="killed") as run:
        assert run.finish(300) == -signal.SIGKILL, run.tail()
        assert run.fault_times() and not run.wait_no_leftovers(5)
    before = read_metrics(out)
    assert [r["step"] for r in before] == [0, 1, 2, 3]
    assert list_checkpoints(out) == [out / "checkpoint-2"]  # checkpoint-4 never became visible
    (partial,) = out.glob(".tmp-checkpoint-4-*")
    assert (partial / "model" / "model.safetensors").is_file() and not (partial / "optimizer.pt").exists()
    assert_checkpoint_intact(out / "checkpoint-2", 2)

    resumed = run_cli("train-ab", str(config), "--set", "training.resume_from_checkpoint=latest", timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == list(range(6))  # every step exactly once: nothing lost or doubled
    assert [r["kind"] for r in rows] == [channel_for_step(s, 0.5) for s in range(6)]
    for again, first in zip(rows[2:4], before[2:4], strict=True):
        assert again["kind"] == first["kind"]
        assert again["loss"] == pytest.approx(first["loss"], rel=1e-4)
        assert again.get("rollout/seed") == first.get("rollout/seed")
    assert list_checkpoints(out) == [out / f"checkpoint-{s}" for s in (2, 4, 6)]
    assert not list(out.glob(".tmp-checkpoint-*"))  # the next save cleared the partial write
    report(fault="SIGKILL during checkpoint write", survived=True, resumed_from=2, data_lost=0)


def test_ctrl_c_on_a_two_rank_async_run_saves_and_leaves_nothing(tmp_path: Path) -> None:
    """Ctrl-C (SIGINT to the foreground process group: the CLI and torchrun; the embedded server runs in
    its own session) during a 2-rank async run: the ranks finish their step against a live server, save a
    final checkpoint and exit, the launcher stops the server last (never restarted) and exits 130; every
    process of the run is gone within seconds."""
    cfg = async_config(tmp_path, training={"max_steps": 400})
    config = write_config(tmp_path / "cfg.yaml", cfg)
    out = tmp_path / "run"
    with fault_run(["train-ab", str(config)], tmp_path) as run:
        metrics = out / "metrics.jsonl"
        run.wait_for(
            lambda: metrics.exists() and metrics.read_text().count('"kind": "B"') >= 1, 240, "a B step"
        )
        os.killpg(run.proc.pid, signal.SIGINT)
        interrupted = time.monotonic()
        code = run.finish(120)
        left = run.wait_no_leftovers(60)
        gone_after = time.monotonic() - interrupted
        assert not left, [e["argv"] for e in left]
    output = run.output()
    assert code == 130, output[-3000:]
    # the launcher hands Ctrl-C to each rank as SIGINT (torchrun runs in its own session)
    assert "stopped by SIGINT after step" in output and "checkpoint saved" in output
    assert "restarting it" not in output and "Connection refused" not in output
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == list(range(len(rows)))
    last = list_checkpoints(out)[-1]
    assert last == out / f"checkpoint-{len(rows)}"  # the final checkpoint holds the last logged step
    assert_checkpoint_intact(last, len(rows))
    report(
        fault="Ctrl-C (SIGINT to the process group), 2 ranks + embedded server",
        survived=True,
        steps_done=len(rows),
        cli_exit_code=code,
        all_processes_gone_s=round(gone_after, 1),
        data_lost=0,
    )


def test_sigterm_to_the_cli_stops_every_rank(tmp_path: Path) -> None:
    """What a scheduler or `kill PID` does: SIGTERM to the launcher process only."""
    cfg = tiny_train_config(tmp_path, training={"max_steps": 400}, stage2_ab={"schedule": {"b_ratio": 0.0}})
    config = write_config(tmp_path / "cfg.yaml", cfg)
    with fault_run(["train-ab", str(config), "--nproc", "2"], tmp_path) as run:
        metrics = tmp_path / "run" / "metrics.jsonl"
        run.wait_for(lambda: metrics.exists() and metrics.read_text().count("\n") >= 1, 240, "a step")
        run.proc.send_signal(signal.SIGTERM)
        code = run.finish(60)
        left = run.wait_no_leftovers(5)
    assert not left, f"{len(left)} processes still running after the CLI exited with {code}"
    assert code == 128 + signal.SIGTERM


@contextmanager
def read_only(path: Path) -> Iterator[None]:
    """Make directory `path` unwritable, even for root (chattr +i); skip when the system cannot."""
    if os.geteuid() != 0:
        path.chmod(0o555)
    elif shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(path)]).returncode != 0:
        pytest.skip("cannot make a directory read-only here (root without chattr +i)")
    try:
        probe = path / ".probe"
        try:
            probe.write_text("x")
        except OSError:
            pass
        else:
            probe.unlink()
            pytest.skip("the directory is still writable")
        yield
    finally:
        if os.geteuid() == 0:
            subprocess.run(["chattr", "-i", str(path)])
        path.chmod(0o755)


def test_an_unwritable_output_dir_fails_before_training(tmp_path: Path) -> None:
    out = tmp_path / "run"
    out.mkdir()
    cfg = tiny_train_config(tmp_path, training={"output_dir": str(out)})
    config = write_config(tmp_path / "cfg.yaml", cfg)
    with read_only(out):
        started = time.monotonic()
        result = run_cli("train-ab", str(config), timeout=120)
        elapsed = time.monotonic() - started
    assert result.returncode == 1
    first = result.stderr.strip().splitlines()[0]
    assert first.startswith("error: training.output_dir: cannot write to") and str(out) in first
    assert "Traceback" not in result.stderr
    assert list(out.iterdir()) == []
    report(fault="read-only output dir at start", failed_cleanly=True, exit_s=round(elapsed, 1), data_lost=0)


@pytest.mark.parametrize("fault", ["disk full", "read-only dir"])
def test_a_failing_save_is_a_clear_error_and_keeps_the_previous_checkpoint(
    tmp_path: Path, fault: str
) -> None:
    """After checkpoint-2 the disk "fills up" (RLIMIT_FSIZE on the learner: writes past a size fail with
    EFBIG, as ENOSPC would) or the run directory turns read-only: the next save fails with a message
    naming the checkpoint it could not write and the intact one, and nothing after it is lost."""
    cfg = tiny_train_config(
        tmp_path, training={"max_steps": 400, "save_steps": 2}, stage2_ab={"schedule": {"b_ratio": 0.0}}
    )
    config = write_config(tmp_path / "cfg.yaml", cfg)
    out = tmp_path / "run"
    with fault_run(["train-ab", str(config)], tmp_path) as run:
        run.wait_for(lambda: (out / "checkpoint-2").is_dir(), 240, "checkpoint-2")
        if fault == "disk full":
            limit = (out / "metrics.jsonl").stat().st_size + 256 * 1024  # the weights are MBs
            resource.prlimit(run.proc.pid, resource.RLIMIT_FSIZE, (limit, limit))
            code = run.finish(240)
        else:
            with read_only(out):
                code = run.finish(240)
        assert not run.wait_no_leftovers(10)
    output = run.output()
    assert code == 1, output[-3000:]
    assert "error: cannot write checkpoint-" in output and "Traceback" not in output, output[-3000:]
    failed_step = int(output.split("cannot write checkpoint-")[1].split()[0])
    intact = list_checkpoints(out)
    assert f"the newest intact checkpoint is {intact[-1]}" in output
    assert intact[-1] == out / f"checkpoint-{failed_step - 2}"
    assert_checkpoint_intact(intact[-1], failed_step - 2)
    if fault == "disk full":  # a read-only dir may keep the partial write until it is writable again
        assert not list(out.glob(".tmp-checkpoint-*"))  # the partial write was removed
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == list(range(failed_step))  # logged up to the failed save
    report(fault=f"{fault} at a save", failed_cleanly=True, failed_save=failed_step, data_lost=0)


def test_slow_server_late_packs_train_as_a_and_are_reported(tmp_path: Path) -> None:
    """Every `/infer/` of the embedded server takes 5 s: the first B step (step 2) waits for the
    prefetcher's first burst and trains as B; the next burst, begun at the current version (no weight sync
    in these 4 steps), is not waited for, so step 4's packs are late and it trains as Channel-A (part of
    the async design, not a lost server): the run completes, its line says `A (B wanted: queue_empty)`, and
    the summary line and final_state.json count it as `queue_empty` (never `no_server`: the server is up)."""
    cfg = async_config(
        tmp_path,
        training={"max_steps": 4},
        stage2_ab={"channel_b": {"async": {"sync_every_steps": 4}}},
    )
    config = write_config(tmp_path / "cfg.yaml", cfg)
    with fault_run(["train-ab", str(config)], tmp_path, fault="slow_infer:5000") as run:
        code = run.finish(300)
        assert not run.wait_no_leftovers(10)
    assert code == 0, run.tail()
    rows = read_metrics(tmp_path / "run")
    assert len(rows) == 4
    check_async_invariants(rows, window=1)
    assert rows[1]["kind"] == "B", run.tail()  # the start-up wait
    skipped = sum(r["stage2_ab/async/b_step_skipped_due_to_queue"] for r in rows)
    assert skipped >= 1
    assert "A (B wanted: " in run.output()
    b_steps = json.loads((tmp_path / "run" / "final_state.json").read_text())["b_steps"]
    assert b_steps["b_steps_wanted"] == 2 and b_steps["b_steps_trained"] == 2 - skipped
    assert set(b_steps["b_steps_as_a"]) <= {"queue_empty", "gate"}  # late packs, on one rank or both
    assert sum(b_steps["b_steps_as_a"].values()) == skipped
    assert f"B steps: 2 wanted, {2 - skipped} trained; {skipped} as Channel-A (" in run.output()
