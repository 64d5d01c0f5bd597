"""`stagectl.rundir.resume`: what a `--resume` checks before anything starts (world size, a changed
config)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from stagectl.rundir.resume import (
    check_resume_world_size,
    config_change_note,
    config_changes,
    continuation_config,
    keep_config_before_resume,
    latest_complete_checkpoint,
    record_resume,
    set_aside_later_checkpoints,
)
from tests.unit.rundir.runs import finished_run


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
    assert config_change_note(out, same, "latest") is None
    assert keep_config_before_resume(out, same, "latest") is None
    assert not (out / "config.step-6.yaml").exists()
    new = {
        "training": {"learning_rate": 0.001, "max_steps": 12, "resume_from_checkpoint": "latest"},
        "stage2_ab": {"schedule": {"b_ratio": 0.25}},
        "data": {"synthetic": {"seed": 0}},
    }
    # the launcher's warning writes nothing: a resume its ranks then refuse leaves the run as it was
    warning = config_change_note(out, new, "latest")
    assert warning is not None and warning.startswith(
        "warning: the resumed config differs from the one that trained checkpoint-6 (3 keys): "
        "stage2_ab.schedule.b_ratio: 0.5 -> 0.25; training.learning_rate: 0.002 -> 0.001; "
        "training.max_steps: 6 -> 12."
    )
    assert str(out / "config.step-6.yaml") in warning and not (out / "config.step-6.yaml").exists()
    # rank 0, once the resume's checks passed, keeps the config that trained the steps so far
    assert keep_config_before_resume(out, new, "latest") == out / "config.step-6.yaml"
    assert (out / "config.step-6.yaml").read_bytes() == original
    # a second changed resume from the same checkpoint keeps the config that trained it, not the newer one
    (out / "config.yaml").write_text(yaml.safe_dump(new))
    assert keep_config_before_resume(out, saved, "latest") is not None
    assert (out / "config.step-6.yaml").read_bytes() == original
    # nothing to resume from: nothing to compare
    assert config_change_note(tmp_path / "none", new, "latest") is None
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


def test_a_resume_of_a_run_at_max_steps_starts_nothing(tmp_path: Path) -> None:
    """A job script that always passes --resume, run again after its run finished: the launcher says there is
    no step left before any server or rank starts; a raised max_steps, a new run or a checkpoint that cannot
    tell leave it to the ranks."""
    from stagectl.rundir.resume import nothing_left_note

    out = tmp_path / "run"
    finished_run(out, checkpoints=(12, 24))
    (out / "checkpoint-24" / "trainer_state.json").write_text(json.dumps({"global_step": 24}))
    assert nothing_left_note(out, "latest", 24) == (
        f"resuming from {out / 'checkpoint-24'}: it is at step 24 and training.max_steps is 24, so no step is "
        "left to train (raise training.max_steps to train further); nothing was started"
    )
    assert nothing_left_note(out, "latest", 30) is None
    assert nothing_left_note(out, None, 24) is None
    assert nothing_left_note(out, out / "checkpoint-12", 24) is None  # its trainer_state.json is `{}`


def test_a_resume_from_an_earlier_checkpoint_moves_the_later_ones_aside_whole(tmp_path: Path) -> None:
    """checkpoint-4 and -6 of the continuation a resume from checkpoint-2 replaces leave the run's own
    checkpoints (left in place, `latest` resumed from the stale checkpoint-6 and `save_total_limit` deleted
    the resumed run's new checkpoints, keeping checkpoint-6); a second such resume gets its own folder."""
    out = tmp_path / "run"
    finished_run(out, checkpoints=(2, 4, 6))
    (out / "checkpoint-8").mkdir()  # a save cut short is moved too
    (out / "checkpoint-4" / "trainer_state.json").write_text('{"global_step": 4}')
    moved = set_aside_later_checkpoints(out, 2)
    assert moved is not None
    names, folder = moved
    assert names == ["checkpoint-4", "checkpoint-6", "checkpoint-8"]
    assert folder == out / "superseded-after-step-2"
    assert sorted(p.name for p in folder.iterdir()) == names
    assert (folder / "checkpoint-4" / "trainer_state.json").read_text() == '{"global_step": 4}'
    assert latest_complete_checkpoint(out) == out / "checkpoint-2"
    assert set_aside_later_checkpoints(out, 2) is None  # nothing later any more
    (out / "checkpoint-3").mkdir()
    again = set_aside_later_checkpoints(out, 2)
    assert again is not None and again[1] == out / "superseded-after-step-2-1"
    assert set_aside_later_checkpoints(out, 6) is None  # a resume from the newest moves nothing


def test_a_checkpoint_that_cannot_be_moved_aside_moves_none_and_names_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A later checkpoint made read-only (to keep it) stopped the move half-way, with a PermissionError
    traceback: checkpoint-4 in the folder, the stale checkpoint-6 still where `latest` finds it."""
    import os

    import stagectl.rundir.resume as resume

    out = tmp_path / "run"
    finished_run(out, checkpoints=(2, 4, 6))
    real_rename = os.rename

    def rename(src: Any, dst: Any) -> None:
        if Path(src).name == "checkpoint-6" and Path(dst).parent.name.startswith("superseded"):
            raise PermissionError(13, "Permission denied")
        real_rename(src, dst)

    monkeypatch.setattr(resume.os, "rename", rename)
    import yaml

    (out / "config.yaml").write_text(yaml.safe_dump({"training": {"learning_rate": 0.002}}))
    changed = {"training": {"learning_rate": 0.001}}
    with pytest.raises(
        ValueError, match=r"checkpoint-6 cannot be moved to \S+superseded-after-step-2: Permission"
    ):
        record_resume(out, changed, out / "checkpoint-2", 2)
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(("checkpoint-", "superseded"))) == [
        "checkpoint-2",
        "checkpoint-4",
        "checkpoint-6",
    ]
    assert not (out / "config.step-2.yaml").exists()  # was written before the move was refused
    monkeypatch.setattr(resume.os, "rename", real_rename)
    plain, moved = record_resume(out, changed, out / "checkpoint-2", 2)
    assert moved is not None and moved.startswith("checkpoint-4, checkpoint-6 (after checkpoint-2")
    assert (out / "config.step-2.yaml").is_file()
    assert plain == {"training": {"learning_rate": 0.001, "resume_from_checkpoint": "latest"}}


def test_the_config_of_a_resume_continues_from_the_newest_checkpoint_of_its_own_run(tmp_path: Path) -> None:
    """config.yaml kept `resume_from_checkpoint: RUN/checkpoint-3`: the continue command a stop prints went back
    to it every time, setting aside what the run had trained since. Another run's checkpoint stays named."""
    out = tmp_path / "run"
    plain = {"training": {"resume_from_checkpoint": str(out / "checkpoint-3"), "max_steps": 6}}
    kept = continuation_config(plain, out, out / "checkpoint-3")
    assert kept["training"] == {"resume_from_checkpoint": "latest", "max_steps": 6}
    other = {"training": {"resume_from_checkpoint": str(tmp_path / "other" / "checkpoint-3")}}
    assert continuation_config(other, out, tmp_path / "other" / "checkpoint-3") == other
