"""`stagectl report` states a finished run's B-step ledger from `final_state.json`: B steps wanted vs trained
over the whole run and why every other wanted B step trained as Channel-A."""

from __future__ import annotations

import json
from pathlib import Path

from stagectl.report.write import write_reports
from tests.helpers import write_report_dirs


def test_report_md_shows_wanted_trained_and_reasons(tmp_path: Path) -> None:
    run, _, _ = write_report_dirs(tmp_path)
    b_steps = {
        "num_steps": 6,
        "b_steps_wanted": 3,
        "b_steps_trained": 1,
        "b_steps_as_a": {"no_server": 1, "queue_empty": 1},
    }
    (run / "final_state.json").write_text(json.dumps({"global_step": 6, "b_steps": b_steps}))
    (written,) = write_reports(run)
    text = (run / "report.md").read_text()
    assert "| B steps wanted / trained (whole run, `final_state.json`) | 3 / 1 |" in text
    assert "| wanted B steps trained as A, by reason | no_server 1, queue_empty 1 |" in text
    assert "no_server 1, queue_empty 1" in written.html.read_text()
    assert "did not finish" not in text and "partial run" not in text  # 6 of training.max_steps 6


def test_a_run_without_the_ledger_has_no_such_rows(tmp_path: Path) -> None:
    run, _, _ = write_report_dirs(tmp_path)  # final_state.json of a run before the ledger: {}
    write_reports(run)
    assert "B steps wanted / trained (whole run" not in (run / "report.md").read_text()
