"""`stagectl.rundir`: when a directory holds a run, what refusing, resuming and overwriting do to it, and
that a failed start leaves nothing behind."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from stagectl.cli.app import app
from stagectl.files import check_output_dir, follow_umask
from stagectl.rundir import (
    DirSnapshot,
    RunDirPolicy,
    RunEnd,
    abort_note,
    apply_policy,
    check_resume_world_size,
    config_changes,
    keep_config_before_resume,
    prepare_train_dir,
    read_run_end,
    run_end,
    stop_note,
    train_run_summary,
)


def finished_run(out: Path, num_rows: int = 3, checkpoints: tuple[int, ...] = (2,)) -> None:
    out.mkdir(parents=True)
    (out / "config.yaml").write_text("training: {}\n")
    (out / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(num_rows)))
    for step in checkpoints:
        (out / f"checkpoint-{step}").mkdir()
        (out / f"checkpoint-{step}" / "trainer_state.json").write_text("{}")
    last = max(checkpoints, default=0)
    end = {"global_step": last, "max_steps": last, "stopped_by_signal": None}
    (out / "final_state.json").write_text(json.dumps(end))


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_what_counts_as_a_run(tmp_path: Path) -> None:
    assert train_run_summary(tmp_path / "missing") is None
    failed_start = tmp_path / "failed"
    failed_start.mkdir()
    (failed_start / "config.yaml").write_text("x: 1\n")
    (failed_start / "metrics.jsonl").write_text("")
    assert train_run_summary(failed_start) is None  # a start that never trained a step: nothing to lose
    finished_run(tmp_path / "run", num_rows=24, checkpoints=(12, 24))
    assert train_run_summary(tmp_path / "run") == "24 metrics rows, checkpoint-12, checkpoint-24, finished"


def test_a_run_a_signal_stopped_is_not_called_finished(tmp_path: Path) -> None:
    """final_state.json is written on a signal stop too: the steps done against max_steps decide, also for
    a file from before it held max_steps (config.yaml's) or the signal."""
    out = tmp_path / "run"
    finished_run(out, num_rows=8, checkpoints=(5, 8))
    (out / "final_state.json").write_text(
        json.dumps({"global_step": 8, "max_steps": 200, "stopped_by_signal": 2})
    )
    assert (
        train_run_summary(out)
        == "8 metrics rows, checkpoint-5, checkpoint-8, stopped at step 8 of 200 (SIGINT)"
    )
    with pytest.raises(ValueError, match=r"stopped at step 8 of 200 \(SIGINT\)"):
        prepare_train_dir(out, resume=None, overwrite=False)
    (out / "final_state.json").write_text(json.dumps({"global_step": 8}))  # an older file
    (out / "config.yaml").write_text("training: {max_steps: 200}\n")
    assert read_run_end(out) == RunEnd(step=8, max_steps=200, stopped_by_signal=None)
    assert train_run_summary(out).endswith("stopped at step 8 of 200")  # type: ignore[union-attr]
    (out / "config.yaml").write_text("training: {max_steps: 8}\n")
    assert train_run_summary(out).endswith(", finished")  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("final_state", "described"),
    [
        ({"global_step": 24, "max_steps": 24, "stopped_by_signal": None}, "finished"),
        # a signal that came during the last step: every step was trained
        ({"global_step": 24, "max_steps": 24, "stopped_by_signal": 15}, "finished"),
        ({"global_step": 3, "max_steps": 24, "stopped_by_signal": 15}, "stopped at step 3 of 24 (SIGTERM)"),
        ({"global_step": 3, "stopped_by_signal": 2}, "stopped at step 3 (SIGINT)"),
        ({"global_step": 3}, "finished"),  # nothing to judge by: as before
    ],
)
def test_run_end_reads_steps_done_against_max_steps(final_state: dict[str, object], described: str) -> None:
    assert run_end(final_state).describe() == described


def test_the_stop_lines_name_the_signal_and_the_whole_continue_command(tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert stop_note(2, 6, 200, out) == (
        f"stopped by SIGINT after step 6 of 200; checkpoint saved ({out / 'checkpoint-6'}). "
        f"Continue with: stagectl train-ab {out / 'config.yaml'} --resume"
    )
    assert abort_note(2, out) == (
        "a second SIGINT stopped the run at once, without a checkpoint: no checkpoint was written "
        "(nothing to resume from)"
    )
    finished_run(out, checkpoints=(4, 6))
    (out / "checkpoint-8").mkdir()  # being written when the second signal came: no trainer_state.json
    assert abort_note(15, out) == (
        f"a second SIGTERM stopped the run at once, without a checkpoint: the last good checkpoint is "
        f"{out / 'checkpoint-6'}; continue with: stagectl train-ab {out / 'config.yaml'} --resume"
    )


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


def test_the_write_check_leaves_no_directory_behind(tmp_path: Path) -> None:
    check_output_dir(tmp_path / "a" / "b" / "run")
    assert os.listdir(tmp_path) == []
    (tmp_path / "existing").mkdir()
    check_output_dir(tmp_path / "existing")
    assert os.listdir(tmp_path / "existing") == []


def test_follow_umask_opens_up_a_library_written_tree(tmp_path: Path) -> None:
    model = tmp_path / "model"
    (model / "sub").mkdir(parents=True)
    for path in (model / "model.safetensors", model / "sub" / "x.json"):
        path.write_text("x")
        path.chmod(0o600)
    model.chmod(0o700)
    umask = os.umask(0o022)
    try:
        follow_umask(model)
    finally:
        os.umask(umask)
    assert {stat.S_IMODE(p.stat().st_mode) for p in (model, model / "sub")} == {0o755}
    assert {stat.S_IMODE(p.stat().st_mode) for p in model.rglob("*") if p.is_file()} == {0o644}


def test_a_resume_that_changes_the_config_keeps_the_old_one_and_lists_each_change(tmp_path: Path) -> None:
    import yaml

    out = tmp_path / "run"
    finished_run(out, checkpoints=(4, 6))
    saved: dict[str, Any] = {
        "training": {"learning_rate": 0.002, "max_steps": 6, "resume_from_checkpoint": None},
        "stage2_ab": {"schedule": {"b_ratio": 0.5}},
        "data": {"synthetic": {"seed": 0}},
    }
    (out / "config.yaml").write_text(yaml.safe_dump(saved))
    original = (out / "config.yaml").read_bytes()
    # what a resume sets itself is no change
    same = {**saved, "training": {**saved["training"], "resume_from_checkpoint": "latest"}}
    assert keep_config_before_resume(out, same, "latest") is None
    assert not (out / "config.step-6.yaml").exists()
    new = {
        "training": {"learning_rate": 0.001, "max_steps": 12, "resume_from_checkpoint": "latest"},
        "stage2_ab": {"schedule": {"b_ratio": 0.25}},
        "data": {"synthetic": {"seed": 0}},
    }
    warning = keep_config_before_resume(out, new, "latest")
    assert warning is not None and warning.startswith(
        "warning: the resumed config differs from the one that trained checkpoint-6 (3 keys): "
        "stage2_ab.schedule.b_ratio: 0.5 -> 0.25; training.learning_rate: 0.002 -> 0.001; "
        "training.max_steps: 6 -> 12."
    )
    assert str(out / "config.step-6.yaml") in warning
    assert (out / "config.step-6.yaml").read_bytes() == original
    # a second changed resume from the same checkpoint keeps the config that trained it, not the newer one
    (out / "config.yaml").write_text(yaml.safe_dump(new))
    assert keep_config_before_resume(out, saved, "latest") is not None
    assert (out / "config.step-6.yaml").read_bytes() == original
    # nothing to resume from: nothing to compare
    assert keep_config_before_resume(tmp_path / "none", new, "latest") is None


def test_config_changes_names_added_and_removed_keys() -> None:
    assert config_changes({"a": {"b": 1, "c": [1, 2]}}, {"a": {"b": 1, "c": [1, 3], "d": "x"}}) == [
        ("a.c", [1, 2], [1, 3]),
        ("a.d", "<unset>", "x"),
    ]


def test_a_resume_in_another_world_size_is_refused_before_anything_starts(tmp_path: Path) -> None:
    out = tmp_path / "run"
    finished_run(out, checkpoints=(4, 6))
    (out / "checkpoint-6" / "trainer_state.json").write_text(json.dumps({"data_state": {"world_size": 2}}))
    check_resume_world_size(out, "latest", 2)
    check_resume_world_size(out, None, 1)  # a new run: nothing to check
    with pytest.raises(
        ValueError, match=r"checkpoint-6 was written by 2 rank\(s\) but this run has 1.*--nproc 2"
    ):
        check_resume_world_size(out, "latest", 1)
    check_resume_world_size(out, out / "checkpoint-4", 1)  # no world size recorded: the ranks check it
