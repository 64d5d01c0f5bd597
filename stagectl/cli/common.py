"""Helpers shared by the command modules: the one-line error exit."""

from __future__ import annotations

from typing import NoReturn

import typer


def fail(message: str, code: int = 1) -> NoReturn:
    """Print a one-line (or multi-line, already formatted) error to stderr and exit."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)
