"""One way every command talks to the user: `command: message` lines on stderr, from rank 0 unless asked.

Progress bars (train-ab) draw above these lines; without a terminal the lines are plain, so logs of
torchrun runs stay readable. Library modules (`rollout/`) log through `logging` instead.
"""

from __future__ import annotations

import os
import sys


def is_main_rank() -> bool:
    return os.environ.get("RANK", "0") == "0"


def say(command: str, message: str, *, every_rank: bool = False) -> None:
    """Print `command: message` to stderr (rank 0 only, unless `every_rank`; then the rank is named)."""
    if every_rank:
        rank = os.environ.get("RANK")
        prefix = f"{command} (rank {rank})" if rank is not None else command
    elif not is_main_rank():
        return
    else:
        prefix = command
    print(f"{prefix}: {message}", file=sys.stderr, flush=True)


def plural(count: int, noun: str, many: str | None = None) -> str:
    """`1 reflection`, `2 reflections`, `0 reflections` (`many`: the plural when it is not `noun` + s)."""
    return f"{count} {noun if count == 1 else (many or noun + 's')}"


def error_text(exc: BaseException, expected: tuple[type[BaseException], ...]) -> str:
    """What a run's end records of the error that ended it: the `error:` line a command prints for an
    `expected` error (its message), the type and message of anything else (a bug: its traceback follows)."""
    if isinstance(exc, expected) and str(exc):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"
