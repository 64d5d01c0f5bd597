"""Rollouts to micro-batches, the one path every Channel-B producer takes (step mode in process, step
mode over servers, the async prefetcher): rollout -> strict parse -> match (`MatchCosts`) -> target (raw or
clean prefix + FN append, or reordered GT: `TargetPlan`) -> segment -> packs -> collated micro-batch.

`PackBuilder` decides packed vs padded (`training.packing`) once: packed, the segments are spread over
packs of at most `packing_length` tokens (`collate_pack`); padded (`packing: false`), a micro-batch is
`per_device_train_batch_size` segments in order (`collate_padded`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from stagectl.collate import PackedBatch, Segment, collate_pack, collate_padded
from stagectl.config.plan import MatchCosts, TargetPlan
from stagectl.detection.canonical_targets import (
    build_channel_b_clean_segment,
    build_channel_b_reordered_gt_segment,
)
from stagectl.detection.judge import judge_rollout, match_objects
from stagectl.detection.matching import MatchResult
from stagectl.detection.parse import RolloutParse
from stagectl.detection.stats import RolloutStats
from stagectl.detection.targets import build_channel_b_segment
from stagectl.learner.segments import SampleEncoder, to_segment
from stagectl.learner.setup import LearnerState
from stagectl.models.generate import Generation
from stagectl.packing import pack_into, pack_segments
from stagectl.seeds import derive_seed


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


def score_rollout(
    index: int,
    generation: Generation,
    encoder: SampleEncoder,
    target: TargetPlan,
    costs: MatchCosts,
) -> tuple[RolloutParse, MatchResult, list[int], RolloutStats]:
    """Strict parse + match (`costs`) of one rollout against its sample's GT, the indices of its
    duplicate predictions, and its counters (duplicates count as predictions: a matched one is a hit, else
    an FP)."""
    return judge_rollout(
        generation.token_ids,
        encoder.samples[index].objects,
        encoder.vocab,
        costs,
        duplicate_iou_threshold=target.duplicate_iou_threshold,
    )


def build_b_segment(
    index: int,
    generation: Generation,
    encoder: SampleEncoder,
    target: TargetPlan,
    costs: MatchCosts,
    *,
    packing_length: int,
) -> tuple[Segment | None, RolloutStats]:
    """The Channel-B segment of one rollout (None when it exceeds `packing_length`: dropped, counted), in
    the target form `target.kind` names."""
    parse, match, duplicates, stats = score_rollout(index, generation, encoder, target, costs)
    gt = encoder.samples[index].objects
    if target.kind == "raw_prefix":
        assistant = build_channel_b_segment(
            parse, match, gt, encode=encoder.encode_text, vocab=encoder.vocab, target=target
        )
    else:
        dup_set = set(duplicates)
        accepted = [obj for i, obj in enumerate(parse.valid_objects) if i not in dup_set]
        # duplicates never take a GT object from the object they repeat
        accepted_match = match_objects(accepted, gt, costs)
        build = (
            build_channel_b_clean_segment
            if target.kind == "clean_prefix"
            else build_channel_b_reordered_gt_segment
        )
        assistant = build(
            accepted, accepted_match, gt, encode=encoder.encode_text, vocab=encoder.vocab, target=target
        )
    segment = to_segment(encoder.prompt(index), assistant)
    if len(segment) > packing_length:
        stats.n_too_long = 1
        return None, stats
    return segment, stats


def build_b_segments(
    indices: Sequence[int],
    generations: Sequence[Generation],
    encoder: SampleEncoder,
    target: TargetPlan,
    costs: MatchCosts,
    *,
    packing_length: int,
) -> tuple[list[tuple[int, Segment, RolloutStats]], RolloutStats]:
    """Each kept rollout as (its offset in `indices`, its segment, its counters), and the summed counters
    of the dropped ones (the offset says which sample a segment trains: the audit trail needs it)."""
    kept: list[tuple[int, Segment, RolloutStats]] = []
    dropped = RolloutStats()
    for offset, (index, generation) in enumerate(zip(indices, generations, strict=True)):
        segment, stats = build_b_segment(
            index, generation, encoder, target, costs, packing_length=packing_length
        )
        if segment is None:
            dropped.add(stats)
        else:
            kept.append((offset, segment, stats))
    return kept, dropped


def rollout_seed(seed: int, step: int) -> int:
    """Seed of step-mode step `step`'s rollouts: a stable function of (training seed, step)."""
    return derive_seed(seed, step)
