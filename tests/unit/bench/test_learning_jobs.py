"""The learning check's scheduler: a job runs after the job it needs, and a prerequisite that is not in the
list (a Stage-1 reused from an earlier check) counts as done instead of blocking forever."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from bench.learning_jobs import Job, run_finished, run_jobs

FINISHED = {"global_step": 200, "max_steps": 200, "stopped_by_signal": None}


def _job(name: str, out: Path, after: str | None = None) -> Job:
    marker = out / "order.txt"
    code = f"open({str(marker)!r}, 'a').write({name!r} + '\\n')"
    return Job(name, [sys.executable, "-c", code], out / name, after=after)


def test_reused_prerequisite_does_not_block_and_order_is_kept(tmp_path: Path) -> None:
    jobs = [
        _job("screen-a", tmp_path, after="sparse-stage1"),  # reused: not in the list
        _job("stage1", tmp_path),
        _job("phase2", tmp_path, after="stage1"),
    ]
    walls = run_jobs(jobs, 1, tmp_path)
    assert set(walls) == {"screen-a", "stage1", "phase2"}
    order = (tmp_path / "order.txt").read_text().split()
    assert order.index("stage1") < order.index("phase2")


def test_a_run_an_earlier_check_left_unfinished_is_started_with_overwrite(tmp_path: Path) -> None:
    """A check stopped midway and re-run on the same --out goes on where it stopped: a run dir without
    final_state.json (killed with the check) or with one an error wrote is moved aside by train-ab's
    --overwrite, not refused; a fresh one gets no flag."""
    code = "import sys; open(sys.argv[1], 'w').write(' '.join(sys.argv[2:]))"
    jobs = [
        Job(name, [sys.executable, "-c", code, str(tmp_path / f"{name}.argv")], tmp_path / name)
        for name in ("killed", "failed", "fresh")
    ]
    (tmp_path / "killed").mkdir()
    (tmp_path / "killed" / "metrics.jsonl").write_text("{}\n")
    (tmp_path / "failed").mkdir()  # ended by an error: final_state.json, but no result (run_finished)
    (tmp_path / "failed" / "final_state.json").write_text(
        json.dumps({**FINISHED, "global_step": 55, "error": "x"})
    )
    run_jobs(jobs, 2, tmp_path)
    assert (tmp_path / "killed.argv").read_text() == "--overwrite"
    assert (tmp_path / "failed.argv").read_text() == "--overwrite"
    assert (tmp_path / "fresh.argv").read_text() == ""


@pytest.mark.parametrize(
    ("state", "finished"),
    [
        (FINISHED, True),
        # the learning check's run that a rollout's desc killed at step 55: final_state.json, with the error
        (
            {**FINISHED, "global_step": 55, "error": "encode() produced 5 coordinate tokens for 1 objects"},
            False,
        ),
        ({**FINISHED, "global_step": 6, "stopped_by_signal": 2}, False),
        ({**FINISHED, "global_step": 199}, False),
        (None, False),
    ],
)
def test_a_run_is_a_result_only_when_it_trained_every_step(
    tmp_path: Path, state: dict[str, object] | None, finished: bool
) -> None:
    """final_state.json is written by a failed or stopped run too: the check must not analyse it as a
    result (a re-run on the same --out trains it again: the test above)."""
    run = tmp_path / "run"
    run.mkdir()
    if state is not None:
        (run / "final_state.json").write_text(json.dumps(state))
    assert run_finished(run) is finished
