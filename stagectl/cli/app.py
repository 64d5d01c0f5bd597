"""The Typer application: one small module per command, registered here.

Nothing heavy is imported at module level: `stagectl --help` must answer without torch.
"""

from __future__ import annotations

import sys

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
    try:
        app()
    except SystemExit as exc:
        if exc.code == 130 and _ctrl_c(exc):
            typer.echo(interrupted_line(sys.argv), err=True)
        raise


def _ctrl_c(exc: SystemExit) -> bool:
    """Whether Typer ended the command on a KeyboardInterrupt the command did not handle (it turns one into
    `Exit(130)` without a word); eval, train-ab and stage-b catch theirs and say what they left."""
    context = exc.__context__
    return isinstance(context, typer.Exit) and isinstance(context.__cause__, KeyboardInterrupt)


def interrupted_line(argv: list[str]) -> str:
    """The line a command stopped by Ctrl-C ends with. Every command that writes files writes each whole (a temp
    file renamed into place, a model built in a staging directory), so none is left half-written."""
    command = next((arg for arg in argv[1:] if not arg.startswith("-")), "stagectl")
    return f"{command}: interrupted (SIGINT); no file was left half-written"
