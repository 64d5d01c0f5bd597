"""Per-object confidence: exp(mean logprob of the object's four coordinate tokens), nothing else."""

from __future__ import annotations

import math

import pytest

from stagectl.detection.parse import parse_rollout
from stagectl.detection.scores import object_scores
from tests.unit.helpers import toy_tokenizer

CHAR = toy_tokenizer()


def _two_objects() -> list[int]:
    text = (
        '{"object_1": {"desc": "cat", "bbox_2d": ["<|coord_1|>", "<|coord_2|>", "<|coord_3|>", "<|coord_4|>"]}, '
        '"object_2": {"desc": "dog", "bbox_2d": ["<|coord_5|>", "<|coord_6|>", "<|coord_7|>", "<|coord_8|>"]}}'
    )
    return CHAR.encode(text)


def test_score_is_the_geometric_mean_of_the_coordinate_tokens_probabilities() -> None:
    ids = _two_objects()
    parse = parse_rollout(ids, CHAR.vocab)
    logprobs = [-5.0] * len(ids)  # every non-coordinate token: very unlikely (must not matter)
    first, second = (obj.coord_positions for obj in parse.valid_objects)
    for p, lp in zip(first, (-0.1, -0.2, -0.3, -0.4), strict=True):
        logprobs[p] = lp
    for p, lp in zip(second, (-0.01, -0.02, -0.03, -2.0), strict=True):
        logprobs[p] = lp
    scores = object_scores(parse, logprobs)
    assert scores == pytest.approx([math.exp(-0.25), math.exp(-0.515)])
    # desc and punctuation tokens do not enter the score
    assert (
        object_scores(parse, [0.0 if k not in (*first, *second) else v for k, v in enumerate(logprobs)])
        == scores
    )


def test_without_logprobs_every_object_scores_one_and_misalignment_is_an_error() -> None:
    ids = _two_objects()
    parse = parse_rollout(ids, CHAR.vocab)
    assert object_scores(parse, None) == [1.0, 1.0]
    with pytest.raises(ValueError, match="aligned"):
        object_scores(parse, [0.0] * 10)
