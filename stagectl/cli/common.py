"""Helpers shared by the command modules: error exits and the "not implemented" exit."""

from __future__ import annotations

from typing import NoReturn

import typer


def fail(message: str, code: int = 1) -> NoReturn:
    """Print a one-line (or multi-line, already formatted) error to stderr and exit."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def not_implemented(command: str) -> NoReturn:
    """Exit 2 for a command whose issue has not landed: it must not pretend to work."""
    typer.echo(f"stagectl {command}: not implemented yet", err=True)
    raise typer.Exit(2)
