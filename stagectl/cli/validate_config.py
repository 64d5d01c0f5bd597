"""`stagectl validate-config CONFIG [--for COMMAND] [--nproc N] [--world-size N] [--set k=v]... [--gpu-memory-gb G]
[--schema]`: the schema and cross-section rules, then what COMMAND (train-ab by default) resolves the config
into before it starts (its plan), so a config this command passes is one that command accepts. The files it
names are not opened here: `stagectl doctor` checks a train-ab config's data, model and servers; Stage-B's
tickets and guidance are read, and checked, when `stage-b` starts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import typer

from stagectl.cli.common import fail, world_of_nproc

if TYPE_CHECKING:
    from stagectl.config import StagectlConfig


# the commands that read a config, each with the check of its own it runs before starting (`_resolve_for`)
COMMANDS = ("train-ab", "eval", "stage-b", "rollout-server")


def command(
    config: Path | None = typer.Argument(None, help="YAML config to validate."),
    for_command: str = typer.Option(
        "train-ab",
        "--for",
        help="The command the config is for: train-ab, eval, stage-b or rollout-server; what that command "
        "checks before it starts is checked too (train-ab: a stage2_ab section and data).",
    ),
    nproc: int | None = typer.Option(
        None,
        "--nproc",
        min=1,
        help="Processes per node, as for train-ab and stage-b (sets launch.nproc_per_node; the world size is "
        "N x launch.nnodes).",
    ),
    world_size: int | None = typer.Option(
        None,
        "--world-size",
        min=1,
        help="World size to validate against (default: as train-ab launches it, --nproc x launch.nnodes, else "
        "launch.nproc_per_node x launch.nnodes; a $WORLD_SIZE in the environment is not read); given with "
        "--nproc, it must be that same number.",
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
    from stagectl.config import ConfigError, effective_world_size, launch_world_size, load_config, to_plain
    from stagectl.config import StagectlConfig as ConfigModel
    from stagectl.config.root import is_train_ab

    fmt = _format(output_format)
    if for_command not in COMMANDS:
        fail(f"--for must be one of {', '.join(COMMANDS)}, got {for_command!r}", code=2)
    if schema:
        typer.echo(json.dumps(ConfigModel.model_json_schema(by_alias=True), indent=2))
        return
    if config is None:
        fail("missing CONFIG (or pass --schema)", code=2)
    sets = list(overrides)
    if nproc is not None:  # as train-ab and stage-b read it
        sets.append(f"launch.nproc_per_node={nproc}")
        world_size = world_of_nproc(config, sets, nproc, world_size)
    elif world_size is None:
        # the world train-ab's launcher starts, never a $WORLD_SIZE left in the environment
        world_size = launch_world_size(config, sets)
    try:
        # as eval loads it: its ranks only shard images, so the training-world rules do not apply
        cfg = load_config(config, sets, world_size=world_size, trains=for_command != "eval")
    except ConfigError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(1) from None
    try:
        _resolve_for(for_command, cfg, effective_world_size(cfg, world_size))
    except ValueError as exc:
        hint = "" if for_command != "train-ab" or is_train_ab(cfg) else f"; {_OTHER_COMMANDS}"
        fail(f"{config}: {exc}{hint}")
    typer.echo(_dump(to_plain(cfg), fmt))
    if gpu_memory_gb is not None:
        _memory_report(cfg, effective_world_size(cfg, world_size), int(gpu_memory_gb * 1024**3))


_OTHER_COMMANDS = "a config for another command: --for eval, stage-b or rollout-server"


def _resolve_for(name: str, cfg: StagectlConfig, world_size: int) -> None:
    """Resolve `cfg` as command `name` does before it starts; a `ValueError` says what that command refuses."""
    if name == "train-ab":
        from stagectl.config.plan_train import train_plan

        train_plan(cfg, world_size)
    elif name == "eval":
        from stagectl.config.plan_eval import eval_session

        eval_session(cfg)
    elif name == "stage-b":
        from stagectl.config.plan_stage_b import stage_b_plan

        stage_b_plan(cfg)
    else:
        from stagectl.config.plan_server import server_plan

        server_plan(cfg)


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
