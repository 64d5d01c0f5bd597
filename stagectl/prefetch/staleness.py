"""Version arithmetic of async Channel-B, as pure functions (no threads, no I/O).

A ready pack built from rollouts of policy version `ver` is *eligible* at learner version `current`
iff `current - version_window <= ver <= current`; older packs are *stale* (dropped, never trained).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal


def is_stale(ver: int, current_ver: int, version_window: int) -> bool:
    return ver < current_ver - version_window


def eligible_versions(current_ver: int, version_window: int) -> list[int]:
    """Versions a B step may consume, oldest first."""
    return list(range(max(0, current_ver - version_window), current_ver + 1))


def choose_b_version(versions: Sequence[int], min_counts: Sequence[int], gas: int) -> int | None:
    """The feasibility gate: `min_counts[i]` is the MIN over ranks of packs held of `versions[i]`.
    A version is feasible when every rank holds at least `gas` packs of it; the oldest feasible one
    wins (it is the first to go stale). None when no version is feasible."""
    for ver, count in zip(versions, min_counts, strict=True):
        if count >= gas:
            return ver
    return None


def decide_step(
    policy_wants_b: bool, versions: Sequence[int], min_counts: Sequence[int], gas: int
) -> tuple[Literal["A", "B"], int | None]:
    """Policy gate then feasibility gate: ("B", ver) or ("A", None). Wants-B-but-infeasible -> A."""
    if not policy_wants_b:
        return "A", None
    ver = choose_b_version(versions, min_counts, gas)
    return ("B", ver) if ver is not None else ("A", None)
