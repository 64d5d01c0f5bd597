"""Rollout-quality counters: `SampleCounters` of one rollout (from its parse and match) and `RolloutStats`,
the summed counters (parse, match, targets) of a set of rollouts. Plain data: added up across chunks,
reduced across ranks as a float vector, turned into `rollout/*` metrics."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

from stagectl.detection.matching import MatchResult
from stagectl.detection.parse import RolloutParse


@dataclass(frozen=True)
class SampleCounters:
    """Per-sample rollout quality. An empty denominator gives 1.0 when the other side is empty too
    (nothing to find, nothing found), else 0.0. Aggregate across samples by summing the counts."""

    n_gt: int
    n_valid_pred: int
    n_dropped: int
    n_matched: int
    n_fp: int
    n_fn: int
    precision: float
    recall: float


def _ratio(num: int, den: int, other_side_empty: bool) -> float:
    if den:
        return num / den
    return 1.0 if other_side_empty else 0.0


def sample_counters(parse: RolloutParse, match: MatchResult, num_gt: int) -> SampleCounters:
    """Rollout quality of one sample from its parse and match."""
    n_valid = len(parse.valid_objects)
    n_matched = len(match.pairs)
    return SampleCounters(
        n_gt=num_gt,
        n_valid_pred=n_valid,
        n_dropped=parse.dropped_total,
        n_matched=n_matched,
        n_fp=len(match.fp),
        n_fn=len(match.fn),
        precision=_ratio(n_matched, n_valid, num_gt == 0),
        recall=_ratio(n_matched, num_gt, n_valid == 0),
    )


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
    # how each answer ended (`RolloutParse`): closed (valid JSON), truncated or not JSON; the three add up
    n_truncated: int = 0  # ended before the top-level object closed (`truncated`)
    n_invalid: int = 0  # can never be the JSON object: no `{` or a syntax error (`not_json`)
    n_too_long: int = 0
    n_rollout_tokens: int = 0
    n_dup: int = 0  # valid predictions that duplicate an earlier one (stagectl.detection.dedup)

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
            "rollout/dup_total": self.n_dup,
            "rollout/dup_rate": self.n_dup / self.n_valid if self.n_valid else 0.0,
        }
