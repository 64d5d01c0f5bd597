"""Per-object confidence from hand-made logprobs: the coordinate, desc and objectness parts and every score
kind built from them (`detection.scores`)."""

from __future__ import annotations

import math

import pytest

from stagectl.detection.parse import parse_rollout
from stagectl.detection.scores import SCORE_KINDS, object_confidences, object_scores
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
    scores = object_scores(parse, logprobs, "coord")
    assert scores == pytest.approx([math.exp(-0.25), math.exp(-0.515)])
    # desc and punctuation tokens do not enter the score
    assert (
        object_scores(
            parse, [0.0 if k not in (*first, *second) else v for k, v in enumerate(logprobs)], "coord"
        )
        == scores
    )


def test_without_logprobs_every_object_scores_one_and_misalignment_is_an_error() -> None:
    ids = _two_objects()
    parse = parse_rollout(ids, CHAR.vocab)
    assert object_scores(parse, None) == [1.0, 1.0]
    with pytest.raises(ValueError, match="aligned"):
        object_scores(parse, [0.0] * 10)


# The other score kinds, on an answer whose every piece carries a hand-set logprob. With `"]},` fused into
# one token (as BPE vocabularies do), the token that decides "another object" is shared with the previous
# entry's end; it counts for the entry it opens.
FUSED = toy_tokenizer(merges=('"]},', '"]}}'))
OPEN_1, OPEN_2 = -0.2, -1.5  # the choice to open object 1 / object 2 (vs closing the list)
DESC_1, DESC_2 = (-0.1, -0.3), (-2.0, -1.0)  # logprobs of each desc's tokens ("ab", "cd")
COORDS_1, COORDS_2 = (-0.1, -0.2, -0.3, -0.4), (-0.05, -0.05, -0.05, -0.05)


def _answer() -> tuple[list[int], list[float]]:
    """`{"object_1": {"desc": "ab", "bbox_2d": [...]}, "object_2": {"desc": "cd", ...}}` with a logprob per piece."""

    def box(key: int, coords: tuple[float, ...]) -> list[tuple[str, float]]:
        pieces = [('", "bbox_2d": ["', -7.0)]  # structure after the desc: enters no score
        for k, lp in enumerate(coords):
            pieces += [("" if k == 0 else '", "', -7.0), (f"<|coord_{100 * key + k}|>", lp)]
        return pieces

    pieces: list[tuple[str, float]] = [
        ("{", -9.0),  # before any entry: enters no score
        ('"', OPEN_1),  # the first token after `{`: open object 1 (vs `}`)
        ('object_1": {"desc": "', 0.0),
        *zip("ab", DESC_1, strict=True),
        *box(1, COORDS_1),
        ('"]},', OPEN_2),  # one fused token: close object 1 AND open another (vs `"]}}`)
        (' "object_2": {"desc": "', 0.0),
        *zip("cd", DESC_2, strict=True),
        *box(2, COORDS_2),
        ('"]}}', -8.0),  # close object 2 and the list
    ]
    ids: list[int] = []
    logprobs: list[float] = []
    for text, lp in pieces:
        piece = FUSED.encode(text)
        ids += piece
        logprobs += [lp] * len(piece)
    return ids, logprobs


def test_desc_objectness_and_fused_scores_on_hand_made_logprobs() -> None:
    ids, logprobs = _answer()
    parse = parse_rollout(ids, FUSED.vocab)
    assert [o.desc for o in parse.valid_objects] == ["ab", "cd"]
    # the opening of object 1 is the `"` after `{` (its key text is free: logprob 0); object 2's is `"]},`
    second_opening = parse.valid_objects[1].token_span[0]
    assert FUSED.text(ids[second_opening : second_opening + 1]) == '"]},'
    conf = object_confidences(parse, logprobs)
    geo = [math.exp(sum(c) / 4) for c in (COORDS_1, COORDS_2)]
    desc = [math.exp(sum(d) / 2) for d in (DESC_1, DESC_2)]
    opening = [math.exp(OPEN_1), math.exp(OPEN_2)]
    assert [c.coord for c in conf] == pytest.approx(geo)
    assert [c.desc for c in conf] == pytest.approx(desc)
    assert [c.objectness for c in conf] == pytest.approx(opening)
    fused = [0.7 * g + 0.3 * d for g, d in zip(geo, desc, strict=True)]
    assert object_scores(parse, logprobs, "coord") == pytest.approx(geo)
    assert object_scores(parse, logprobs, "coord_desc") == pytest.approx(fused)
    assert object_scores(parse, logprobs, "objectness") == pytest.approx(opening)
    assert object_scores(parse, logprobs, "objectness_coord_desc") == pytest.approx(
        [o * f for o, f in zip(opening, fused, strict=True)]
    )
    # the rankings differ: object 2 has the surer box but the less likely label and opening
    assert geo[1] > geo[0] and fused[1] < fused[0] and opening[1] < opening[0]


def test_without_logprobs_every_kind_scores_one_and_an_unknown_kind_is_an_error() -> None:
    ids, _ = _answer()
    parse = parse_rollout(ids, FUSED.vocab)
    for kind in SCORE_KINDS:
        assert object_scores(parse, None, kind) == [1.0, 1.0]
    with pytest.raises(ValueError, match="score kind must be one of coord, coord_desc"):
        object_scores(parse, [0.0] * len(ids), "box")  # type: ignore[arg-type]
