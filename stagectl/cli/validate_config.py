"""`stagectl validate-config CONFIG [--world-size N] [--set k=v]... [--schema]`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import typer

from stagectl.cli.common import fail


def command(
    config: Path | None = typer.Argument(None, help="YAML config to validate."),
    world_size: int | None = typer.Option(
        None, "--world-size", min=1, help="World size to validate against (default: $WORLD_SIZE or launch)."
    ),
    overrides: list[str] = typer.Option(
        [], "--set", help="Override a key: --set training.learning_rate=1e-5"
    ),
    output_format: str = typer.Option("yaml", "--format", help="yaml or json."),
    schema: bool = typer.Option(False, "--schema", help="Print the JSON Schema of the config and exit."),
) -> None:
    """Validate a config; print the resolved config (exit 0) or every problem (exit 1)."""
    from stagectl.config import ConfigError, StagectlConfig, load_config, to_plain

    fmt = _format(output_format)
    if schema:
        typer.echo(json.dumps(StagectlConfig.model_json_schema(by_alias=True), indent=2))
        return
    if config is None:
        fail("missing CONFIG (or pass --schema)", code=2)
    try:
        cfg = load_config(config, overrides, world_size=world_size)
    except ConfigError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(1) from None
    typer.echo(_dump(to_plain(cfg), fmt))


def _format(value: str) -> Literal["yaml", "json"]:
    if value == "yaml":
        return "yaml"
    if value == "json":
        return "json"
    fail(f"--format must be yaml or json, got {value!r}", code=2)


def _dump(data: object, fmt: Literal["yaml", "json"]) -> str:
    if fmt == "json":
        return json.dumps(data, indent=2)
    import yaml

    return yaml.safe_dump(data, sort_keys=False).rstrip()
