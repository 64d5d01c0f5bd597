"""What `samples.jsonl` (the per-sample audit trail) says, as plain data (pure): the staleness of each
B step's samples and how many samples each epoch of each channel's stream trained.

A sample's staleness is `train_version - gen_version` (policy versions between the weights that
generated its rollout and the weights it trained). Epoch `e` of rank `r`'s stream of a channel is its
positions `[e * share, (e + 1) * share)`, `share` being the rank's share of the data set (the sampler's
rule: `len(range(r, num_samples, world_size))`), so an epoch's count says how much of it was trained.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from stagectl.report.values import Row


@dataclass(frozen=True)
class EpochCount:
    channel: str
    epoch: int
    trained: int  # samples trained from this epoch's positions (every rank)
    distinct: int  # distinct sample ids among them
    size: int  # samples in one epoch (the data set)


def b_staleness(rows: Sequence[Row]) -> dict[int, Counter[int]]:
    """Per B step: how many of its samples had each staleness."""
    out: dict[int, Counter[int]] = {}
    for row in rows:
        if row.get("channel") == "B" and isinstance(row.get("gen_version"), int):
            lag = int(row["train_version"]) - int(row["gen_version"])
            out.setdefault(int(row["step"]), Counter())[lag] += 1
    return dict(sorted(out.items()))


def samples_per_epoch(rows: Sequence[Row], num_samples: int, world_size: int) -> list[EpochCount]:
    """Trained samples per (channel, epoch), every rank together."""
    shares = [len(range(rank, num_samples, world_size)) for rank in range(world_size)]
    trained: dict[tuple[str, int], list[int]] = {}
    for row in rows:
        rank = int(row["rank"])
        if rank >= world_size or shares[rank] == 0:
            raise ValueError(f"samples.jsonl: rank {rank} outside a world of {world_size}")
        epoch = int(row["stream_pos"]) // shares[rank]
        trained.setdefault((str(row["channel"]), epoch), []).append(int(row["sample"]))
    return [
        EpochCount(channel, epoch, len(ids), len(set(ids)), num_samples)
        for (channel, epoch), ids in sorted(trained.items())
    ]
