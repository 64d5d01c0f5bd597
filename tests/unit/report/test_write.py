"""`stagectl report` on a train-ab run says whether it finished: a run a signal stopped (its
`final_state.json` written on the stop too) gets "did not finish: stopped at step N of M (SIGNAL)" and
the command that continues it (a finished run's report: `test_b_steps_report`). One report each: a report
draws its plots (seconds)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from stagectl.report.write import write_reports
from tests.helpers import write_report_dirs


def test_a_stopped_run_is_reported_as_not_finished(tmp_path: Path) -> None:
    run, _, _ = write_report_dirs(tmp_path)  # 6 rows, training.max_steps 6 in config.yaml
    end = {"global_step": 4, "max_steps": 6, "stopped_by_signal": 2}
    (run / "final_state.json").write_text(json.dumps(end))
    (run / "checkpoint-4").mkdir()  # what the stop saved
    (run / "checkpoint-4" / "trainer_state.json").write_text("{}")
    write_reports(run)
    text = (run / "report.md").read_text()
    assert (
        f"the run did not finish: stopped at step 4 of 6 (SIGINT); continue it from {run / 'checkpoint-4'} "
        f"with `stagectl train-ab {run / 'config.yaml'} --resume`." in text
    )


@pytest.mark.parametrize(
    "end",
    [
        {"global_step": 3, "max_steps": 6, "stopped_by_signal": 2},  # a second Ctrl-C: no checkpoint
        {"global_step": 3, "max_steps": 6, "stopped_by_signal": None, "error": "rollout servers gone"},
        None,  # killed: running.json names a process that is gone
    ],
)
def test_a_run_with_no_checkpoint_is_not_told_to_resume(
    tmp_path: Path, end: dict[str, object] | None
) -> None:
    """A run that ended before its first save: the report said `continue it with ... --resume` (killed,
    stopped) or nothing (failed); train-ab refuses that resume ("no complete checkpoint to continue from;
    pass --overwrite"). The report now gives the command train-ab takes."""
    import socket

    from stagectl.rundir.policy import prepare_train_dir

    run, _, _ = write_report_dirs(tmp_path)
    if end is None:
        (run / "final_state.json").unlink()
        pid = {"pid": 2**22 + 17, "host": socket.gethostname(), "started": 1}
        (run / "running.json").write_text(json.dumps(pid))
    else:
        (run / "final_state.json").write_text(json.dumps(end))
    write_reports(run)
    text = (run / "report.md").read_text()
    assert (
        "it saved no checkpoint, which --resume needs: start it again with "
        f"`stagectl train-ab {run / 'config.yaml'} --overwrite`." in text
    )
    assert "--resume`" not in text
    with pytest.raises(ValueError, match="no complete checkpoint to continue from"):
        prepare_train_dir(run, "latest", False)  # what train-ab --resume would say


def test_a_failed_run_is_reported_with_its_error_and_where_to_continue(tmp_path: Path) -> None:
    """An error ended the run (final_state.json holds it): the report says so, with the error and the
    checkpoint to continue from, instead of "did not finish (or is still running)"."""
    run, _, _ = write_report_dirs(tmp_path)  # 6 rows, training.max_steps 6 in config.yaml
    end = {"global_step": 4, "max_steps": 6, "stopped_by_signal": None, "error": "no space left on device"}
    (run / "final_state.json").write_text(json.dumps(end))
    (run / "checkpoint-2").mkdir()
    (run / "checkpoint-2" / "trainer_state.json").write_text("{}")
    write_reports(run)
    text = (run / "report.md").read_text()
    assert (
        "the run did not finish: failed after step 4 of 6: no space left on device; continue it from "
        f"{run / 'checkpoint-2'} with `stagectl train-ab {run / 'config.yaml'} --resume`." in text
    )
    assert "still running" not in text


def test_what_the_report_skipped_is_said_on_the_console_too(tmp_path: Path) -> None:
    """A torn last line (an interrupted run) is skipped and noted in report.md; the command says so as well,
    not only inside the file."""
    from typer.testing import CliRunner

    from stagectl.cli.app import app

    run, _, _ = write_report_dirs(tmp_path)
    with (run / "metrics.jsonl").open("a") as handle:
        handle.write('{"step": 6, "kind": "A", "lo')
    result = CliRunner().invoke(app, ["report", str(run)])
    assert result.exit_code == 0, result.output
    assert "report: note: metrics.jsonl: skipped 1 unreadable line(s): 7 (a torn last line" in result.output


def test_a_report_that_cannot_be_written_is_refused_before_the_plots_are_drawn(tmp_path: Path) -> None:
    """A file where the plot directory goes, or a directory where report.md / report.html goes, failed with a
    traceback after the plots were drawn (report.md written without its page, PNGs left behind); the report
    now refuses it first, naming the path, and draws nothing."""
    from typer.testing import CliRunner

    from stagectl.cli.app import app

    run, _, _ = write_report_dirs(tmp_path)
    before = sorted(p.name for p in run.iterdir())
    for name, make, said in (
        ("report", Path.touch, "is a file, not the directory of the plots"),
        ("report.html", Path.mkdir, "is a directory, not a file"),
        ("report.md", Path.mkdir, "is a directory, not a file"),
    ):
        make(run / name)
        result = CliRunner().invoke(app, ["report", str(run)])
        assert result.exit_code == 1, result.output
        assert f"error: cannot write the report: {run / name} {said}" in result.output
        assert sorted(p.name for p in run.iterdir()) == sorted([*before, name])  # nothing else written
        if name == "report":
            (run / name).unlink()
        else:
            (run / name).rmdir()


class _Stopped(BaseException):
    """Stands for a Ctrl-C (or an error) while a report draws its plots."""


def test_a_report_stopped_midway_leaves_the_earlier_report_and_its_plots(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second report that fails (or is stopped) while it draws: report.md and report.html are the earlier
    ones and every plot they link is still there, unchanged. It deleted the earlier PNGs first, so the
    earlier page linked plots that were gone. A report that ends drops the plots it no longer draws, and
    what a killed report left half drawn."""
    import stagectl.files as files
    import stagectl.report.plots_train_ab as plots

    run, _, _ = write_report_dirs(tmp_path)
    write_reports(run)
    before = {p.relative_to(run).as_posix(): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}
    linked = re.findall(r"\((report/[^)]+\.png)\)", (run / "report.md").read_text())
    assert len(linked) >= 3 and set(linked) <= set(before)

    def stop(*args: object) -> object:
        raise _Stopped  # after the loss plot was drawn, before the others

    monkeypatch.setattr(plots, "rollout_plot", stop)
    with pytest.raises(_Stopped):
        write_reports(run)
    monkeypatch.undo()
    after = {p.relative_to(run).as_posix(): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}
    assert after == before
    assert [p.name for p in (run / "report").iterdir() if p.is_dir()] == []  # no drawing dir left

    (run / "report" / "old.png").write_bytes(b"a plot an earlier report drew")
    host = files.host_tag()  # this host's: another's are left to it (a shared filesystem)
    killed, live = run / "report" / f".drawing-111-{host}-x", run / "report" / f".drawing-222-{host}-y"
    for left in (killed, live):
        left.mkdir()
        (left / "loss.png").write_bytes(b"half a plot")
    monkeypatch.setattr(files, "pid_alive", lambda pid: pid == 222)
    write_reports(run)
    assert not (run / "report" / "old.png").exists()
    assert all((run / link).is_file() for link in linked)
    assert not killed.exists() and (live / "loss.png").is_file()


def test_a_run_without_held_out_evals_says_why_the_eval_plots_are_missing(tmp_path: Path) -> None:
    """The report of a run without `data.eval` (the tiny example's) drew no eval plot and no precision-recall
    curve and did not say so, while "Not plotted" and the console listed every other plot that does not
    apply, with the reason (docs/reports.md)."""
    from typer.testing import CliRunner

    from stagectl.cli.app import app

    run, _, _ = write_report_dirs(tmp_path)
    (run / "eval.jsonl").unlink()
    result = CliRunner().invoke(app, ["report", str(run)])
    assert result.exit_code == 0, result.output
    assert "held-out eval and its precision-recall curve" in result.output  # the console's not-plotted list
    text = (run / "report.md").read_text()
    assert (
        "- held-out eval and its precision-recall curve: no eval.jsonl rows: the run had no held-out eval "
        "(set data.eval; `stagectl eval` scores a checkpoint afterwards)."
    ) in text.split("## Not plotted", 1)[1]
    assert not (run / "report" / "eval.png").exists() and not (run / "report" / "pr_curve.png").exists()
