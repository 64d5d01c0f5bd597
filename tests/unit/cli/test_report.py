"""`stagectl report`'s options say what the command writes; Ctrl-C ends it with one line."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from stagectl.cli.app import app, main


def test_out_names_every_file_a_comparison_writes() -> None:
    """`--out` said "comparison.md and its plot"; a comparison also writes comparison.html (its page), as
    docs/reports.md and the command's own last line say."""
    result = CliRunner().invoke(app, ["report", "--help"], env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output
    (line,) = [line for line in result.output.splitlines() if "--out" in line]
    for name in ("comparison.md", "comparison.html", "comparison_f1.png"):
        assert name in line


@pytest.mark.parametrize(("raised", "said"), [("ctrl-c", True), ("own exit", False)])
def test_ctrl_c_ends_a_command_with_one_line(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    raised: str,
    said: bool,
) -> None:
    """Ctrl-C in report (export, tiny-model, demo-data, convert) ended it with exit 130 and not a word (Typer
    turns an unhandled KeyboardInterrupt into a silent exit); it now says so in one line, no traceback. A
    command that handles its own Ctrl-C (eval: `typer.Exit(130)` after its own line) gets no second line."""
    import stagectl.report.write as write

    def stop(run_dir: Path) -> None:
        if raised == "ctrl-c":
            raise KeyboardInterrupt
        raise typer.Exit(130) from None

    monkeypatch.setattr(write, "write_reports", stop)
    monkeypatch.setattr(sys, "argv", ["stagectl", "report", str(tmp_path)])
    with pytest.raises(SystemExit) as exc:
        main()
    assert exc.value.code == 130
    err = capsys.readouterr().err
    assert err == ("report: interrupted (SIGINT); no file was left half-written\n" if said else "")
