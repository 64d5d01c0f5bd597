"""The Typer application: one small module per command, registered here.

Nothing heavy is imported at module level: `stagectl --help` must answer without torch.
"""

from __future__ import annotations

import typer

from stagectl.cli import (
    convert,
    demo_data,
    doctor,
    evaluate,
    export,
    report,
    rollout_server,
    stage_b,
    tiny_model,
    train_ab,
    validate_config,
)

app = typer.Typer(
    name="stagectl",
    help="Post-training for detection VLMs: Stage-2 AB training, rollout server, Stage-B loop.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _print_version(value: bool) -> None:
    """`stagectl --version`: the installed package's version (the checkout's own when run from a source tree
    without an install), before any command or heavy import."""
    if not value:
        return
    from importlib.metadata import PackageNotFoundError, version

    try:
        text = version("stagectl")
    except PackageNotFoundError:
        import stagectl

        text = stagectl.__version__
    typer.echo(f"stagectl {text}")
    raise typer.Exit()


@app.callback()
def _options(
    show_version: bool = typer.Option(
        False, "--version", callback=_print_version, is_eager=True, help="Print stagectl's version and exit."
    ),
) -> None:
    """The options before a command (the app's help text is `Typer(help=...)` above)."""


app.command("validate-config")(validate_config.command)
app.command("doctor")(doctor.command)
app.command("train-ab")(train_ab.command)
app.command("rollout-server")(rollout_server.command)
app.command("stage-b")(stage_b.command)
app.command("demo-data")(demo_data.command)
app.command("tiny-model")(tiny_model.command)
app.command("report")(report.command)
app.command("export")(export.command)
app.add_typer(convert.app, name="convert")
app.command("eval")(evaluate.command)


def main() -> None:
    app()
