"""`stagectl convert coco INSTANCES_JSON --images DIR --out OUT.jsonl`: other formats into the detection JSONL."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import typer

from stagectl.cli.common import fail

app = typer.Typer(
    help="Convert other annotation formats into the detection JSONL that train-ab reads.",
    no_args_is_help=True,
)


@app.command("coco")
def coco(
    instances_json: Path = typer.Argument(
        ..., help="COCO instances file (instances_val2017.json, an LVIS or Objects365 export)."
    ),
    images: Path = typer.Option(..., "--images", help="Directory the images' file_name entries are under."),
    out: Path = typer.Option(..., "--out", help="JSONL to write (replaced whole; nothing written on error)."),
    drop_empty: bool = typer.Option(
        False, "--drop-empty", help="Leave out images with no object (kept as empty samples by default)."
    ),
    check_images: bool = typer.Option(
        True, "--check-images/--no-check-images", help="Check every image file exists (a stat each)."
    ),
) -> None:
    """Write the detection JSONL of a COCO instances file: pixel xyxy boxes (train with data.box_format:
    pixel), category names as desc, COCO image and category ids kept; crowd regions (iscrowd: 1) kept apart
    as eval-only ignore regions, never trained on; zero-area boxes (in pixels or on the norm-1000 grid the
    loader bins them to) and out-of-image boxes left out and counted."""
    from stagectl.data.coco import CocoError, convert_coco_file

    try:
        with _progress_bar(instances_json) as on_progress:
            stats = convert_coco_file(
                instances_json,
                images,
                out,
                check_images=check_images,
                drop_empty=drop_empty,
                on_progress=on_progress,
            )
    except CocoError as exc:
        fail(str(exc))
    except OSError as exc:
        fail(f"--out {out}: cannot write: {exc.strerror or exc}")
    typer.echo(stats.summary(out))


@contextmanager
def _progress_bar(instances_json: Path) -> Iterator[Callable[[int, int], None] | None]:
    """A rich bar (reading, then the annotations, then writing) on a terminal, transient so only the summary
    line stays; nothing without a terminal, so logs hold one line: the summary or the error."""
    from rich.console import Console
    from rich.markup import escape
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    if not console.is_terminal:
        yield None
        return
    progress = Progress(
        TextColumn("[bold]convert coco[/bold] {task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    )
    size = f" ({instances_json.stat().st_size / 1e6:.1f} MB)" if instances_json.is_file() else ""
    # json.load reports no progress: the bar pulses, named after the file, until the annotations start
    task = progress.add_task(f"reading {escape(instances_json.name)}{size}", total=None)

    def on_progress(done: int, total: int) -> None:
        phase = "annotations" if done < total else "writing the JSONL"
        progress.update(task, completed=done, total=total, description=phase)

    with progress:
        yield on_progress
