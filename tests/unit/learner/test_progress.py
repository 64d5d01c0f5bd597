"""The end-of-run line of train-ab: rollout F1 over the run's B steps, and a word when it stayed 0."""

from __future__ import annotations

from pathlib import Path

import pytest

from stagectl.learner.metrics import MetricsWriter, ProgressBar, rollout_f1_summary, run_rollout_f1s


def _row(kind: str, f1: float | None = None) -> dict[str, object]:
    row: dict[str, object] = {"kind": kind, "loss": 1.0, "time/step_s": 0.1}
    if f1 is not None:
        row["rollout/f1"] = f1
    return row


def test_the_end_of_run_line_counts_every_b_step_of_a_resumed_run(tmp_path: Path) -> None:
    """The F1 line reads the run's metrics.jsonl: a run resumed after its first two B steps still says
    'over 3 B steps' and the best of all three (it said 'over 1 B steps', this process's)."""
    writer = MetricsWriter(tmp_path)
    for step, row in enumerate([_row("B", 0.5), _row("A"), _row("B", 0.25), _row("A")]):
        writer.write({"step": step, **row})
    writer.close()
    resumed = MetricsWriter(tmp_path, resume_step=3)
    resumed.write({"step": 3, **_row("B", 0.125)})
    resumed.close()
    with (tmp_path / "metrics.jsonl").open("a") as handle:
        handle.write('{"step": 4, "kind": "B", "rollout/f')  # a torn last line
    assert run_rollout_f1s(tmp_path) == [0.5, 0.25, 0.125]
    assert rollout_f1_summary(run_rollout_f1s(tmp_path)) == (
        "Channel-B rollout F1 last 0.125, best 0.500 over 3 B steps"
    )
    assert run_rollout_f1s(tmp_path / "absent") == []


def test_no_b_step_no_line() -> None:
    assert rollout_f1_summary([]) is None


def test_all_zero_says_it_is_expected_for_an_untrained_model() -> None:
    line = rollout_f1_summary([0.0, 0.0, 0.0])
    assert line is not None
    assert line.startswith("Channel-B rollout F1 last 0.000, best 0.000 over 3 B steps. F1 0 means")
    assert "expected" in line and "examples/tiny/learn_shapes.yaml" in line


def test_a_model_that_finds_objects_gets_the_numbers_only() -> None:
    assert (
        rollout_f1_summary([0.0, 0.5, 0.25]) == "Channel-B rollout F1 last 0.250, best 0.500 over 3 B steps"
    )


def test_a_b_step_that_trained_as_a_says_so_on_its_line(capsys: pytest.CaptureFixture[str]) -> None:
    bar = ProgressBar(4)
    bar.update(0, _row("A"), log=True)
    bar.update(1, _row("A"), log=True, b_skipped="queue_empty")
    bar.update(2, _row("B", 0.5), log=True)
    bar.close()
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        "step 1/4 A loss=1.0000 (0.10s)",
        "step 2/4 A (B wanted: queue_empty) loss=1.0000 (0.10s)",
        "step 3/4 B loss=1.0000 f1=0.500 (0.10s)",
    ]


def test_the_last_step_gets_its_line_whatever_logging_steps_is(capsys: pytest.CaptureFixture[str]) -> None:
    """logging_steps 3 of 4 steps printed step 3 alone: the run's last loss was never on the console."""
    bar = ProgressBar(4)
    for step in range(4):
        bar.update(step, _row("A"), log=(step + 1) % 3 == 0)
    bar.close()
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["step 3/4 A loss=1.0000 (0.10s)", "step 4/4 A loss=1.0000 (0.10s)"]
