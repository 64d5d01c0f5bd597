"""Deterministic, per-rank sharded, per-epoch reshuffled sample index streams (Channel-A and Channel-B).

Epoch `e` of stream `s` is one permutation of `range(num_samples)`, a pure function of
`(seed, s, e)`; rank `r` of `world_size` walks the strided share `perm[r::world_size]`, so within an
epoch the ranks' shares are disjoint and together cover every sample once. When a rank reaches the end
of its share it moves on to the next epoch's permutation: the stream never ends.

Different stream names ("A", "B") give independent orders over the same data, so Channel-B's rollout
samples do not follow Channel-A's teacher-forcing order. A rank's share has a fixed length every epoch,
so its position is fully determined by how many indices it has consumed: `ShardedSampler(...,
num_consumed=k)` resumes exactly where a run that consumed `k` left off, and
`state_dict()` / `load_state_dict()` carry the same information through a checkpoint.

Permutations use `random.Random` seeded by a string (sha512 inside), not numpy, so an order is the same
on every machine and numpy version (resume must never change the data order).
"""

from __future__ import annotations

import random
from typing import Any


def epoch_permutation(num_samples: int, seed: int, stream: str, epoch: int) -> list[int]:
    """The order of every sample index in one epoch of one stream."""
    order = list(range(num_samples))
    random.Random(f"stagectl-sampler/{seed}/{stream}/{epoch}").shuffle(order)
    return order


def share_length(num_samples: int, rank: int, world_size: int) -> int:
    """How many indices rank `rank` gets per epoch (`num_samples / world_size`, the first ranks get
    one more when it does not divide)."""
    return len(range(rank, num_samples, world_size))


class ShardedSampler:
    """An endless iterator of sample indices for one rank of one stream."""

    def __init__(
        self,
        num_samples: int,
        *,
        rank: int,
        world_size: int,
        seed: int,
        stream: str,
        num_consumed: int = 0,
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in 0..{world_size - 1}, got {rank}")
        if num_samples < world_size:
            raise ValueError(
                f"the data set has {num_samples} samples but there are {world_size} ranks: "
                "every rank needs at least one sample per epoch; use more samples or fewer ranks"
            )
        if num_consumed < 0:
            raise ValueError(f"num_consumed must be >= 0, got {num_consumed}")
        self.num_samples = num_samples
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.stream = stream
        self.share_length = share_length(num_samples, rank, world_size)
        self._share: list[int] = []
        self._share_epoch = -1
        self.num_consumed = num_consumed

    @property
    def epoch(self) -> int:
        """The epoch the next index comes from."""
        return self.num_consumed // self.share_length

    @property
    def position(self) -> int:
        """The offset of the next index inside this rank's share of `epoch`."""
        return self.num_consumed % self.share_length

    def epoch_share(self, epoch: int) -> list[int]:
        """This rank's indices for one epoch, in order."""
        if epoch != self._share_epoch:
            order = epoch_permutation(self.num_samples, self.seed, self.stream, epoch)
            self._share = order[self.rank :: self.world_size]
            self._share_epoch = epoch
        return self._share

    def __iter__(self) -> ShardedSampler:
        return self

    def __next__(self) -> int:
        index = self.epoch_share(self.epoch)[self.position]
        self.num_consumed += 1
        return index

    def take(self, count: int) -> list[int]:
        """The next `count` indices (crossing epoch boundaries as needed)."""
        return [next(self) for _ in range(count)]

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume; `epoch`/`position` are informational (derived from the count)."""
        return {
            **self._identity(),
            "num_consumed": self.num_consumed,
            "epoch": self.epoch,
            "position": self.position,
        }

    def _identity(self) -> dict[str, Any]:
        return {
            "num_samples": self.num_samples,
            "rank": self.rank,
            "world_size": self.world_size,
            "seed": self.seed,
            "stream": self.stream,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved state; the identity fields must match this sampler."""
        for key, value in self._identity().items():
            if state.get(key) != value:
                raise ValueError(
                    f"sampler state was saved with {key}={state.get(key)!r} but this run has "
                    f"{key}={value!r}; resume with the same data, seed and world size"
                )
        num_consumed = state.get("num_consumed")
        if not isinstance(num_consumed, int) or num_consumed < 0:
            raise ValueError(f"sampler state has an invalid num_consumed: {num_consumed!r}")
        self.num_consumed = num_consumed
