"""`stagectl doctor CONFIG [--set k=v]... [--nproc N] [--world-size N] [--resume | --overwrite] [--push]
[--json]`: the preflight (docs/doctor.md)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import typer


def command(
    config: Path = typer.Argument(..., help="The train-ab YAML config to check."),
    overrides: list[str] = typer.Option([], "--set", help="Override a key: --set training.max_steps=10"),
    nproc: int | None = typer.Option(
        None, "--nproc", min=1, help="Learner processes per node, as for train-ab (overrides launch)."
    ),
    world_size: int | None = typer.Option(
        None,
        "--world-size",
        min=1,
        help="World size the run will have (default: as train-ab launches it, --nproc x launch.nnodes, else "
        "launch.nproc_per_node x launch.nnodes; a $WORLD_SIZE in the environment is not read); given with "
        "--nproc, it must be that same number.",
    ),
    resume: bool = typer.Option(
        False,
        "--resume",
        help="Check the run train-ab --resume would make (continuing training.output_dir's run).",
    ),
    overwrite: bool = typer.Option(
        False, "--overwrite", help="Check the run train-ab --overwrite would make (its old run moved aside)."
    ),
    push: bool = typer.Option(
        False, "--push", help="Also push the model's weights to every rollout server once (a new version)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object (for CI) instead of lines."),
) -> None:
    """Check a config before a run: config, data, model, packed forward, rollout servers, resources.
    One line per check (OK / WARN / FAIL / SKIP, and the fix); exit 1 when any check fails."""
    from stagectl.cli.common import fail, world_of_nproc
    from stagectl.config import launch_world_size
    from stagectl.doctor.report import exit_code, summary, to_json
    from stagectl.doctor.run import DoctorOptions, run_doctor

    if resume and overwrite:
        fail("--resume and --overwrite contradict each other; give one of them")
    started = time.perf_counter()
    sets = list(overrides)
    if nproc is not None:  # as train-ab and validate-config read it
        sets.append(f"launch.nproc_per_node={nproc}")
        world_size = world_of_nproc(config, sets, nproc, world_size)
    elif world_size is None:
        # the world train-ab's launcher starts, never a $WORLD_SIZE left in the environment
        world_size = launch_world_size(config, sets)
    if overwrite:  # as train-ab reads it
        sets.append("training.overwrite_output_dir=true")
    options = DoctorOptions(config=config, overrides=sets, world_size=world_size, push=push, resume=resume)
    emit = (lambda check: None) if as_json else (lambda check: typer.echo(check.line()))
    checks = run_doctor(options, emit)
    seconds = time.perf_counter() - started
    if as_json:
        typer.echo(json.dumps(to_json(checks, seconds), indent=2))
    else:
        typer.echo(f"{summary(checks)} in {seconds:.1f} s")
    raise typer.Exit(exit_code(checks))
