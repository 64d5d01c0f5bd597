"""`stagectl tiny-model OUT --arch ...`: write a built-in tiny checkpoint (Qwen-VL, or a text chat model) to a
directory. The checkpoint is built in a staging directory next to OUT and renamed into place, so OUT appears
whole or not at all (a failed or interrupted build leaves no half-written OUT that a second try would refuse)."""

from __future__ import annotations

import os
import shutil
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
    from stagectl.files import check_new_output_dir, follow_umask, make_staging_dir

    try:
        check_new_output_dir(out, "OUT")  # a parent that is a file, or not writable: named before torch loads
    except ValueError as exc:
        fail(str(exc))
    from stagectl.models.tiny import TinyArch, build_tiny_model  # heavy: torch + transformers

    out.parent.mkdir(parents=True, exist_ok=True)
    staging = make_staging_dir(out.parent, f".{out.name}.")
    try:
        build_tiny_model(cast(TinyArch, arch), staging)  # arch checked against ARCH_CHOICES above
        follow_umask(staging)  # save_pretrained leaves model.safetensors 0600
        if out.exists():
            out.rmdir()  # empty (checked above)
        os.replace(staging, out)
    except OSError as exc:
        shutil.rmtree(staging, ignore_errors=True)
        fail(f"OUT: cannot write the model to {out}: {exc.strerror or exc}")
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    typer.echo(f"wrote tiny {arch} model to {out}")
