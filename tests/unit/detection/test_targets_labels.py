"""Channel-B targets that teach labels, read token by token on one hand-made rollout: matched-desc
supervision on the raw and clean prefixes (`desc_ce_weight_matched`, `mask_correct_matched_desc`), the
reordered-GT target, and desc-gated matching as a B step builds it."""

from __future__ import annotations

from typing import Any, cast

import pytest

from stagectl.config.plan import CleanPrefix, MatchCosts, ReorderedGT, TargetPlan
from stagectl.data.sample import DetectionSample, DetObject
from stagectl.detection.canonical_targets import (
    build_channel_b_clean_segment,
    build_channel_b_reordered_gt_segment,
)
from stagectl.detection.judge import match_objects
from stagectl.detection.matching import MatchResult
from stagectl.detection.parse import RolloutParse, parse_rollout
from stagectl.detection.targets import CoordGroup, Segment, build_channel_b_segment
from stagectl.learner.channel_b.packs import build_b_segments
from stagectl.learner.segments import SampleEncoder
from stagectl.models.generate import Generation
from tests.unit.helpers import (
    CHAR,
    EOT,
    TOY_PROMPT,
    Obj,
    ToyEncoder,
    ToyTokenizer,
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
    Obj("red square", (12, 11, 50, 52)),  # found by the rollout's 2nd object, with the wrong label
    Obj("green star", (200, 300, 260, 380)),  # found by the 1st, label right
    Obj("black box", (100, 100, 150, 120)),  # missed
]
GREEN_PRED = (198, 302, 258, 380)
BLUE_PRED = (10, 10, 50, 50)


FP_ENTRY = ", " + entry(3, "white oval", (600, 600, 700, 700))
ROLLOUT = (
    "{" + entry(1, "green star", GREEN_PRED) + ", " + entry(2, "blue ring", BLUE_PRED) + FP_ENTRY + "}" + EOT
)
W_MATCHED = 0.7
W_MISSED = 0.5


def rollout_parse(tok: ToyTokenizer = CHAR) -> tuple[RolloutParse, MatchResult]:
    parse = parse_rollout(tok.encode(ROLLOUT), tok.vocab)
    match = match_objects(parse.valid_objects, GT, MatchCosts())  # boxes only
    assert (match.pairs, match.fp, match.fn) == ([(0, 1), (1, 0)], [2], [2])
    return parse, match


def raw(weight: float, mask_correct: bool = True, tok: ToyTokenizer = CHAR) -> Segment:
    parse, match = rollout_parse(tok)
    return build_channel_b_segment(
        parse,
        match,
        GT,
        encode=tok.encode,
        vocab=tok.vocab,
        target=TargetPlan(
            desc_ce_weight_missed=W_MISSED,
            desc_ce_weight_matched=weight,
            mask_correct_matched_desc=mask_correct,
        ),
    )


def assert_segment(
    segment: Segment, pieces: list[tuple[str, float]], gt_bins: list[tuple[int, ...]], *, fp_boxes: int = 0
) -> None:
    """`segment` is `pieces`, and its groups are the boxes written in it (but the `fp_boxes`th, 1-based,
    an FP's) in order, toward `gt_bins`."""
    ids, weights = expand(CHAR, pieces)
    assert CHAR.text(segment.input_ids) == CHAR.text(ids)
    assert segment.input_ids == ids
    assert segment.ce_weights == weights
    boxes = [p for k, p in enumerate(coord_positions(ids, 0), start=1) if k != fp_boxes]
    assert segment.coord_groups == [
        CoordGroup(p, b)  # type: ignore[arg-type]
        for p, b in zip(boxes, gt_bins, strict=True)
    ]


MISSED_TAIL = [
    (', "object_4": {"desc": "', 1.0),
    ("black box", W_MISSED),
    *box_pieces((100, 100, 150, 120), 1.0),
    ("}", 1.0),
    (EOT, 1.0),
]
RAW_GROUPS = [(200, 300, 260, 380), (12, 11, 50, 52), (100, 100, 150, 120)]


def raw_pieces(green: float, second_desc: str, second: float) -> list[tuple[str, float]]:
    return [
        ('{"object_1": {"desc": "', 1.0),
        ("green star", green),
        *box_pieces(GREEN_PRED, 1.0),
        (', "object_2": {"desc": "', 1.0),
        (second_desc, second),
        *box_pieces(BLUE_PRED, 1.0),  # the rollout's own box stays as input
        (FP_ENTRY, 0.0),
        *MISSED_TAIL,
    ]


def test_raw_prefix_without_matched_desc_weight_keeps_the_wrong_label_unsupervised() -> None:
    assert_segment(raw(0.0), raw_pieces(0.0, "blue ring", 0.0), RAW_GROUPS, fp_boxes=3)
    parse, match = rollout_parse()
    default = build_channel_b_segment(
        parse,
        match,
        GT,
        encode=CHAR.encode,
        vocab=CHAR.vocab,
        target=TargetPlan(desc_ce_weight_missed=W_MISSED),
    )
    assert default == raw(0.0)  # the keys' defaults are the behaviour before them


def test_raw_prefix_writes_the_gt_desc_over_a_wrong_label_and_shifts_the_boxes_after_it() -> None:
    # "blue ring" (9 tokens) -> "red square" (10): every later position moves by one
    assert_segment(raw(W_MATCHED), raw_pieces(0.0, "red square", W_MATCHED), RAW_GROUPS, fp_boxes=3)


def test_raw_prefix_supervises_a_right_label_only_when_not_masked() -> None:
    assert_segment(
        raw(W_MATCHED, mask_correct=False),
        raw_pieces(W_MATCHED, "red square", W_MATCHED),
        RAW_GROUPS,
        fp_boxes=3,
    )


def test_raw_prefix_splice_with_quotes_fused_into_the_desc_tokens() -> None:
    fused = toy_tokenizer(['"b', 'g"', '"]},'])  # `"blue ring"` starts and ends in fused tokens
    parse, _ = rollout_parse(fused)
    first, stop = parse.valid_objects[1].desc_token_span
    assert fused.text(parse.prefix_token_ids[first:stop]) == '"blue ring"'
    segment = raw(W_MATCHED, tok=fused)
    expected = raw(W_MATCHED)
    assert fused.text(segment.input_ids) == CHAR.text(expected.input_ids)
    text = fused.text(segment.input_ids)
    start = len(fused.encode(text[: text.index('"red square"')]))
    # the re-encoded span: quote (structure, CE 1), the 10 desc tokens, quote
    assert segment.ce_weights[start : start + 12] == [1.0] + [W_MATCHED] * 10 + [1.0]
    assert sum(w == W_MATCHED for w in segment.ce_weights) == len("red square")
    bins_at = fused.vocab.coords.bin_of_id
    assert [[bins_at[segment.input_ids[p]] for p in g.positions] for g in segment.coord_groups] == [
        list(GREEN_PRED),
        list(BLUE_PRED),
        [100, 100, 150, 120],
    ]
    assert [g.gt_bins for g in segment.coord_groups] == RAW_GROUPS


def test_raw_prefix_splice_keeps_a_masked_fp_neighbour_masked() -> None:
    # entry 2 written box first, so its desc's last token fuses `"}, "`: the end of entry 2 and the start of
    # the FP entry after it. That token is masked (smallest weight of its regions); re-encoded, the bytes
    # `"}, "` must stay masked, or the target would teach the model to open the FP entry.
    coords = ", ".join(f'"<|coord_{b}|>"' for b in BLUE_PRED)
    box_first = f'"object_2": {{"bbox_2d": [{coords}], "desc": "blue ring"}}'
    rollout = "{" + entry(1, "green star", GREEN_PRED) + ", " + box_first + FP_ENTRY + "}" + EOT
    fused = toy_tokenizer(['g"}, "'])
    parse = parse_rollout(fused.encode(rollout), fused.vocab)
    match = match_objects(parse.valid_objects, GT, MatchCosts())
    assert (match.pairs, match.fp) == ([(0, 1), (1, 0)], [2])

    def build(weight: float) -> Segment:
        return build_channel_b_segment(parse, match, GT, encode=fused.encode, vocab=fused.vocab, target=TargetPlan(desc_ce_weight_missed=W_MISSED, desc_ce_weight_matched=weight))  # fmt: skip

    unspliced = build(0.0)
    k = unspliced.input_ids.index(fused.ids('g"}, "')[0])
    assert unspliced.ce_weights[k] == 0.0  # the fused token, before any re-encode
    spliced = build(W_MATCHED)
    text = fused.text(spliced.input_ids)
    start = len(fused.encode(text[: text.index('red square"}, "')]))
    assert fused.text(spliced.input_ids[start : start + 15]) == 'red square"}, "'
    assert spliced.ce_weights[start : start + 15] == [W_MATCHED] * 10 + [0.0] * 5


def accepted_objects() -> tuple[list[Any], MatchResult]:
    parse, match = rollout_parse()
    return list(parse.valid_objects), match


CLEAN_TAIL = [
    (', "object_3": {"desc": "', 1.0),
    ("black box", W_MISSED),
    *box_pieces((100, 100, 150, 120), 1.0),
    ("}", 1.0),
    (EOT, 1.0),
]


@pytest.mark.parametrize(("weight", "second_desc"), [(0.0, "blue ring"), (W_MATCHED, "red square")])
def test_clean_prefix_matched_desc(weight: float, second_desc: str) -> None:
    accepted, match = accepted_objects()
    segment = build_channel_b_clean_segment(
        accepted,
        match,
        GT,
        encode=CHAR.encode,
        vocab=CHAR.vocab,
        target=TargetPlan(
            shape=CleanPrefix(insertion_order="tail_append"),
            desc_ce_weight_missed=W_MISSED,
            desc_ce_weight_matched=weight,
        ),
    )
    pieces = [
        ('{"object_1": {"desc": "', 1.0),
        ("green star", 0.0),
        *box_pieces(GREEN_PRED, 1.0),
        (', "object_2": {"desc": "', 1.0),
        (second_desc, weight),
        *box_pieces(BLUE_PRED, 1.0),  # the prediction's own box, pulled toward the GT's
        *CLEAN_TAIL,
    ]
    assert_segment(segment, pieces, RAW_GROUPS)


@pytest.mark.parametrize(("mask_correct", "green"), [(True, 0.0), (False, W_MATCHED)])
@pytest.mark.parametrize("weight", [0.0, W_MATCHED])
def test_reordered_gt_writes_gt_objects_in_rollout_order_then_the_missed(
    mask_correct: bool, green: float, weight: float
) -> None:
    accepted, match = accepted_objects()
    segment = build_channel_b_reordered_gt_segment(
        accepted,
        match,
        GT,
        encode=CHAR.encode,
        vocab=CHAR.vocab,
        target=TargetPlan(
            shape=ReorderedGT(),
            desc_ce_weight_missed=W_MISSED,
            desc_ce_weight_matched=weight,
            mask_correct_matched_desc=mask_correct,
        ),
    )
    pieces = [
        ('{"object_1": {"desc": "', 1.0),
        ("green star", green * (weight > 0)),  # found first (though it sorts last): rollout order
        *box_pieces((200, 300, 260, 380), 1.0),  # the GT box, not the prediction's
        (', "object_2": {"desc": "', 1.0),
        ("red square", weight),  # the GT desc even at weight 0 (teacher-forced, no CE)
        *box_pieces((12, 11, 50, 52), 1.0),
        *CLEAN_TAIL,
    ]
    assert_segment(segment, pieces, RAW_GROUPS)


def test_reordered_gt_of_an_empty_rollout_is_the_gt_answer() -> None:
    segment = build_channel_b_reordered_gt_segment(
        [],
        MatchResult([], [], [0, 1, 2], []),
        GT,
        encode=CHAR.encode,
        vocab=CHAR.vocab,
        target=TargetPlan(shape=ReorderedGT(), desc_ce_weight_missed=1.0, desc_ce_weight_matched=0.0),
    )
    text = CHAR.text(segment.input_ids[:-1])
    assert text.index("red square") < text.index("black box") < text.index("green star")  # answer order
    with pytest.raises(ValueError, match="desc_ce_weight_matched must be >= 0"):
        build_channel_b_reordered_gt_segment(
            *accepted_objects(),
            GT,
            encode=CHAR.encode,
            vocab=CHAR.vocab,
            target=TargetPlan(shape=ReorderedGT(), desc_ce_weight_missed=1.0, desc_ce_weight_matched=-1.0),
        )


# ---------------------------------------------------------------- as a B step builds it, from the config


def b_step(
    target: TargetPlan, costs: MatchCosts = MatchCosts()
) -> tuple[list[int], list[float], list[tuple[int, ...]]]:
    sample = DetectionSample(
        images=[], width=1000, height=1000, objects=[DetObject(g.desc, g.bbox_2d) for g in GT]
    )
    kept, dropped = build_b_segments(
        [0],
        [Generation(CHAR.encode(ROLLOUT), "stop")],
        cast(SampleEncoder, ToyEncoder([sample])),
        target,
        costs,
        packing_length=100_000,
    )
    assert dropped.n_samples == 0 and len(kept) == 1
    (_, segment, _) = kept[0]
    n = len(CHAR.encode(TOY_PROMPT))
    return segment.input_ids[n:], segment.ce_weights[n:], [g.gt_bins for g in segment.coord_groups]


def test_b_step_passes_the_matched_desc_keys_to_the_target() -> None:
    ids, weights, bins = b_step(
        target_plan("raw_prefix", desc_ce_weight_missed=W_MISSED, desc_ce_weight_matched=W_MATCHED)
    )
    assert (ids, weights) == expand(CHAR, raw_pieces(0.0, "red square", W_MATCHED))
    assert bins == RAW_GROUPS


def test_desc_gated_b_step_turns_the_wrong_label_into_an_fp_and_its_gt_into_a_miss() -> None:
    gated = MatchCosts(desc_gated=True)
    ids, weights, bins = b_step(
        target_plan("reordered_gt", desc_ce_weight_missed=W_MISSED, desc_ce_weight_matched=W_MATCHED), gated
    )
    missed = [
        (', "object_2": {"desc": "', 1.0),
        ("red square", W_MISSED),  # a miss now: desc_ce_weight, sorted before black box (y1 11 < 100)
        *box_pieces((12, 11, 50, 52), 1.0),
        (', "object_3": {"desc": "', 1.0),
        ("black box", W_MISSED),
        *box_pieces((100, 100, 150, 120), 1.0),
        ("}", 1.0),
        (EOT, 1.0),
    ]
    green = [('{"object_1": {"desc": "', 1.0), ("green star", 0.0), *box_pieces((200, 300, 260, 380), 1.0)]
    assert (ids, weights) == expand(CHAR, green + missed)
    assert bins == [(200, 300, 260, 380), (12, 11, 50, 52), (100, 100, 150, 120)]

    ids, weights, _ = b_step(target_plan("raw_prefix", desc_ce_weight_missed=W_MISSED), gated)
    text = CHAR.text(ids)
    blue = text.index('"object_2": {"desc": "blue ring"')
    span = range(len(CHAR.encode(text[:blue])) - 2, len(CHAR.encode(text[: text.index('"object_3"')])) - 2)
    assert all(weights[k] == 0.0 for k in span), "the wrong-label entry is an FP: fully masked"
    assert '"object_4": {"desc": "red square"' in text and '"object_5": {"desc": "black box"' in text


def test_greedy_assignment_from_the_config() -> None:
    preds = [Obj("a", (0, 0, 10, 10)), Obj("a", (4, 0, 14, 10))]
    gt = [Obj("a", (1, 0, 11, 10)), Obj("a", (0, 0, 7, 10))]
    hungarian = match_objects(preds, gt, MatchCosts(iou_gate=0.5))
    greedy = match_objects(preds, gt, MatchCosts(iou_gate=0.5, assignment="greedy_iou"))
    assert hungarian.pairs == [(0, 1), (1, 0)]
    assert (greedy.pairs, greedy.fp, greedy.fn) == ([(0, 0)], [1], [1])
