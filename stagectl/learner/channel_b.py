"""Channel-B: the one interface the trainer drives (`ChannelB`: step or async mode), and the core both
modes share: rollouts -> strict parse -> match (`channel_b.match`) -> targets (raw or clean prefix + FN
append, or reordered GT) -> packable segments, plus rollout-quality counters.

Per optimizer step the trainer calls `decide` (every rank; a collective in async mode), then `run` for a
B step (exactly `gas` micro-steps' worth of forward/backward, then the trainer's one optimizer update),
then `after_update` (weight sync when due) and `metrics`; `close` once at the end.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from stagectl.collate import Segment
from stagectl.config.plan import MatchCosts, TargetPlan
from stagectl.detection.judge import judge_rollout, match_objects
from stagectl.detection.matching import MatchResult
from stagectl.detection.parse import RolloutParse
from stagectl.detection.stats import RolloutStats
from stagectl.detection.targets import (
    build_channel_b_clean_segment,
    build_channel_b_reordered_gt_segment,
    build_channel_b_segment,
)
from stagectl.learner.b_steps import SkipReason
from stagectl.learner.packs import StepAccumulator
from stagectl.learner.segments import SampleEncoder, to_segment
from stagectl.models.generate import Generation
from stagectl.seeds import derive_seed


@dataclass(frozen=True)
class Decision:
    kind: Literal["A", "B"]
    ver: int | None = None  # async: the policy version whose packs the B step trains
    reason: SkipReason | None = None  # a wanted B step that trains as A: why (`b_steps`)


class ChannelB(Protocol):
    def start(self) -> None:
        """Begin producing (async: start the prefetcher)."""
        ...

    def decide(self, step: int, policy_wants_b: bool) -> tuple[Decision, dict[str, Any]]:
        """The step's channel on every rank (rank 0 decides), plus metrics of the decision."""
        ...

    def run(self, step: int, decision: Decision, acc: StepAccumulator) -> dict[str, Any]:
        """A B step's forward/backward passes (the caller makes the one optimizer update)."""
        ...

    def after_update(self, num_updates: int) -> dict[str, Any]:
        """After the optimizer update: weight sync when due."""
        ...

    def metrics(self) -> dict[str, Any]:
        """Cumulative Channel-B metrics for the step's row (may be a collective), with its rollout client's
        and weight sync's counters when it has servers."""
        ...

    def rank_state(self) -> dict[str, Any]:
        """This rank's Channel-B stream positions (async: and its async state under "async", which the
        checkpoint writes to its own file), saved with a checkpoint."""
        ...

    def saved_version(self) -> dict[str, Any]:
        """What a checkpoint records of the policy version (async: `ver`, `ver_is_weights`; else empty)."""
        ...

    def close(self, deadline_s: float) -> None:
        """Stop producing, close the rollout client and the weight sync (raises if a thread will not stop
        within `deadline_s`)."""
        ...


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
