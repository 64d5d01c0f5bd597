"""Helpers shared by the command modules: the one-line error exit, the world size `--nproc` makes."""

from __future__ import annotations

from os import PathLike
from typing import NoReturn

import typer


def fail(message: str, code: int = 1) -> NoReturn:
    """Print a one-line (or multi-line, already formatted) error to stderr and exit."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def world_of_nproc(
    config: str | PathLike[str], sets: list[str], nproc: int, world_size: int | None = None
) -> int:
    """`--nproc N` as train-ab launches it, N x launch.nnodes ranks (`stagectl.config.nproc_world_size`); a
    `--world-size` given too that names another world is a usage error (exit 2) naming both."""
    from stagectl.config import WorldSizeConflict, nproc_world_size

    try:
        return nproc_world_size(config, sets, nproc, world_size)
    except WorldSizeConflict as exc:
        fail(str(exc), code=2)
