"""Timing helpers shared by the benchmarks: interleaved repeats and min/median/max summaries."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence


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
