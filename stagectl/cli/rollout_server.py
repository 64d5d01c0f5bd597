"""`stagectl rollout-server [CONFIG] [--model M] [--engine hf|vllm] [--host H] [--port P] [--set k=v ...]`."""

from __future__ import annotations

from pathlib import Path

import typer

from stagectl.cli.common import fail


def command(
    config: Path | None = typer.Argument(None, help="YAML config (model + rollout_server sections)."),
    model: str | None = typer.Option(None, "--model", help="Checkpoint dir or builtin:tiny-qwen2.5-vl."),
    engine: str | None = typer.Option(None, "--engine", help="hf (default) or vllm."),
    host: str | None = typer.Option(None, "--host", help="Bind address (default 127.0.0.1)."),
    port: int | None = typer.Option(None, "--port", help="Port; 0 picks a free one (printed at start)."),
    weights_dirs: list[Path] = typer.Option(
        [], "--weights-dir", help="Directory that disk weight syncs may load snapshots from (repeatable)."
    ),
    overrides: list[str] = typer.Option(
        [], "--set", help="Override a key: --set rollout_server.max_batch_size=4"
    ),
    access_log: str | None = typer.Option(
        None,
        "--access-log",
        help="Write one JSON line per request to this file (appended), or to stderr with '-'; "
        "default: no access log.",
    ),
) -> None:
    """Serve rollouts over HTTP (swift-rollout compatible /infer/, plus weight sync)."""
    from stagectl.config import ConfigError, load_config
    from stagectl.launch import die_with_parent

    die_with_parent()  # an embedded server stops (SIGTERM) when the train-ab launcher dies

    sets = list(overrides)
    for key, value in (
        ("model.name_or_path", model),
        ("rollout_server.engine", engine),
        ("rollout_server.host", host),
        ("rollout_server.port", port),
    ):
        if value is not None:
            sets.append(f"{key}={value}")
    try:
        cfg = load_config(config, sets)
    except ConfigError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(1) from None

    from stagectl.config.placement import CpuSides
    from stagectl.models.capability import template_problem_on_disk
    from stagectl.placement import place_server

    try:
        place_server(cfg.rollout_server, CpuSides.of(cfg))  # before the engine (and CUDA) starts
        # before the model loads: a template that does not compile failed every /infer/ with HTTP 500
        problem = template_problem_on_disk(cfg.model.name_or_path)
        if problem is not None:
            raise ValueError(f"model.name_or_path: {problem}")
    except ValueError as exc:
        fail(str(exc))

    from stagectl.config.plan_server import server_plan
    from stagectl.server.serving import run_server

    try:
        run_server(server_plan(cfg), weight_dirs=weights_dirs, access_log=access_log)
    except (ValueError, FileNotFoundError) as exc:
        fail(str(exc))
