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
