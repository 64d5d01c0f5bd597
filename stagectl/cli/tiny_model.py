"""`stagectl tiny-model OUT --arch ...`: write a built-in tiny checkpoint (Qwen-VL, or a text chat model) to a
directory."""

from __future__ import annotations

from pathlib import Path
from typing import cast

import typer

from stagectl.cli.common import fail

ARCH_CHOICES = ("qwen2.5-vl", "qwen2-vl", "qwen3-vl", "qwen2", "llama3", "qwen3", "gemma3")


def command(
    out: Path = typer.Argument(..., help="Directory to write the checkpoint into (created if missing)."),
    arch: str = typer.Option(
        "qwen2.5-vl",
        "--arch",
        help="Architecture: qwen2.5-vl, qwen2-vl, qwen3-vl; text-only qwen2, or the chat models llama3, "
        "qwen3, gemma3 (their real chat templates, no coordinate tokens).",
    ),
) -> None:
    """Build the tiny random-weight model (tokenizer, image processor, chat template) for offline runs."""
    if arch not in ARCH_CHOICES:
        fail(f"--arch {arch!r} is not one of {', '.join(ARCH_CHOICES)}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        fail(f"{out} exists and is not an empty directory; choose a new path")
    from stagectl.models.tiny import TinyArch, build_tiny_model  # heavy: torch + transformers

    path = build_tiny_model(cast(TinyArch, arch), out)  # arch checked against ARCH_CHOICES above
    typer.echo(f"wrote tiny {arch} model to {path}")
