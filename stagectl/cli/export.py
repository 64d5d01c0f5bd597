"""`stagectl export CHECKPOINT OUT [--dtype D] [--add-coord-tokens]`: a clean Hugging Face model directory."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, cast

import typer

from stagectl.cli.common import fail

if TYPE_CHECKING:
    from stagectl.models.loading import TorchDtype


def command(
    checkpoint: str = typer.Argument(
        ..., help="A train-ab checkpoint-N dir, a run dir (its newest checkpoint), or any model dir."
    ),
    out: Path = typer.Argument(..., help="New (or empty) directory to write the model into."),
    dtype: str | None = typer.Option(
        None, "--dtype", help="float32 (fp32), bfloat16 (bf16) or float16 (fp16, half); default: as saved."
    ),
    add_coord_tokens: bool = typer.Option(
        False,
        "--add-coord-tokens",
        help="Add the 1000 coordinate tokens (a base model for a vLLM rollout server in detection training).",
    ),
) -> None:
    """Write a model that transformers and vLLM load as they load the base: weights, config, tokenizer
    with chat template, image processor and a model card; no optimizer or trainer state."""
    from stagectl.config.dtypes import canonical_dtype

    if dtype is not None:
        try:
            dtype = canonical_dtype(dtype)
        except ValueError as exc:
            fail(f"--dtype: {exc}")
    from stagectl.files import check_new_output_dir

    source = Path(checkpoint).expanduser()
    if (source / "adapter_config.json").is_file() and not (source / "config.json").is_file():
        # a PEFT adapter alone: train-ab's checkpoint-N/ holds it in adapter/ and the merged model in model/
        parent = source.parent if source.name == "adapter" else None
        hint = (
            f"export the checkpoint it belongs to, whose model/ holds the merged weights: stagectl export {parent} OUT"
            if parent is not None and (parent / "model" / "config.json").is_file()
            else "export needs a full model; merge the adapter into its base model first"
        )
        fail(f"{checkpoint} is a LoRA adapter (adapter_config.json, no config.json), not a model: {hint}")

    try:
        check_new_output_dir(
            out, "OUT"
        )  # a parent that is a file, or not writable: named before the model loads
    except ValueError as exc:
        fail(str(exc))
    from stagectl.models.export import export_model  # heavy: torch + transformers

    try:
        summary = export_model(
            checkpoint,
            out,
            torch_dtype=cast("TorchDtype | None", dtype),  # canonical_dtype above
            add_coord_tokens=add_coord_tokens,
        )
    except (ValueError, FileNotFoundError) as exc:
        fail(str(exc))
    except OSError as exc:  # e.g. the disk filled while writing: export_model removed its staging directory
        fail(f"OUT: cannot write the model to {out}: {exc.strerror or exc}")
    coords = (
        "no coordinate tokens"
        if summary.coord_token_ids is None
        else f"coordinate tokens at ids {summary.coord_token_ids[0]}..{summary.coord_token_ids[1]}"
    )
    masters = f", from {summary.source.parent.name}'s float32 master weights" if summary.from_masters else ""
    typer.echo(
        f"exported {summary.source} ({summary.model_type}, {summary.dtype}{masters}, {coords}) to {summary.out}"
    )
