"""`stagectl.rundir.ending`: how a train-ab run ended (finished, or stopped at step N of M by a signal) and
the lines that say how to continue it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stagectl.rundir.ending import RunEnd, abort_note, read_run_end, run_end, stop_note
from stagectl.rundir.policy import prepare_train_dir, train_run_summary
from tests.unit.rundir.runs import finished_run


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
        # an error ended it, even at the last step (the final checkpoint did not fit on the disk)
        ({"global_step": 24, "max_steps": 24, "error": "disk full"}, "failed after step 24 of 24: disk full"),
        ({"global_step": 3, "error": "server gone"}, "failed after step 3: server gone"),
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


def test_a_step_mode_b_step_that_lost_its_servers_points_at_the_latest_checkpoint(tmp_path: Path) -> None:
    from stagectl.rundir.ending import mid_step_loss_note

    out = tmp_path / "run"
    error = RuntimeError("http://127.0.0.1:9/update_weights/: RemoteDisconnected")
    assert mid_step_loss_note(4, error, out) == (
        "B step 5: the rollout servers failed during the step (RuntimeError: http://127.0.0.1:9/update_weights/: "
        "RemoteDisconnected); no checkpoint was written yet (nothing to resume from)"
    )
    finished_run(out, checkpoints=(2, 4))
    (out / "checkpoint-6").mkdir()  # incomplete: no trainer_state.json
    assert mid_step_loss_note(6, error, out).endswith(
        f"the latest checkpoint is {out / 'checkpoint-4'}; once a server answers, continue with: "
        f"stagectl train-ab {out / 'config.yaml'} --resume"
    )


def test_a_failed_run_is_recorded_and_named_in_the_refusal_without_its_whole_error(tmp_path: Path) -> None:
    """`write_failed_state` (rank 0, after an error): read back as failed; the one-line run summary a
    refused restart prints says "failed after step N of M" and leaves the (long) error to the report."""
    from stagectl.rundir.ending import write_failed_state

    out = tmp_path / "run"
    finished_run(out, num_rows=7, checkpoints=(4,))
    write_failed_state(out, 7, 200, "cannot write checkpoint-8: no space left on device", {"num_steps": 7})
    assert read_run_end(out) == RunEnd(
        step=7,
        max_steps=200,
        stopped_by_signal=None,
        error="cannot write checkpoint-8: no space left on device",
    )
    assert train_run_summary(out) == "7 metrics rows, checkpoint-4, failed after step 7 of 200"
    with pytest.raises(ValueError, match=r"\(7 metrics rows, checkpoint-4, failed after step 7 of 200\)"):
        prepare_train_dir(out, resume=None, overwrite=False)
