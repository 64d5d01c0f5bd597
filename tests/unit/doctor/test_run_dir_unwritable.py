"""Doctor's `training.output_dir` line fails where train-ab's own start-up check refuses the directory (under a
file), and leaves the disk as it found it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stagectl.config.training import TrainingConfig
from stagectl.doctor.run_dir_check import check_run_dir
from stagectl.files import check_output_dir
from stagectl.rundir.policy import TRAIN_DIR_HINT


@pytest.mark.parametrize("resume", [False, True])
def test_an_output_dir_under_a_file_fails_as_train_ab_does(tmp_path: Path, resume: bool) -> None:
    """It said "holds no run: train-ab starts a new one there"; train-ab then refused it in seconds."""
    (tmp_path / "a_file").write_text("x\n")
    out = tmp_path / "a_file" / "run"
    with pytest.raises(ValueError) as refused:
        check_output_dir(out)  # what train-ab runs before it starts
    line = check_run_dir(TrainingConfig.model_validate({"output_dir": str(out)}), resume=resume)
    assert (line.status, line.name) == ("fail", "training.output_dir")
    assert line.message == f"train-ab will refuse to start: {refused.value}"
    assert line.fix == f"start the run elsewhere: {TRAIN_DIR_HINT}"


def test_a_new_output_dir_passes_and_is_not_left_behind(tmp_path: Path) -> None:
    out = tmp_path / "new" / "run"
    line = check_run_dir(TrainingConfig.model_validate({"output_dir": str(out)}), resume=False)
    assert line.status == "ok" and line.message == f"{out} holds no run: train-ab starts a new one there"
    assert list(tmp_path.iterdir()) == []


def test_a_resume_of_a_run_at_max_steps_warns_that_train_ab_starts_nothing(tmp_path: Path) -> None:
    """`doctor --resume` on a finished run said "train-ab --resume continues it from latest"; train-ab then said
    no step was left, started nothing and exited 0. Doctor now says what train-ab will say, as a warning."""
    from stagectl.rundir.resume import nothing_left_note

    out = tmp_path / "run"
    (out / "checkpoint-24").mkdir(parents=True)
    (out / "checkpoint-24" / "trainer_state.json").write_text(json.dumps({"global_step": 24}))
    (out / "metrics.jsonl").write_text("".join(f'{{"step": {s}}}\n' for s in range(24)))
    training = TrainingConfig.model_validate({"output_dir": str(out), "max_steps": 24})
    line = check_run_dir(training, resume=True)
    launcher = nothing_left_note(out, "latest", 24)  # the line train-ab --resume prints before it exits 0
    assert launcher is not None
    assert (line.status, line.name) == ("warn", "training.output_dir")
    assert launcher.removesuffix("; nothing was started") in line.message
    assert "nothing left to train" in line.message and "training.max_steps" in line.fix
    # steps left: the resume continues, as before
    more = TrainingConfig.model_validate({"output_dir": str(out), "max_steps": 48})
    line = check_run_dir(more, resume=True)
    assert line.status == "ok" and "train-ab --resume continues it from latest" in line.message
