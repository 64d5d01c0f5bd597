"""Per-object confidence from the log-probabilities of the object's own generated tokens: the one
definition, used by `stagectl eval`, train-ab's periodic eval and anything that ranks predictions.

A generative detector has no detection-head score. An object's score is the geometric mean of the
probabilities of its four coordinate tokens:

    score = exp(mean(logprob[p] for p in coord_positions))   # in (0, 1]

Why the coordinate tokens: they are the tokens that place the box AP measures, each object has exactly
four of them (so scores are comparable across objects whatever the length of their `desc`), and they are
never fused with JSON punctuation (a coordinate token is one token between quotes), so the
log-probabilities are the model's own uncertainty about the box, not about formatting. The mean, not
the sum, keeps the score from depending on token count. The log-probabilities are those of the raw
model distribution (before temperature / top-k / top-p / repetition penalty), the same on both engines.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from stagectl.detection.parse import ParsedObject, RolloutParse


def object_score(obj: ParsedObject, logprobs: Sequence[float]) -> float:
    """The confidence of one parsed object; `logprobs` is aligned with the response token ids."""
    if max(obj.coord_positions) >= len(logprobs):
        raise ValueError(
            f"object_{obj.key_index}: coordinate token at position {max(obj.coord_positions)} but only "
            f"{len(logprobs)} logprobs; they must be aligned with the response token ids"
        )
    mean = sum(logprobs[p] for p in obj.coord_positions) / len(obj.coord_positions)
    return math.exp(mean)


def object_scores(parse: RolloutParse, logprobs: Sequence[float] | None) -> list[float]:
    """One score per `parse.valid_objects` entry, in order; all 1.0 when there are no logprobs (a
    server that does not return them: every object then ranks equal)."""
    if logprobs is None:
        return [1.0] * len(parse.valid_objects)
    return [object_score(obj, logprobs) for obj in parse.valid_objects]
