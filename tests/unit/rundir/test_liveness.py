"""`stagectl.rundir.liveness`: `running.json` names rank 0's process while a run goes on. Left behind, it tells
a run still going (a second train-ab there is refused) from one killed without a word (the report says so
and how to continue), by pid and process start time (a reused pid is not mistaken for the run)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from stagectl.rundir.liveness import RUNNING, clear_running, mark_running, running_process
from stagectl.rundir.policy import prepare_train_dir, train_run_summary
from tests.unit.rundir.runs import finished_run


def _unfinished_run(out: Path) -> None:
    finished_run(out, num_rows=3, checkpoints=(2,))
    (out / "final_state.json").unlink()  # still going, or killed before it could record an end


def test_a_live_run_is_running_and_a_second_start_there_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import stagectl.rundir.liveness as liveness

    monkeypatch.setattr(liveness, "SETTLE_S", 0.2)  # a refusal waits this long for a just-killed process
    out = tmp_path / "run"
    _unfinished_run(out)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        state = {"pid": other.pid, "host": socket.gethostname(), "started": None}
        (out / RUNNING).write_text(json.dumps(state))
        proc = running_process(out)
        assert proc is not None and proc.alive and proc.pid == other.pid
        assert (
            train_run_summary(out)
            == f"3 metrics rows, checkpoint-2, running (pid {other.pid} on {proc.host})"
        )
        for resume, overwrite in (("latest", False), (None, True)):  # neither continues nor moves it aside
            with pytest.raises(ValueError, match=rf"is in use: a train-ab run is running \(pid {other.pid} "):
                prepare_train_dir(out, resume=resume, overwrite=overwrite)
        assert sorted(p.name for p in out.iterdir()) == sorted(
            ["checkpoint-2", "config.yaml", "metrics.jsonl", RUNNING]
        )
        other.kill()  # SIGKILL: a zombie until reaped, which is not running either
        while Path(f"/proc/{other.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
            pass
        assert running_process(out).alive is False  # type: ignore[union-attr]
    finally:
        other.kill()
        other.wait()
    # the same pid file once that process is gone: killed, and a resume goes ahead
    proc = running_process(out)
    assert proc is not None and proc.alive is False
    assert train_run_summary(out) == "3 metrics rows, checkpoint-2, killed (its process is gone)"
    assert prepare_train_dir(out, resume="latest", overwrite=False) is None


def test_a_reused_pid_is_not_the_run_and_another_host_cannot_tell(tmp_path: Path) -> None:
    out = tmp_path / "run"
    out.mkdir()
    mark_running(out)  # this process, as rank 0 marks it
    state = json.loads((out / RUNNING).read_text())
    assert state["pid"] == os.getpid() and running_process(out).alive  # type: ignore[union-attr]
    # this process's own earlier run (a test that trained in process) does not block it
    assert prepare_train_dir(out, resume=None, overwrite=False) is None
    (out / RUNNING).write_text(json.dumps({**state, "started": state["started"] - 1}))  # pid reused since
    assert running_process(out).alive is False  # type: ignore[union-attr]
    (out / RUNNING).write_text(json.dumps({**state, "host": "node-that-is-not-this-one"}))
    proc = running_process(out)
    assert proc is not None and proc.alive is None and "cannot tell" in proc.describe()
    clear_running(out)
    assert running_process(out) is None and not (out / RUNNING).exists()
    clear_running(tmp_path / "gone")  # nothing to clear: no error


def test_the_report_of_a_killed_run_says_so_and_how_to_continue(tmp_path: Path) -> None:
    from stagectl.report.write import write_reports
    from tests.helpers import write_report_dirs

    run, _, _ = write_report_dirs(tmp_path)
    (run / "final_state.json").unlink(missing_ok=True)
    (run / RUNNING).write_text(json.dumps({"pid": 2**22 + 17, "host": socket.gethostname(), "started": 1}))
    (run / "checkpoint-2").mkdir()  # a save before the kill: --resume continues from it
    (run / "checkpoint-2" / "trainer_state.json").write_text("{}")
    (written,) = write_reports(run)
    text = written.report.read_text()
    assert "no `final_state.json`: the run did not finish; its process (pid 4194321 on" in text
    assert "killed (SIGKILL, the out-of-memory killer, a preempted job)" in text
    assert f"`stagectl train-ab {run / 'config.yaml'} --resume`" in text and "still running" not in text


def test_clearing_in_a_directory_that_turned_read_only_is_no_second_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The run's own error (a read-only run directory) is what gets reported, not a traceback from here."""
    mark_running(tmp_path)

    def refused(self: Path, missing_ok: bool = False) -> None:
        raise PermissionError(30, "Read-only file system", str(self))

    monkeypatch.setattr(Path, "unlink", refused)
    clear_running(tmp_path)
    monkeypatch.undo()
    assert (tmp_path / RUNNING).exists()
