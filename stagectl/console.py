"""One way every command talks to the user: `command: message` lines on stderr, from rank 0 unless asked.

Progress bars (train-ab) draw above these lines; without a terminal the lines are plain, so logs of
torchrun runs stay readable. Library modules (`inference/`, `weightsync/`, `server/`) log through `logging`
instead; `QuietRepeats` keeps a warning that repeats while its cause lasts to one line per interval.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import threading
import time


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


class QuietRepeats:
    """A warning that repeats while its cause lasts (one per chunk while a server is down) logged at most once
    every `every_s` seconds per key; the next one logged says how many were left out. Thread-safe."""

    def __init__(self, every_s: float = 30.0) -> None:
        self.every_s = every_s
        self._last: dict[object, tuple[float, int]] = {}  # key -> (logged at, left out since)
        self._lock = threading.Lock()

    def warn(self, logger: logging.Logger, key: object, message: str) -> None:
        now = time.monotonic()
        with self._lock:
            logged_at, left_out = self._last.get(key, (-math.inf, 0))
            if now - logged_at < self.every_s:
                self._last[key] = (logged_at, left_out + 1)
                return
            self._last[key] = (now, 0)
        since = f" ({left_out} more like it in the last {now - logged_at:.0f} s)" if left_out else ""
        logger.warning("%s%s", message, since)
