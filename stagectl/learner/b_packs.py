"""`PackBuilder`: how every Channel-B producer turns rollouts into micro-batches — step mode in process,
step mode over servers and the async prefetcher alike.

One object decides packed vs padded (`training.packing`) once: packed, the segments of a B step are
spread over packs of at most `packing_length` tokens (`collate_pack`); padded (`packing: false`), a
micro-batch is `per_device_train_batch_size` segments in order (`collate_padded`). The segments
themselves come from the judge and the target plan (`segments`: parse -> match -> target -> encode).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from stagectl.collate import PackedBatch, Segment, collate_pack, collate_padded
from stagectl.config.plan import MatchCosts, TargetPlan
from stagectl.detection.stats import RolloutStats
from stagectl.learner.channel_b import build_b_segments
from stagectl.learner.segments import SampleEncoder
from stagectl.learner.setup import LearnerState
from stagectl.models.generate import Generation
from stagectl.packing import pack_into, pack_segments


@dataclass(frozen=True)
class PackBuilder:
    encoder: SampleEncoder
    target: TargetPlan
    match: MatchCosts
    packing_length: int
    model: Any  # what `collate_pack` reads its position ids from (the unwrapped policy)
    segments_per_pack: int | None = None  # None: packed; else `packing: false`'s padded batch size

    @property
    def packed(self) -> bool:
        return self.segments_per_pack is None

    def segments(
        self, indices: Sequence[int], generations: Sequence[Generation]
    ) -> tuple[list[tuple[int, Segment, RolloutStats]], RolloutStats]:
        """Each kept rollout as (its offset in `indices`, its segment, its counters), and the summed
        counters of those too long for `packing_length` (dropped)."""
        return build_b_segments(
            indices, generations, self.encoder, self.target, self.match, packing_length=self.packing_length
        )

    def collate(self, segments: list[Segment]) -> PackedBatch:
        """One micro-batch of `segments`: a pack, or a right-padded batch."""
        if self.packed:
            return collate_pack(segments, self.model)
        return collate_padded(segments, self.encoder.pad_token_id)

    def step_groups(self, lengths: Sequence[int]) -> list[list[int]]:
        """Step mode: every segment of the step in the fewest packs (padded: batches in order)."""
        if self.segments_per_pack is None:
            return pack_segments(lengths, self.packing_length)
        size = self.segments_per_pack
        return [list(range(k, min(k + size, len(lengths)))) for k in range(0, len(lengths), size)]

    def groups(self, lengths: list[int], num_packs: int) -> tuple[list[list[int]], list[int]]:
        """Async: (the segment indices of each pack, the indices left over) for a burst's segments: at most
        `num_packs` packs, each at most `packing_length` tokens (`packing.pack_into`), or, padded, of exactly
        `segments_per_pack` segments in order."""
        if self.segments_per_pack is None:
            return pack_into(lengths, num_packs, self.packing_length)
        size = self.segments_per_pack
        groups = [list(range(k * size, (k + 1) * size)) for k in range(min(num_packs, len(lengths) // size))]
        return groups, list(range(len(groups) * size, len(lengths)))

    @classmethod
    def of_state(cls, state: LearnerState) -> PackBuilder:
        """The run's builder from a `LearnerState` (its plan, encoder and model)."""
        plan = state.plan
        training = plan.training
        return cls(
            encoder=state.encoder,
            target=plan.channel_b.target,
            match=plan.channel_b.match,
            packing_length=plan.packing_length,
            model=state.bundle.model,
            segments_per_pack=None if training.packing else training.per_device_train_batch_size,
        )
