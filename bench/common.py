"""Timing helpers shared by the benchmarks: interleaved repeats and min/median/max summaries; the code a
benchmark measured (`code_version`)."""

from __future__ import annotations

import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

# what a benchmark run writes itself: never a reason to call the measured code uncommitted
OUTPUTS = (":(exclude)bench/results", ":(exclude)bench/plots", ":(exclude)BENCHMARKS.md")


def code_version(root: Path) -> str:
    """The commit of `root` a benchmark ran, `+uncommitted` when tracked files differ from it (its own
    outputs aside): a result measured on code no commit holds cannot be reproduced, and the page says so.
    "unknown" outside a git checkout."""
    try:
        sha = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        changed = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no", "--", ".", *OUTPUTS],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"{sha}+uncommitted" if changed else sha


def interleaved_times_s(
    fns: Sequence[Callable[[], object]], repeats: int, warmup: int = 1
) -> list[list[float]]:
    """Time each callable `repeats` times, alternating between them so load drift hits all alike."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, out in zip(fns, times, strict=True):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    return times


def summary(values: Sequence[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}
