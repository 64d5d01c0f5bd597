"""`stagectl.rundir.policy`: when a directory holds a run, what refusing, resuming and overwriting do to it,
and that a failed start leaves nothing behind."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from stagectl.cli.app import app
from stagectl.rundir.policy import (
    DirSnapshot,
    RunDirPolicy,
    apply_policy,
    prepare_train_dir,
    train_run_summary,
)
from tests.unit.rundir.runs import finished_run, snapshot


def test_what_counts_as_a_run(tmp_path: Path) -> None:
    assert train_run_summary(tmp_path / "missing") is None
    failed_start = tmp_path / "failed"
    failed_start.mkdir()
    (failed_start / "config.yaml").write_text("x: 1\n")
    (failed_start / "metrics.jsonl").write_text("")
    assert train_run_summary(failed_start) is None  # a start that never trained a step: nothing to lose
    finished_run(tmp_path / "run", num_rows=24, checkpoints=(12, 24))
    assert train_run_summary(tmp_path / "run") == "24 metrics rows, checkpoint-12, checkpoint-24, finished"


def test_a_run_is_refused_without_a_choice_and_left_as_it_was(tmp_path: Path) -> None:
    out = tmp_path / "run"
    finished_run(out)
    before = snapshot(out)
    with pytest.raises(ValueError) as info:
        prepare_train_dir(out, resume=None, overwrite=False)
    message = str(info.value)
    assert message.startswith(f"training.output_dir: {out} already holds a run (3 metrics rows")
    assert "--resume" in message and "--overwrite" in message and "training.output_dir=NEW_DIR" in message
    assert snapshot(out) == before and sorted(os.listdir(tmp_path)) == ["run"]


def test_resume_continues_in_place_and_overwrite_moves_the_run_aside_whole(tmp_path: Path) -> None:
    out = tmp_path / "run"
    finished_run(out)
    before = snapshot(out)
    assert prepare_train_dir(out, resume="latest", overwrite=False) is None
    assert snapshot(out) == before
    note = prepare_train_dir(out, resume=None, overwrite=True)
    (aside,) = tmp_path.glob("run.replaced-*")
    assert (
        note
        == f"--overwrite: moved the previous run in {out} (3 metrics rows, checkpoint-2, finished) to {aside}; delete it when sure"
    )
    assert not out.exists() and snapshot(aside) == before
    finished_run(out)  # the same second: the next one gets its own name
    prepare_train_dir(out, resume=None, overwrite=True)
    assert len(list(tmp_path.glob("run.replaced-*"))) == 2
    assert prepare_train_dir(out, resume=None, overwrite=True) is None  # nothing there: nothing to do


def test_latest_with_no_checkpoint_in_a_run_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "run"
    finished_run(out, checkpoints=())
    with pytest.raises(ValueError, match="no complete checkpoint to continue from; pass --overwrite"):
        prepare_train_dir(out, resume="latest", overwrite=False)
    assert prepare_train_dir(tmp_path / "new", resume="latest", overwrite=False) is None  # a first start


def test_resume_and_overwrite_together_are_refused() -> None:
    with pytest.raises(ValueError, match="contradict"):
        RunDirPolicy(resume=True, overwrite=True)
    result = CliRunner().invoke(app, ["train-ab", "cfg.yaml", "--resume", "--overwrite"])
    assert result.exit_code == 1 and "--resume and --overwrite contradict each other" in result.output


def test_eval_out_holding_results_is_refused_unless_overwrite(tmp_path: Path) -> None:
    out = tmp_path / "eval"
    out.mkdir()
    (out / "metrics.json").write_text('{"AP": 0.5}\n')
    config = tmp_path / "cfg.yaml"
    config.write_text(
        "data: {synthetic: {num_samples: 2}, eval: {synthetic: {num_samples: 2, seed: 1}}}\n"
        "stage2_ab: {schedule: {b_ratio: 0.0}}\n"
    )
    refused = CliRunner().invoke(app, ["eval", str(config), "--out", str(out)])
    assert refused.exit_code == 1
    assert (
        f"--out: {out} already holds a run (metrics.json)" in refused.output
        and "--resume" not in refused.output
    )
    assert (out / "metrics.json").read_text() == '{"AP": 0.5}\n'
    with pytest.raises(ValueError, match="--overwrite to move"):
        apply_policy(
            out, "metrics.json", RunDirPolicy(), key="--out", command="--out NEW_DIR", can_resume=False
        )


def test_undo_failed_start_removes_only_what_the_start_created(tmp_path: Path) -> None:
    fresh = tmp_path / "fresh"
    before = DirSnapshot.take(fresh)
    fresh.mkdir()
    (fresh / "config.yaml").write_text("x: 1\n")
    (fresh / "metrics.jsonl").write_text("")
    (fresh / "samples.jsonl").write_text("")  # the trainer opens it before its first step
    (fresh / "weight_sync").mkdir()
    assert before.undo_failed_start() and not fresh.exists()

    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "notes.txt").write_text("mine")
    (kept / "config.yaml").write_text("old\n")
    before = DirSnapshot.take(kept)
    (kept / "wandb_run_id").write_text("abc\n")
    assert before.undo_failed_start()
    assert sorted(os.listdir(kept)) == [
        "config.yaml",
        "notes.txt",
    ]  # the user's file and the earlier one stay

    trained = tmp_path / "trained"
    before = DirSnapshot.take(trained)
    trained.mkdir()
    (trained / "metrics.jsonl").write_text('{"step": 0}\n')
    assert not before.undo_failed_start() and (trained / "metrics.jsonl").exists()  # a step ran: keep it
