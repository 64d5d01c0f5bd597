"""`stagectl report RUN_DIR [RUN_DIR ...]`: report.md, report.html + PNG plots for a train-ab run dir, an eval
dir or Stage-B mission dir(s); with several train-ab run dirs, a comparison of their held-out eval with 95%
intervals."""

from __future__ import annotations

from pathlib import Path

import typer

from stagectl.cli.common import fail


def command(
    run_dirs: list[Path] = typer.Argument(
        ...,
        help="A train-ab output_dir, a stagectl eval output dir, a Stage-B mission dir, or a parent of Stage-B "
        "mission dirs; several train-ab output_dirs (e.g. A-only and AB, a few seeds each) are compared.",
    ),
    out: Path = typer.Option(
        Path("comparison"),
        "--out",
        help="Where a comparison of several runs writes comparison.md, comparison.html and comparison_f1.png.",
    ),
    step: int | None = typer.Option(
        None, "--step", help="Compare at this eval step (default: the largest eval step every run reached)."
    ),
) -> None:
    """Summarise a run (RUN_DIR/report.md, RUN_DIR/report.html with the galleries, PNG plots under
    RUN_DIR/report/), or compare several runs."""
    if len(run_dirs) > 1:
        from stagectl.report.compare import write_comparison  # matplotlib loads only for this command

        try:
            report, table, notes = write_comparison(run_dirs, out, step)
        except ValueError as exc:
            fail(str(exc))
        typer.echo("\n".join(table))
        typer.echo(f"report: wrote {report}, {out / 'comparison.html'} and {out / 'comparison_f1.png'}")
        for note in notes:
            typer.echo(f"report: note: {note.replace('`', '')}", err=True)
        return
    from stagectl.report.write import write_reports  # matplotlib loads only for this command

    try:
        written = write_reports(run_dirs[0])
    except ValueError as exc:
        fail(str(exc))
    for item in written:
        line = f"report: wrote {item.report}"
        if item.num_plots or item.not_plotted:
            line += f" and {item.num_plots} plot(s) under {item.report.parent / 'report'}"
        if item.not_plotted:
            line += f" (not plotted: {'; '.join(item.not_plotted)})"
        if item.html is not None:
            line += f"; the page: {item.html}"
        typer.echo(line)
        for note in item.notes:  # what the report skipped or could not know is said here too, not only in it
            typer.echo(f"report: note: {note.replace('`', '')}", err=True)
