"""`stagectl report RUN_DIR`: report.md + PNG plots for a train-ab run dir or Stage-B mission dir(s)."""

from __future__ import annotations

from pathlib import Path

import typer

from stagectl.cli.common import fail


def command(
    run_dir: Path = typer.Argument(
        ...,
        help="A train-ab output_dir, a Stage-B mission dir, or a parent of Stage-B mission dirs.",
    ),
) -> None:
    """Summarise a run: writes RUN_DIR/report.md and PNG plots under RUN_DIR/report/."""
    from stagectl.report.write import write_reports  # matplotlib loads only for this command

    try:
        written = write_reports(run_dir)
    except ValueError as exc:
        fail(str(exc))
    for item in written:
        line = f"report: wrote {item.report}"
        if item.num_plots or item.not_plotted:
            line += f" and {item.num_plots} plot(s) under {item.report.parent / 'report'}"
        if item.not_plotted:
            line += f" (not plotted: {'; '.join(item.not_plotted)})"
        typer.echo(line)
