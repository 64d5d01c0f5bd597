"""Per-object confidence from the log-probabilities of the object's own generated tokens: the one place
scores are defined, used by `stagectl eval`, train-ab's periodic eval and anything that ranks predictions.

A generative detector has no detection-head score. Three per-object parts come out of the logprobs the
engines already return (the chosen token's log-probability under the raw model distribution, before
temperature / top-k / top-p / repetition penalty, the same on both engines):

    coord      = exp(mean(logprob[p] for p in coord_positions))      # the box's 4 coordinate tokens
    desc       = exp(mean(logprob[p] for p in desc token positions))  # the label's tokens
    objectness = exp(sum(logprob[p] for p in the entry's opening))   # P(write this object | the ones before)

The entry's opening is its tokens before the desc text: the separator after the previous entry (or the
first token after `{`) through `"desc": "`. Its first token is where the model chose between opening
another object (`,` / `"`) and closing the list (`}`); the rest (`"object_N": {"desc": "`) is
near-certain once that choice is made, so the sum is the probability of opening this object rather than
stopping. A token fused across the boundary (`"]},`) counts for the entry it opens: its probability is
that of continuing, the previous entry's closing bytes being certain by then.

The score is chosen by `data.eval.score` (`SCORE_KINDS`; docs/evaluation.md says which is the default
and why):

    coord                  = coord
    coord_desc             = 0.7 * coord + 0.3 * desc          # upstream CoordExp's production fusion
    objectness             = objectness
    objectness_coord_desc  = objectness * (0.7 * coord + 0.3 * desc)

Means (not sums) over the coordinate and desc tokens keep those parts from depending on token count;
every part is in (0, 1]. Without logprobs (a server that does not return them) every part, hence every
score, is 1.0: COCO then ranks objects in answer order.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import get_args

from stagectl.config.model_data import EvalDataConfig, ScoreKind
from stagectl.detection.parse import ParsedObject, RolloutParse

SCORE_KINDS: tuple[ScoreKind, ...] = get_args(ScoreKind)
DEFAULT_SCORE: ScoreKind = EvalDataConfig.model_fields["score"].default  # declared once, in the config
GEOMETRY_WEIGHT = 0.7  # upstream CoordExp's fused confidence: geometry 0.7, desc 0.3
DESC_WEIGHT = 0.3


@dataclass(frozen=True)
class ObjectConfidence:
    """The parts of one object's confidence (module docstring), each in (0, 1]."""

    coord: float
    desc: float
    objectness: float

    def score(self, kind: ScoreKind) -> float:
        fused = GEOMETRY_WEIGHT * self.coord + DESC_WEIGHT * self.desc
        if kind == "coord":
            return self.coord
        if kind == "coord_desc":
            return fused
        if kind == "objectness":
            return self.objectness
        if kind == "objectness_coord_desc":
            return self.objectness * fused
        raise ValueError(f"score kind must be one of {', '.join(SCORE_KINDS)}; got {kind!r}")


CERTAIN = ObjectConfidence(1.0, 1.0, 1.0)  # what every object gets without logprobs


def object_confidence(obj: ParsedObject, logprobs: Sequence[float]) -> ObjectConfidence:
    """The confidence parts of one parsed object; `logprobs` is aligned with the response token ids."""
    last = max(obj.coord_positions)  # the desc and the opening come before the coordinates
    if last >= len(logprobs):
        raise ValueError(
            f"object_{obj.key_index}: its tokens reach position {last} but there are only {len(logprobs)} "
            "logprobs; they must be aligned with the response token ids"
        )
    coord = sum(logprobs[p] for p in obj.coord_positions) / len(obj.coord_positions)
    desc_start, desc_end = obj.desc_token_span
    desc = sum(logprobs[desc_start:desc_end]) / (desc_end - desc_start) if desc_end > desc_start else 0.0
    opening = sum(logprobs[obj.token_span[0] : desc_start]) if desc_start > obj.token_span[0] else 0.0
    return ObjectConfidence(math.exp(coord), math.exp(desc), math.exp(opening))


def object_confidences(parse: RolloutParse, logprobs: Sequence[float] | None) -> list[ObjectConfidence]:
    """One `ObjectConfidence` per `parse.valid_objects` entry, in order (`CERTAIN` without logprobs)."""
    if logprobs is None:
        return [CERTAIN] * len(parse.valid_objects)
    return [object_confidence(obj, logprobs) for obj in parse.valid_objects]


def object_score(obj: ParsedObject, logprobs: Sequence[float], kind: ScoreKind = DEFAULT_SCORE) -> float:
    """The `kind` score of one parsed object; `logprobs` is aligned with the response token ids."""
    return object_confidence(obj, logprobs).score(kind)


def object_scores(
    parse: RolloutParse, logprobs: Sequence[float] | None, kind: ScoreKind = DEFAULT_SCORE
) -> list[float]:
    """One `kind` score per `parse.valid_objects` entry, in order; all 1.0 when there are no logprobs."""
    return [c.score(kind) for c in object_confidences(parse, logprobs)]
