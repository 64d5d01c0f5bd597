"""The clean-prefix Channel-B target and duplicate detection, against hand-built expectations, plus the
guard the issue asks for: no Channel-B target (raw or clean, built the way a B step builds it) may put CE
on an FP object, and the clean prefix never keeps a duplicate."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import pytest

from stagectl.config.plan import CleanPrefix, MatchCosts, TargetPlan
from stagectl.data.sample import DetectionSample, DetObject
from stagectl.detection.canonical_targets import build_channel_b_clean_segment
from stagectl.detection.dedup import find_duplicates
from stagectl.detection.matching import MatchResult, hungarian_match
from stagectl.detection.parse import parse_rollout
from stagectl.detection.targets import CoordGroup
from stagectl.learner.channel_b.packs import build_b_segments
from stagectl.learner.segments import SampleEncoder
from stagectl.models.generate import Generation
from tests.unit.helpers import (
    CHAR,
    EOT,
    Obj,
    ToyEncoder,
    box_pieces,
    coord_positions,
    expand,
    target_plan,
    toy_tokenizer,
)
from tests.unit.helpers import (
    answer_entry as entry,
)

GT = [
    Obj("red square", (12, 11, 50, 52)),  # matched by the rollout's second object
    Obj("green star", (200, 300, 260, 380)),  # matched by the rollout's first object
    Obj("black box", (100, 100, 150, 120)),  # missed
]


# green star (kept), red square (kept), blue ring (FP), red square again (duplicate), an invalid entry
ROLLOUT = (
    "{"
    + ", ".join(
        [
            entry(1, "green star", (198, 302, 258, 380)),
            entry(2, "red square", (10, 10, 50, 50)),
            entry(3, "blue ring", (600, 600, 700, 700)),
            entry(4, "red square", (11, 10, 50, 50)),
            '"object_5": {"desc": "x", "bbox_2d": ["<|coord_1|>"]}',
        ]
    )
    + "}"
    + EOT
)


def clean_inputs() -> tuple[list[Any], MatchResult]:
    parse = parse_rollout(CHAR.encode(ROLLOUT), CHAR.vocab)
    assert len(parse.valid_objects) == 4 and parse.dropped_total == 1
    duplicates = find_duplicates(parse.valid_objects, 0.7)
    assert duplicates == [3]
    accepted = [o for i, o in enumerate(parse.valid_objects) if i not in duplicates]
    match = hungarian_match([o.bbox_2d for o in accepted], [g.bbox_2d for g in GT])
    assert (match.pairs, match.fp, match.fn) == ([(0, 1), (1, 0)], [2], [2])
    return accepted, match


def test_clean_prefix_tail_append_keeps_rollout_order_and_drops_fp_duplicate_invalid() -> None:
    accepted, match = clean_inputs()
    segment = build_channel_b_clean_segment(
        accepted,
        match,
        GT,
        encode=CHAR.encode,
        vocab=CHAR.vocab,
        target=TargetPlan(shape=CleanPrefix(insertion_order="tail_append"), desc_ce_weight_missed=0.5),
    )
    expected_ids, expected_weights = expand(
        CHAR,
        [
            ('{"object_1": {"desc": "', 1.0),
            ("green star", 0.0),  # kept prediction: desc CE off, written as predicted
            *box_pieces((198, 302, 258, 380), 1.0),
            (', "object_2": {"desc": "', 1.0),
            ("red square", 0.0),
            *box_pieces((10, 10, 50, 50), 1.0),
            (', "object_3": {"desc": "', 1.0),  # the FN tail: keys continue after the kept objects
            ("black box", 0.5),
            *box_pieces((100, 100, 150, 120), 1.0),
            ("}", 1.0),
            (EOT, 1.0),
        ],
    )
    assert segment.channel == "B"
    assert segment.input_ids == expected_ids
    assert segment.ce_weights == expected_weights
    green, red, black = coord_positions(expected_ids, 0)
    assert segment.coord_groups == [
        CoordGroup(green, (200, 300, 260, 380)),  # toward the matched GT, not the prediction
        CoordGroup(red, (12, 11, 50, 52)),
        CoordGroup(black, (100, 100, 150, 120)),
    ]


def test_clean_prefix_sorted_writes_everything_in_answer_order() -> None:
    accepted, match = clean_inputs()
    segment = build_channel_b_clean_segment(
        accepted,
        match,
        GT,
        encode=CHAR.encode,
        vocab=CHAR.vocab,
        target=TargetPlan(shape=CleanPrefix(insertion_order="sorted"), desc_ce_weight_missed=1.0),
    )
    expected_ids, expected_weights = expand(
        CHAR,
        [
            ('{"object_1": {"desc": "', 1.0),
            ("red square", 0.0),  # y1 10
            *box_pieces((10, 10, 50, 50), 1.0),
            (', "object_2": {"desc": "', 1.0),
            ("black box", 1.0),  # missed, y1 100
            *box_pieces((100, 100, 150, 120), 1.0),
            (', "object_3": {"desc": "', 1.0),
            ("green star", 0.0),  # y1 302
            *box_pieces((198, 302, 258, 380), 1.0),
            ("}", 1.0),
            (EOT, 1.0),
        ],
    )
    assert segment.input_ids == expected_ids
    assert segment.ce_weights == expected_weights
    assert [g.gt_bins for g in segment.coord_groups] == [
        (12, 11, 50, 52),
        (100, 100, 150, 120),
        (200, 300, 260, 380),
    ]


def test_clean_prefix_of_an_empty_rollout_is_the_gt_answer_and_of_nothing_is_empty() -> None:
    segment = build_channel_b_clean_segment(
        [],
        MatchResult([], [], [0, 1, 2], []),
        GT,
        encode=CHAR.encode,
        vocab=CHAR.vocab,
        target=TargetPlan(shape=CleanPrefix(insertion_order="tail_append"), desc_ce_weight_missed=1.0),
    )
    text = CHAR.text(segment.input_ids[:-1])
    assert (
        text.startswith('{"object_1": {"desc": "red square"') and '"object_3": {"desc": "green star"' in text
    )
    empty = build_channel_b_clean_segment(
        [],
        MatchResult([], [], [], []),
        [],
        encode=CHAR.encode,
        vocab=CHAR.vocab,
        target=TargetPlan(shape=CleanPrefix(insertion_order="sorted"), desc_ce_weight_missed=1.0),
    )
    assert CHAR.text(empty.input_ids[:-1]) == "{}" and empty.ce_weights == [1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="match indices"):
        build_channel_b_clean_segment(
            [],
            MatchResult([(0, 0)], [], [], [1.0]),
            GT,
            encode=CHAR.encode,
            vocab=CHAR.vocab,
            target=TargetPlan(shape=CleanPrefix(insertion_order="sorted"), desc_ce_weight_missed=1.0),
        )


@pytest.mark.parametrize(
    ("boxes", "descs", "threshold", "expected"),
    [
        ([(0, 0, 10, 10), (0, 0, 10, 10)], ["a", "a"], 0.7, [1]),  # exact repeat
        ([(0, 0, 10, 10), (0, 0, 10, 10)], ["a", "b"], 0.7, []),  # other desc: not a duplicate
        ([(0, 0, 10, 10), (0, 0, 10, 12)], ["a", "a"], 0.9, []),  # IoU 0.833 < 0.9
        ([(0, 0, 10, 10), (0, 0, 10, 12)], ["a", "a"], 0.8, [1]),
        ([(0, 0, 10, 10)] * 4, ["a"] * 4, 0.7, [1, 2, 3]),  # a burst
        # the 3rd overlaps only the 2nd, which is a duplicate (not accepted): the 3rd is accepted
        ([(0, 0, 10, 10), (0, 0, 10, 13), (0, 3, 10, 13)], ["a"] * 3, 0.75, [1]),
        ([], [], 0.7, []),
    ],
)
def test_find_duplicates(
    boxes: list[tuple[int, int, int, int]], descs: list[str], threshold: float, expected: list[int]
) -> None:
    objects = [Obj(d, b) for d, b in zip(descs, boxes, strict=True)]
    assert find_duplicates(objects, threshold) == expected


# ---------------------------------------------------------------- the B-step guard (both contracts)


def b_step_targets(target: str, rollouts: Sequence[str]) -> list[tuple[list[int], list[float], list[int]]]:
    """Assistant ids, CE weights and coordinate-slot positions of each rollout's B-step target."""
    sample = DetectionSample(
        images=[], width=1000, height=1000, objects=[DetObject(g.desc, g.bbox_2d) for g in GT]
    )
    encoder = cast(SampleEncoder, ToyEncoder([sample] * len(rollouts)))
    kept, dropped = build_b_segments(
        list(range(len(rollouts))),
        [Generation(CHAR.encode(r), "stop") for r in rollouts],
        encoder,
        target_plan(target),
        MatchCosts(),
        packing_length=100_000,
    )
    assert dropped.n_samples == 0 and len(kept) == len(rollouts)
    n = len(CHAR.encode("<prompt>"))
    return [
        (seg.input_ids[n:], seg.ce_weights[n:], [p - n for g in seg.coord_groups for p in g.positions])
        for _, seg, _ in kept
    ]


FP_ENTRY = entry(3, "blue ring", (600, 600, 700, 700))
DUP_ENTRY = entry(4, "red square", (11, 10, 50, 50))


@pytest.mark.parametrize("target", ["raw_prefix", "clean_prefix", "reordered_gt"])
def test_no_b_step_target_puts_ce_on_an_fp_object(target: str) -> None:
    ((ids, weights, slots),) = b_step_targets(target, [ROLLOUT])
    text = CHAR.text(ids)
    supervised = CHAR.text([i for i, w in zip(ids, weights, strict=True) if w > 0])
    assert "blue ring" not in supervised, "CE on an FP object's desc"
    if target == "raw_prefix":  # the FP entry stays as input, every token of it masked, no box loss
        start = len(CHAR.encode(text[: text.index(FP_ENTRY)]))
        span = range(start, start + len(CHAR.encode(FP_ENTRY)))
        assert all(weights[k] == 0.0 for k in span), "CE on an FP object"
        assert not set(span) & set(slots), "geometry loss on an FP object"
    else:  # clean prefix, reordered GT: the FP object is not even input
        assert "blue ring" not in text and "<|coord_600|>" not in text


def test_clean_prefix_b_step_target_never_keeps_a_duplicate() -> None:
    ((ids, _, slots),) = b_step_targets("clean_prefix", [ROLLOUT])
    text = CHAR.text(ids)
    assert text.count('"red square"') == 1, "clean prefix kept a duplicate"
    assert "<|coord_11|>" not in text
    assert len(slots) == 4 * 3  # green star, red square, black box
    ((raw_ids, _, _),) = b_step_targets("raw_prefix", [ROLLOUT])
    assert CHAR.text(raw_ids).count('"red square"') == 2  # the raw prefix keeps it as (masked) input


def test_b_step_stats_count_duplicates() -> None:
    sample = DetectionSample(
        images=[], width=1000, height=1000, objects=[DetObject(g.desc, g.bbox_2d) for g in GT]
    )
    encoder = cast(SampleEncoder, ToyEncoder([sample]))
    kept, _ = build_b_segments(
        [0],
        [Generation(CHAR.encode(ROLLOUT), "stop")],
        encoder,
        target_plan("clean_prefix"),
        MatchCosts(),
        packing_length=100_000,
    )
    metrics = kept[0][2].metrics()
    assert metrics["rollout/dup_total"] == 1 and metrics["rollout/dup_rate"] == 0.25


def test_fused_tokenizer_clean_prefix_matches_char_tokenizer_text() -> None:
    fused = toy_tokenizer(['"]},', '"]}}', '": "'])
    accepted, match = clean_inputs()
    a = build_channel_b_clean_segment(
        accepted,
        match,
        GT,
        encode=fused.encode,
        vocab=fused.vocab,
        target=TargetPlan(shape=CleanPrefix(insertion_order="sorted"), desc_ce_weight_missed=0.5),
    )
    b = build_channel_b_clean_segment(
        accepted,
        match,
        GT,
        encode=CHAR.encode,
        vocab=CHAR.vocab,
        target=TargetPlan(shape=CleanPrefix(insertion_order="sorted"), desc_ce_weight_missed=0.5),
    )
    assert fused.text(a.input_ids[:-1]) == CHAR.text(b.input_ids[:-1])
    # the CE mass on desc text is the same: desc tokens are whole in both tokenizers
    assert sum(w == 0.5 for w in a.ce_weights) == len("black box")


@pytest.mark.parametrize("desc", ["<|coord_5|>", "red <|coord_5|> square"])
def test_a_rollout_whose_desc_spells_a_coordinate_token_still_gives_a_clean_prefix_target(desc: str) -> None:
    """A clean-prefix B step writes the kept predictions again as text: a desc that spells a coordinate
    token encoded as one more coordinate and the B step failed (`encode() produced 5 coordinate tokens for 1
    objects`, a learning-check run at step 56). The strict parse drops such an entry instead; the target is
    then the GT answer for what it missed."""
    rollout = "{" + entry(1, desc, (10, 10, 50, 50)) + "}" + EOT
    parse = parse_rollout(CHAR.encode(rollout), CHAR.vocab)
    assert parse.valid_objects == [] and parse.dropped_by_reason == {"special_token_in_desc": 1}
    gt = GT[:1]
    match = hungarian_match([], [g.bbox_2d for g in gt])
    segment = build_channel_b_clean_segment(
        parse.valid_objects,
        match,
        gt,
        encode=CHAR.encode,
        vocab=CHAR.vocab,
        target=TargetPlan(shape=CleanPrefix(insertion_order="tail_append")),
    )
    assert segment.coord_groups == [CoordGroup(coord_positions(segment.input_ids, 0)[0], (12, 11, 50, 52))]


@pytest.mark.parametrize("target", ["raw_prefix", "clean_prefix", "reordered_gt"])
def test_a_rollout_whose_desc_escapes_half_a_surrogate_pair_still_gives_a_b_target(target: str) -> None:
    """`"\\ud83d"` alone is valid JSON and decodes to a lone surrogate, which has no UTF-8 form: a clean-prefix
    B step that wrote the matched prediction again failed on it (`UnicodeEncodeError: ... surrogates not
    allowed`, found by test_b_targets_fuzz). The strict parse drops it (`surrogate_in_desc`); a whole pair
    is one character and stays."""
    lone = "{" + entry(1, "\\ud83d", (12, 11, 50, 52)) + "}" + EOT  # on GT's red square
    pair = "{" + entry(1, "\\ud83d\\udc31", (12, 11, 50, 52)) + "}" + EOT
    (ids, _, slots), _ = b_step_targets(target, [lone, pair])
    assert len(slots) == 4 * len(GT)  # the dropped entry leaves every GT object missed
    assert ids[-1] == CHAR.vocab.end_of_turn_id
    assert parse_rollout(CHAR.encode(lone), CHAR.vocab).dropped_by_reason == {"surrogate_in_desc": 1}
    assert [o.desc for o in parse_rollout(CHAR.encode(pair), CHAR.vocab).valid_objects] == ["\U0001f431"]
