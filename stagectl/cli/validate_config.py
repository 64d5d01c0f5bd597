"""`stagectl validate-config CONFIG [--world-size N] [--set k=v]... [--gpu-memory-gb G] [--schema]`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import typer

from stagectl.cli.common import fail

if TYPE_CHECKING:
    from stagectl.config import StagectlConfig


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
    gpu_memory_gb: float | None = typer.Option(
        None,
        "--gpu-memory-gb",
        min=0.001,
        help="Device memory per rank in GiB (80 for an 80 GB card): print the per-rank memory estimate on "
        "stderr and warn when it exceeds this budget (docs/memory.md).",
    ),
) -> None:
    """Validate a config; print the resolved config (exit 0) or every problem (exit 1)."""
    from stagectl.config import ConfigError, effective_world_size, load_config, to_plain
    from stagectl.config import StagectlConfig as ConfigModel

    fmt = _format(output_format)
    if schema:
        typer.echo(json.dumps(ConfigModel.model_json_schema(by_alias=True), indent=2))
        return
    if config is None:
        fail("missing CONFIG (or pass --schema)", code=2)
    try:
        cfg = load_config(config, overrides, world_size=world_size)
    except ConfigError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(1) from None
    typer.echo(_dump(to_plain(cfg), fmt))
    if gpu_memory_gb is not None:
        _memory_report(cfg, effective_world_size(cfg, world_size), int(gpu_memory_gb * 1024**3))


def _memory_report(cfg: StagectlConfig, world_size: int, budget_bytes: int) -> None:
    """The per-rank estimate and, above the budget, a warning (stderr; the exit code stays 0)."""
    from stagectl.memory.estimate import GIB, estimate_memory, format_table
    from stagectl.memory.from_config import knobs_from_config, model_shape

    try:
        shape = model_shape(cfg.model.name_or_path)
    except ValueError as exc:
        typer.echo(f"memory estimate skipped: model.name_or_path: {exc}", err=True)
        return
    knobs = knobs_from_config(
        cfg.model, cfg.training, global_max_length=cfg.global_max_length, world_size=world_size
    )
    estimate = estimate_memory(shape, knobs)
    title = (
        f"memory per rank (estimate; {shape.counts.total:,} params, world size {world_size}, "
        f"{knobs.parallelism}, mixed_precision {knobs.mixed_precision}, {knobs.num_tokens} tokens per micro-batch):"
    )
    for line in format_table(estimate, title=title, budget_bytes=budget_bytes):
        typer.echo(line, err=True)
    if estimate.total > budget_bytes:
        typer.echo(
            f"warning: the estimated peak of {estimate.total / GIB:.1f} GiB per rank exceeds --gpu-memory-gb "
            f"({budget_bytes / GIB:.1f} GiB): consider training.parallelism: fsdp, "
            "training.gradient_checkpointing, model.freeze_vit, or a smaller global_max_length",
            err=True,
        )


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
