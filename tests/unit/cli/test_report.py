"""`stagectl report`'s options say what the command writes."""

from __future__ import annotations

from typer.testing import CliRunner

from stagectl.cli.app import app


def test_out_names_every_file_a_comparison_writes() -> None:
    """`--out` said "comparison.md and its plot"; a comparison also writes comparison.html (its page), as
    docs/reports.md and the command's own last line say."""
    result = CliRunner().invoke(app, ["report", "--help"], env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output
    (line,) = [line for line in result.output.splitlines() if "--out" in line]
    for name in ("comparison.md", "comparison.html", "comparison_f1.png"):
        assert name in line
