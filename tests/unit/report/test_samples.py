"""The pure summaries of `samples.jsonl`: B staleness per step and samples trained per epoch."""

from __future__ import annotations

from collections import Counter

import pytest

from stagectl.report.samples import EpochCount, b_staleness, samples_per_epoch


def _b(step: int, gen: int, train: int, rank: int = 0, pos: int = 0) -> dict[str, int | str]:
    return {
        "step": step,
        "channel": "B",
        "rank": rank,
        "sample": pos,
        "stream_pos": pos,
        "gen_version": gen,
        "train_version": train,
    }


def test_staleness_counts_each_b_steps_samples_by_version_gap() -> None:
    rows = [
        _b(3, 0, 1),
        _b(3, 1, 1),
        _b(3, 0, 1),
        {"step": 4, "channel": "A", "rank": 0, "sample": 1, "stream_pos": 0},
        _b(5, 0, 2),
    ]
    assert b_staleness(rows) == {3: Counter({1: 2, 0: 1}), 5: Counter({2: 1})}


def test_epochs_follow_each_ranks_share_of_the_data_set() -> None:
    # 5 samples over 2 ranks: rank 0's share is 3 positions per epoch, rank 1's is 2
    rows = [
        {"step": 0, "channel": "A", "rank": 0, "sample": s, "stream_pos": p}
        for p, s in enumerate([4, 0, 2, 4])
    ]
    rows += [
        {"step": 0, "channel": "A", "rank": 1, "sample": s, "stream_pos": p} for p, s in enumerate([1, 3, 3])
    ]
    assert samples_per_epoch(rows, num_samples=5, world_size=2) == [
        EpochCount("A", 0, trained=5, distinct=5, size=5),
        EpochCount("A", 1, trained=2, distinct=2, size=5),
    ]


def test_a_rank_outside_the_world_is_named() -> None:
    with pytest.raises(ValueError, match="rank 3 outside a world of 2"):
        samples_per_epoch([{"channel": "A", "rank": 3, "sample": 0, "stream_pos": 0}], 4, 2)
