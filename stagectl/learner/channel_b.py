"""Channel-B core shared by step mode and the async prefetcher: rollouts -> strict parse -> Hungarian
match -> targets (rollout prefix + FN append) -> packable segments, plus rollout-quality counters."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Protocol

from stagectl.config.rollout import RolloutMatchingConfig
from stagectl.detection.matching import MatchResult, hungarian_match
from stagectl.detection.parse import RolloutParse, parse_rollout
from stagectl.detection.targets import build_channel_b_segment, sample_counters
from stagectl.learner.segments import SampleEncoder, to_segment
from stagectl.models.generate import Generation
from stagectl.packing import Segment


class RolloutSource(Protocol):
    """Where Channel-B rollouts come from: the learner's own model (hf) or a rollout server."""

    num_calls: int  # generate calls (hf) or /infer/ calls (server) made so far

    def rollout(self, indices: Sequence[int], seed: int) -> list[Generation]:
        """One generation per sample index, in order, sampled with `seed`."""
        ...


@dataclass
class RolloutStats:
    """Summed rollout counters of a set of samples (add them up across chunks and ranks)."""

    n_samples: int = 0
    n_gt: int = 0
    n_valid: int = 0
    n_dropped: int = 0
    n_matched: int = 0
    n_fp: int = 0
    n_fn: int = 0
    n_truncated: int = 0
    n_invalid: int = 0
    n_too_long: int = 0
    n_rollout_tokens: int = 0

    def add(self, other: RolloutStats) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def as_list(self) -> list[float]:
        return [float(getattr(self, f.name)) for f in fields(self)]

    @classmethod
    def from_list(cls, values: Sequence[float]) -> RolloutStats:
        return cls(*(int(v) for v in values))

    def metrics(self) -> dict[str, float]:
        precision = self.n_matched / self.n_valid if self.n_valid else 0.0
        recall = self.n_matched / self.n_gt if self.n_gt else 0.0
        f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
        samples = max(1, self.n_samples)
        return {
            "rollout/precision": precision,
            "rollout/recall": recall,
            "rollout/f1": f1,
            "rollout/n_valid": self.n_valid,
            "rollout/n_dropped": self.n_dropped,
            "rollout/n_samples": self.n_samples,
            "rollout/parse_truncated_rate": self.n_truncated / samples,
            "rollout/invalid_rate": self.n_invalid / samples,
            "rollout/n_too_long": self.n_too_long,
            "rollout/mean_tokens": self.n_rollout_tokens / samples,
        }


def score_rollout(
    index: int, generation: Generation, encoder: SampleEncoder, rm: RolloutMatchingConfig
) -> tuple[RolloutParse, MatchResult, RolloutStats]:
    """Strict parse + Hungarian match of one rollout against its sample's GT, with its counters."""
    gt = encoder.samples[index].objects
    parse = parse_rollout(generation.token_ids, encoder.vocab)
    match = hungarian_match(
        [obj.bbox_2d for obj in parse.valid_objects],
        [obj.bbox_2d for obj in gt],
        iou_gate=rm.iou_gate,
        fp_cost=rm.fp_cost,
        fn_cost=rm.fn_cost,
    )
    counters = sample_counters(parse, match, len(gt))
    stats = RolloutStats(
        n_samples=1,
        n_gt=counters.n_gt,
        n_valid=counters.n_valid_pred,
        n_dropped=counters.n_dropped,
        n_matched=counters.n_matched,
        n_fp=counters.n_fp,
        n_fn=counters.n_fn,
        n_truncated=int(parse.truncated),
        n_invalid=int(parse.invalid_rollout),
        n_rollout_tokens=len(generation.token_ids),
    )
    return parse, match, stats


def build_b_segment(
    index: int,
    generation: Generation,
    encoder: SampleEncoder,
    rm: RolloutMatchingConfig,
    *,
    desc_ce_weight: float,
    packing_length: int,
) -> tuple[Segment | None, RolloutStats]:
    """The Channel-B segment of one rollout (None when it exceeds `packing_length`: dropped, counted)."""
    parse, match, stats = score_rollout(index, generation, encoder, rm)
    gt = encoder.samples[index].objects
    target = build_channel_b_segment(
        parse, match, gt, encode=encoder.encode_text, vocab=encoder.vocab, desc_ce_weight=desc_ce_weight
    )
    segment = to_segment(encoder.prompt(index), target)
    if len(segment) > packing_length:
        stats.n_too_long = 1
        return None, stats
    return segment, stats


def build_b_segments(
    indices: Sequence[int],
    generations: Sequence[Generation],
    encoder: SampleEncoder,
    rm: RolloutMatchingConfig,
    *,
    desc_ce_weight: float,
    packing_length: int,
) -> tuple[list[Segment], RolloutStats]:
    """One Channel-B segment per rollout (too-long ones are dropped and counted), plus summed stats."""
    segments: list[Segment] = []
    total = RolloutStats()
    for index, generation in zip(indices, generations, strict=True):
        segment, stats = build_b_segment(
            index, generation, encoder, rm, desc_ce_weight=desc_ce_weight, packing_length=packing_length
        )
        total.add(stats)
        if segment is not None:
            segments.append(segment)
    return segments, total
