"""`stagectl rollout-server`."""

from __future__ import annotations

from pathlib import Path

import typer

from stagectl.cli.common import not_implemented


def command(
    config: Path = typer.Argument(..., help="Path to the YAML config."),
) -> None:
    """Not implemented yet."""
    not_implemented("rollout-server")
