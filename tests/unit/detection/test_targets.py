"""Channel-A / Channel-B segments against hand-built expectations, and the per-sample counters
(`detection.stats.sample_counters`) of the same rollouts."""

from __future__ import annotations

import pytest

from stagectl.config.plan import TargetPlan
from stagectl.detection.matching import MatchResult, hungarian_match
from stagectl.detection.parse import parse_rollout
from stagectl.detection.stats import SampleCounters, sample_counters
from stagectl.detection.targets import CoordGroup, build_channel_a_segment, build_channel_b_segment
from tests.unit.helpers import CHAR, EOT, Obj, box_pieces, coord_positions, expand, toy_tokenizer

GT = [
    Obj("red square", (12, 11, 50, 52)),  # matched by the first prediction
    Obj("green star", (200, 300, 260, 380)),  # missed
    Obj("black box", (100, 100, 150, 120)),  # missed; sorts before green star (y1 100 < 300)
]
ROLLOUT = (
    '{"object_1": {"desc": "red square", "bbox_2d": ["<|coord_10|>", "<|coord_10|>", "<|coord_50|>", '
    '"<|coord_50|>"]}, "object_2": {"desc": "blue ring", "bbox_2d": ["<|coord_600|>", "<|coord_600|>", '
    '"<|coord_700|>", "<|coord_700|>"]}}' + EOT
)


def test_channel_b_one_matched_one_fp_two_missed_has_exactly_the_expected_masks() -> None:
    parse = parse_rollout(CHAR.encode(ROLLOUT), CHAR.vocab)
    match = hungarian_match([o.bbox_2d for o in parse.valid_objects], [g.bbox_2d for g in GT])
    assert (match.pairs, match.fp, match.fn) == ([(0, 0)], [1], [1, 2])

    segment = build_channel_b_segment(
        parse, match, GT, encode=CHAR.encode, vocab=CHAR.vocab, target=TargetPlan(desc_ce_weight_missed=0.5)
    )

    fp_entry = ROLLOUT[ROLLOUT.index(', "object_2"') : ROLLOUT.index(EOT) - 1]
    expected_ids, expected_weights = expand(
        CHAR,
        [
            ("{", 1.0),
            ('"object_1": {"desc": "', 1.0),  # matched: structure CE on
            ("red square", 0.0),  # matched: desc CE off
            *box_pieces((10, 10, 50, 50), 1.0),  # the rollout's own coordinate tokens stay as input
            (fp_entry, 0.0),  # FP: fully masked, separator included
            (', "object_3": {"desc": "', 1.0),  # FN tail: keys continue after object_2
            ("black box", 0.5),  # desc weighted by desc_ce_weight
            *box_pieces((100, 100, 150, 120), 1.0),
            (', "object_4": {"desc": "', 1.0),
            ("green star", 0.5),
            *box_pieces((200, 300, 260, 380), 1.0),
            ("}", 1.0),  # closing brace supervised
            (EOT, 1.0),  # end-of-turn supervised
        ],
    )
    assert segment.channel == "B"
    assert segment.input_ids == expected_ids
    assert segment.ce_weights == expected_weights
    matched_slots, _fp_slots, black_slots, green_slots = coord_positions(expected_ids, 0)
    assert segment.coord_groups == [
        CoordGroup(matched_slots, (12, 11, 50, 52)),  # toward the matched GT box, not the prediction
        CoordGroup(black_slots, (100, 100, 150, 120)),
        CoordGroup(green_slots, (200, 300, 260, 380)),
    ]

    counters = sample_counters(parse, match, num_gt=len(GT))
    assert counters == SampleCounters(
        n_gt=3, n_valid_pred=2, n_dropped=0, n_matched=1, n_fp=1, n_fn=2, precision=0.5, recall=1 / 3
    )


def test_channel_b_masks_dropped_entries_and_fused_boundary_tokens() -> None:
    fused = toy_tokenizer(['"]},', '"]}}'])
    rollout = (
        '{"object_1": {"desc": "red square", "bbox_2d": ["<|coord_10|>", "<|coord_10|>", "<|coord_50|>", '
        '"<|coord_50|>"]}, "object_7": {"desc": "x", "bbox_2d": ["<|coord_1|>"]}}'
    )
    parse = parse_rollout(fused.encode(rollout), fused.vocab)
    assert parse.dropped_by_reason == {"bbox_arity": 1} and parse.max_object_index == 7
    match = hungarian_match([o.bbox_2d for o in parse.valid_objects], [GT[0].bbox_2d])
    segment = build_channel_b_segment(
        parse,
        match,
        GT[:1],
        encode=fused.encode,
        vocab=fused.vocab,
        target=TargetPlan(desc_ce_weight_missed=0),
    )

    dropped = rollout[rollout.index(', "object_7"') + 1 : -1]  # after the fused `"]},`
    expected_ids, expected_weights = expand(
        fused,
        [
            ('{"object_1": {"desc": "', 1.0),
            ("red square", 0.0),
            *box_pieces((10, 10, 50, 50), 1.0)[:-1],
            ('"]},', 0.0),  # shared by the matched entry and the dropped one: the mask wins
            (dropped, 0.0),
            ("}", 1.0),  # nothing missed: the fragment only closes
            (EOT, 1.0),
        ],
    )
    assert segment.input_ids == expected_ids
    assert segment.ce_weights == expected_weights


def test_channel_b_invalid_rollout_teaches_every_gt_object_from_the_bare_prefix() -> None:
    parse = parse_rollout(CHAR.encode("I see nothing." + EOT), CHAR.vocab)
    match = hungarian_match([], [g.bbox_2d for g in GT])
    segment = build_channel_b_segment(
        parse, match, GT, encode=CHAR.encode, vocab=CHAR.vocab, target=TargetPlan(desc_ce_weight_missed=1.0)
    )
    text = CHAR.text(segment.input_ids[:-1])
    assert text.startswith('{"object_1": {"desc": "red square"') and text.endswith("]}}")
    assert segment.input_ids[-1] == CHAR.vocab.end_of_turn_id
    assert [g.gt_bins for g in segment.coord_groups] == [
        (12, 11, 50, 52),
        (100, 100, 150, 120),
        (200, 300, 260, 380),
    ]
    counters = sample_counters(parse, match, num_gt=3)
    assert (counters.n_valid_pred, counters.precision, counters.recall) == (0, 0.0, 0.0)


def test_channel_a_segment() -> None:
    segment = build_channel_a_segment(GT, encode=CHAR.encode, vocab=CHAR.vocab)
    slots = [p for g in segment.coord_groups for p in g.positions]
    assert segment.channel == "A" and len(slots) == 12
    assert segment.input_ids[-1] == CHAR.vocab.end_of_turn_id
    assert [g.gt_bins for g in segment.coord_groups] == [
        (12, 11, 50, 52),
        (100, 100, 150, 120),
        (200, 300, 260, 380),
    ]
    assert [segment.input_ids[p] for p in slots] == [
        CHAR.vocab.coords.ids[b] for g in segment.coord_groups for b in g.gt_bins
    ]
    assert segment.ce_weights == [0.0 if k in slots else 1.0 for k in range(len(segment.input_ids))]
    empty = build_channel_a_segment([], encode=CHAR.encode, vocab=CHAR.vocab)
    assert CHAR.text(empty.input_ids[:-1]) == "{}" and empty.ce_weights == [1.0, 1.0, 1.0]


def test_encode_without_coordinate_tokens_is_refused() -> None:
    def spell_bytes(text: str) -> list[int]:
        return [CHAR.table.index(bytes([b])) for b in text.encode()]

    with pytest.raises(ValueError, match="coordinate tokens"):
        build_channel_a_segment(GT, encode=spell_bytes, vocab=CHAR.vocab)


def test_counters_with_empty_sides() -> None:
    parse = parse_rollout(CHAR.encode("{}"), CHAR.vocab)
    nothing = sample_counters(parse, MatchResult([], [], [], []), num_gt=0)
    assert (nothing.precision, nothing.recall) == (1.0, 1.0)
