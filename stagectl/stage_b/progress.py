"""Where a Stage-B run is: `progress.json` in the run directory, rank 0's resume point (pure data + file I/O).

Rank 0 rewrites it atomically after every global batch it consumed (and once before the first), so it
always names a batch boundary: the next global batch (epoch, tickets of that epoch's order already judged,
batch index over the run), the consumer's state at that boundary (guidance, counters, the open metrics
window, the reflection queue) and the byte length of every JSONL artifact then. `--resume` cuts each
artifact back to that length (the rows of a batch that was cut off, by a second Ctrl-C or a kill, go),
puts that guidance back in `guidance.json`, and continues with that batch: a resumed run writes the same
rows as one that was never stopped. `status` is `running`, `stopped` (a signal; `stopped_by_signal`) or
`finished`, or `failed` (an error ended it: `error`, its message; the position stays the last batch
boundary, so `--resume` continues from there); `bad_ticket_lines` holds the count and the first locations of the ticket lines the run
skipped (`runner.bad_ticket_lines: skip`), for the summary and the report.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, TypeAdapter, ValidationError

from stagectl.files import atomic_write_text
from stagectl.stage_b.artifacts import ALL_FILES

PROGRESS_FILE = "progress.json"
Status = Literal["running", "stopped", "finished", "failed"]
NUM_LISTED_BAD_LINES = 5


Count = Annotated[int, Field(ge=0)]


@dataclass
class Progress:
    # read back through `_READER` (`read_progress`): an unknown key or a value of another type is an error
    # naming the key, not a traceback later in the resume
    __pydantic_config__ = ConfigDict(extra="forbid")

    tickets_digest: str  # `tickets_digest` of the run's tickets and shuffle seed: resume needs the same
    epoch: Count = 0  # epoch of the next global batch
    epoch_offset: Count = 0  # tickets of that epoch's order already judged
    batch_index: Count = 0  # index of the next global batch over the whole run
    status: Status = "running"
    stopped_by_signal: int | None = None
    consumer: dict[str, Any] = field(default_factory=dict)  # `Consumer.state()`; empty before batch 0
    artifact_bytes: dict[str, Count] = field(default_factory=dict)  # a name of `ALL_FILES` -> its length
    num_bad_ticket_lines: Count = 0
    bad_ticket_lines: list[str] = field(default_factory=list)  # the first NUM_LISTED_BAD_LINES
    error: str | None = None  # status `failed`: what ended the run

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def tickets_digest(keys: list[str], seed: int) -> str:
    """Fingerprint of the ticket keys in file order and the shuffle seed (the epoch orders follow from it)."""
    return hashlib.sha256(json.dumps([seed, keys]).encode()).hexdigest()[:16]


def write_progress(run_dir: Path, progress: Progress) -> None:
    atomic_write_text(run_dir / PROGRESS_FILE, json.dumps(progress.to_json(), ensure_ascii=False) + "\n")


def read_progress(run_dir: Path) -> Progress | None:
    """The run's progress, None when it has no `progress.json`; `ValueError` naming the file when unreadable."""
    path = run_dir / PROGRESS_FILE
    if not path.exists():
        return None
    try:
        progress = _READER.validate_python(json.loads(path.read_text(encoding="utf-8")))
        unknown = sorted(set(progress.artifact_bytes) - set(ALL_FILES))
        if unknown:  # `--resume` truncates each named file: only the run's own artifacts
            raise ValueError(
                f"artifact_bytes names {', '.join(map(repr, unknown))}, not an artifact of a run"
            )
    except (OSError, ValueError, RecursionError) as exc:  # json's errors and pydantic's `ValidationError`
        why = validation_problems(exc) if isinstance(exc, ValidationError) else str(exc)
        raise ValueError(f"{path}: not a Stage-B progress file ({why}); the run cannot be resumed") from None
    return progress


_READER = TypeAdapter(Progress)


def validation_problems(exc: ValidationError, prefix: str = "") -> str:
    """`field: message` for each problem pydantic found (the first five), joined."""
    problems = [
        f"{prefix}{'.'.join(map(str, err['loc'])) or '<file>'}: {err['msg']}" for err in exc.errors()[:5]
    ]
    more = exc.error_count() - len(problems)
    return "; ".join(problems) + (f"; and {more} more" if more > 0 else "")


def check_artifacts(run_dir: Path, lengths: dict[str, int]) -> None:
    """`ValueError` when an artifact is shorter than `progress.json` recorded (changed after the run stopped)."""
    for name, length in lengths.items():
        path = run_dir / name
        size = path.stat().st_size if path.exists() else 0
        if size < length:
            raise ValueError(
                f"{path} holds {size} bytes but {run_dir / PROGRESS_FILE} recorded {length}: the file changed "
                "after the run stopped, so the run cannot be resumed exactly; start a new run (--overwrite)"
            )


def cut_artifacts(run_dir: Path, lengths: dict[str, int]) -> dict[str, int]:
    """Truncate every artifact to its recorded length (checked by `check_artifacts`); returns the bytes removed
    per file: the rows of a batch that was cut off."""
    removed: dict[str, int] = {}
    for name, length in lengths.items():
        path = run_dir / name
        size = path.stat().st_size if path.exists() else 0
        if size > length:
            with path.open("r+b") as handle:
                handle.truncate(length)
            removed[name] = size - length
    return removed


def describe(progress: Progress) -> str:
    """`finished`, `stopped by signal 2 before global batch 3 (epoch 0)`, `failed before ...` (the error is
    in the report), ..."""
    where = f"before global batch {progress.batch_index} (epoch {progress.epoch})"
    if progress.status == "finished":
        return "finished"
    if progress.status == "stopped":
        return f"stopped by signal {progress.stopped_by_signal} {where}"
    if progress.status == "failed":
        return f"failed {where}"
    return f"not finished (killed, or still running) {where}"
