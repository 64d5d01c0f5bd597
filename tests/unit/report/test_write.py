"""`stagectl report` on a train-ab run says whether it finished: a run a signal stopped (its
`final_state.json` written on the stop too) gets "did not finish: stopped at step N of M (SIGNAL)" and
the command that continues it (a finished run's report: `test_b_steps_report`). One report each: a report
draws its plots (seconds)."""

from __future__ import annotations

import json
from pathlib import Path

from stagectl.report.write import write_reports
from tests.helpers import write_report_dirs


def test_a_stopped_run_is_reported_as_not_finished(tmp_path: Path) -> None:
    run, _, _ = write_report_dirs(tmp_path)  # 6 rows, training.max_steps 6 in config.yaml
    end = {"global_step": 4, "max_steps": 6, "stopped_by_signal": 2}
    (run / "final_state.json").write_text(json.dumps(end))
    write_reports(run)
    text = (run / "report.md").read_text()
    assert (
        "the run did not finish: stopped at step 4 of 6 (SIGINT); continue it with "
        f"`stagectl train-ab {run / 'config.yaml'} --resume`." in text
    )
