"""`stagectl demo-data`: write the synthetic shapes data set (images + JSONL) to a directory."""

from __future__ import annotations

from pathlib import Path

import typer

from stagectl.cli.common import fail
from stagectl.console import plural


def command(
    out: Path = typer.Argument(..., help="Directory to write images/, train.jsonl (and eval.jsonl) into."),
    num_samples: int = typer.Option(64, "--num-samples", help="Number of training samples."),
    seed: int = typer.Option(0, "--seed", help="Seed; the same seed writes byte-identical files."),
    image_size: int = typer.Option(
        112, "--image-size", help="Square image side in pixels; multiples of 28 suit the tiny model."
    ),
    max_objects: int = typer.Option(4, "--max-objects", help="Shapes per image are drawn from MIN..N."),
    min_objects: int = typer.Option(
        1, "--min-objects", help="Fewest shapes drawn per image (a crowded image may place fewer)."
    ),
    side_fraction: tuple[float, float] = typer.Option(
        (0.15, 0.35), "--side-fraction", help="Shape sides as fractions of the image side: LOW HIGH."
    ),
    num_eval_samples: int = typer.Option(
        0, "--num-eval-samples", help="Also write a held-out eval.jsonl with this many samples."
    ),
) -> None:
    """Write the synthetic shapes data set: coloured shapes with exact norm-1000 boxes. Writing again into
    the same OUT replaces what an earlier demo-data wrote there (its extra images, an eval split not asked
    for now); other files are left alone, and a train.jsonl (eval.jsonl) it did not write is refused."""
    from stagectl.data.synthetic import generate_synthetic, remove_synthetic_split
    from stagectl.files import check_output_dir

    if num_eval_samples < 0:
        fail(f"--num-eval-samples must be >= 0, got {num_eval_samples}")
    for split in ("train", "eval") if num_eval_samples else ("train",):
        jsonl = out / f"{split}.jsonl"
        if jsonl.exists() and not (out / f"{split}.manifest.json").exists():
            fail(
                f"OUT: {jsonl} exists and no earlier demo-data wrote it (no {split}.manifest.json next to it); "
                "nothing was written. Choose another OUT, or move that file away"
            )
    try:
        check_output_dir(out, "OUT")
        train = generate_synthetic(
            num_samples,
            seed,
            out,
            image_size,
            max_objects=max_objects,
            min_objects=min_objects,
            side_fraction=side_fraction,
        )
        evals = (
            generate_synthetic(
                num_eval_samples,
                seed,
                out,
                image_size,
                max_objects=max_objects,
                min_objects=min_objects,
                side_fraction=side_fraction,
                split="eval",
            )
            if num_eval_samples
            else []
        )
        if not num_eval_samples:  # an eval split an earlier run wrote here is not this data set's
            remove_synthetic_split(out, "eval")
    except (ValueError, OSError) as exc:
        fail(str(exc))
    num_objects = sum(len(sample.objects) for sample in train)
    summary = (
        f"wrote {plural(len(train), 'sample')} ({plural(num_objects, 'object')}, {image_size}px) to "
        f"{out / 'train.jsonl'}"
    )
    if evals:
        summary += f" and {len(evals)} to {out / 'eval.jsonl'}"
    typer.echo(summary)
