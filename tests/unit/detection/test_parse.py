"""Strict token-aligned rollout parsing: each rule, the prefix cut, fused tokens, hard stops."""

from __future__ import annotations

import json
import re

import pytest

from stagectl.detection.entries import DROP_REASONS
from stagectl.detection.parse import (
    STOP_CLOSED,
    STOP_END_OF_INPUT,
    STOP_NO_OPEN_BRACE,
    STOP_SYNTAX_ERROR,
    RolloutParse,
    _parse,
    parse_rollout,
)
from stagectl.detection.serialize import append_fragment, serialize_objects, sort_objects
from tests.unit.helpers import Obj, ToyTokenizer, toy_tokenizer

CHAR = toy_tokenizer()  # one token per byte, coordinate and special tokens whole
FUSED = toy_tokenizer(
    ['"]}}', '"]},', '"]}', "}}", "},", ' "', '{"', '":', '",', "object_", "desc", "bbox_2d"]
)
EOT = "<|im_end|>"


def coords(*bins: int) -> str:
    return ", ".join(f'"<|coord_{b}|>"' for b in bins)


def entry(value: str, key: str = "object_1") -> str:
    return f'"{key}": {value}'


VALID = '{"desc": "red square", "bbox_2d": [' + coords(10, 20, 30, 40) + "]}"


def parse_text(text: str, tok: ToyTokenizer = CHAR) -> tuple[list[int], RolloutParse]:
    ids = tok.encode(text)
    result = parse_rollout(ids, tok.vocab)
    assert result == _parse(ids, tok.vocab, fast=False)  # the canonical-entry fast path changes nothing
    return ids, result


def prefix_text(result: RolloutParse, tok: ToyTokenizer = CHAR) -> str:
    return tok.text(result.prefix_token_ids)


def completes_to_valid_json(result: RolloutParse, tok: ToyTokenizer = CHAR) -> dict:
    fragment = append_fragment(
        [Obj("late", (1, 2, 3, 4))],
        max_object_index=result.max_object_index,
        prefix_has_entries=result.prefix_has_entries,
    )
    return json.loads(prefix_text(result, tok) + fragment)


def test_canonical_answer_parses_every_object_in_order() -> None:
    objects = [
        Obj("red square", (12, 34, 256, 480)),
        Obj("blue circle", (5, 3, 9, 7)),
        Obj("star", (0, 0, 999, 999)),
    ]
    text = serialize_objects(objects)
    ids, result = parse_text(text + EOT + "trailing")
    ordered = sort_objects(objects)
    assert [(o.desc, o.bbox_2d) for o in result.valid_objects] == [(o.desc, o.bbox_2d) for o in ordered]
    assert [o.key_index for o in result.valid_objects] == [1, 2, 3]
    assert (result.stop_reason, result.truncated, result.dropped_by_reason) == (STOP_CLOSED, False, {})
    assert result.stop_token_seen and result.num_response_tokens == len(CHAR.encode(text))
    assert prefix_text(result) == text[:-1]  # cut right after the last object; the append closes it
    for obj in result.valid_objects:
        bins = [CHAR.vocab.coords.bin_of_id[ids[p]] for p in obj.coord_positions]
        assert tuple(bins) == obj.bbox_2d
        assert CHAR.text(result.prefix_token_ids[slice(*obj.desc_token_span)]) == obj.desc
    first = result.valid_objects[0]
    assert CHAR.text(result.prefix_token_ids[slice(*first.token_span)]) == text[1 : text.index("]}") + 2]


def test_empty_answer() -> None:
    _, result = parse_text("{}" + EOT)
    assert result.valid_objects == [] and result.stop_reason == STOP_CLOSED and not result.prefix_has_entries
    assert prefix_text(result) == "{"
    late = {"desc": "late", "bbox_2d": ["<|coord_1|>", "<|coord_2|>", "<|coord_3|>", "<|coord_4|>"]}
    assert completes_to_valid_json(result) == {"object_1": late}


def test_out_of_order_keys_keep_appearance_order_and_fn_numbering_counts_dropped_keys() -> None:
    text = "{" + ", ".join(
        [
            entry(VALID, "object_10"),
            entry(VALID.replace("red square", "blue ring"), "object_2"),
            entry(
                '{"desc": "x", "bbox_2d": [' + coords(1, 2, 3) + "]}", "object_12"
            ),  # dropped, still counts
        ]
    )
    _, result = parse_text(text + "}")
    assert [(o.key_index, o.desc) for o in result.valid_objects] == [(10, "red square"), (2, "blue ring")]
    assert result.dropped_by_reason == {"bbox_arity": 1}
    assert result.max_object_index == 12 and result.num_prefix_entries == 3
    completed = completes_to_valid_json(result)
    assert list(completed) == ["object_10", "object_2", "object_12", "object_13"]


def test_three_coordinate_box_is_dropped_not_repaired() -> None:
    _, result = parse_text("{" + entry('{"desc": "a", "bbox_2d": [' + coords(1, 2, 3) + "]}") + "}")
    assert result.valid_objects == []
    assert result.dropped_by_reason == {"bbox_arity": 1}
    assert [(d.reason, d.key_index) for d in result.dropped_objects] == [("bbox_arity", 1)]
    assert result.max_object_index == 1


@pytest.mark.parametrize(
    "desc",
    [
        'a "quoted" {brace} }, "object_9": [',
        "ends with backslash \\",
        '\\"}]}',
        "tab\tnew\nline",
        "红色 圆形",
    ],  # a desc spelling a coordinate token (`<|coord_5|> text`) is dropped: BAD_VALUES
)
def test_escaped_braces_and_quotes_inside_desc_do_not_confuse_the_scanner(desc: str) -> None:
    objects = [Obj(desc, (1, 2, 3, 4)), Obj("plain", (5, 6, 7, 8))]
    for tok in (CHAR, FUSED):
        _, result = parse_text(serialize_objects(objects) + EOT, tok)
        assert [(o.desc, o.bbox_2d) for o in result.valid_objects] == [(o.desc, o.bbox_2d) for o in objects]
        assert result.max_object_index == 2 and result.dropped_by_reason == {}


def test_fused_closing_token_is_re_encoded_at_the_cut() -> None:
    text = serialize_objects([Obj("red square", (1, 2, 3, 4)), Obj("blue ring", (5, 6, 7, 8))])
    ids, result = parse_text(text + EOT, FUSED)
    assert ids[-2:] == FUSED.ids('"]}}', EOT)  # the answer really ends in a fused `"]}}`
    assert result.prefix_token_ids == ids[:-2] + FUSED.ids('"]}')
    assert prefix_text(result, FUSED) == text[:-1]
    first, second = result.valid_objects
    fused_comma = ids.index(FUSED.ids('"]},')[0])
    assert first.token_span[1] == fused_comma + 1 and second.token_span[0] == fused_comma  # shared token

    # A rollout that stops right after a fused `"]},`: the cut falls inside it too.
    cut_after = ids.index(FUSED.ids('"]},')[0]) + 1
    result = parse_rollout(ids[:cut_after], FUSED.vocab)
    assert result.prefix_token_ids == ids[: cut_after - 1] + FUSED.ids('"]}')
    assert (len(result.valid_objects), result.truncated, result.dropped_by_reason) == (1, True, {})
    # The fused token at the boundary belongs to both neighbouring entries' spans.
    assert completes_to_valid_json(result, FUSED)["object_2"]["desc"] == "late"


@pytest.mark.parametrize("stop", ["<|im_end|>", "<|endoftext|>"])
def test_end_of_turn_is_a_hard_stop(stop: str) -> None:
    one = "{" + entry(VALID)
    two = entry(VALID, "object_2")
    _, result = parse_text(one + stop + ", " + two + "}")
    assert [o.key_index for o in result.valid_objects] == [1]
    assert result.stop_reason == STOP_END_OF_INPUT and result.truncated and result.stop_token_seen
    # A stop in the middle of an object: the partial object is trimmed and counted.
    _, result = parse_text(one + ", " + two[:30] + stop + two[30:] + "}")
    assert [o.key_index for o in result.valid_objects] == [1]
    assert result.dropped_by_reason == {"truncated": 1}
    assert prefix_text(result) == one


@pytest.mark.parametrize("text", ["", "   ", "hello", "[1, 2]", 'Sure: {"object_1": {}}', "<|im_end|>{}"])
def test_no_opening_brace_gives_the_bare_prefix(text: str) -> None:
    _, result = parse_text(text)
    assert result.invalid_rollout and result.stop_reason == STOP_NO_OPEN_BRACE
    assert result.prefix_token_ids == CHAR.ids("{")
    assert (result.valid_objects, result.dropped_objects, result.max_object_index) == ([], [], 0)
    assert not result.prefix_has_entries


def test_leading_whitespace_is_kept_and_trailing_text_after_close_ignored() -> None:
    text = " \n" + "{" + entry(VALID) + "} and some chatter"
    _, result = parse_text(text)
    assert result.stop_reason == STOP_CLOSED and len(result.valid_objects) == 1
    assert prefix_text(result) == " \n{" + entry(VALID)


BAD_VALUES = [
    ('{"desc": "a", "bbox_2d": [' + coords(1, 2, 3) + "]}", "bbox_arity"),
    ('{"desc": "a", "bbox_2d": [' + coords(1, 2, 3, 4, 5) + "]}", "bbox_arity"),
    ('{"desc": "a", "bbox_2d": []}', "bbox_arity"),
    ("[1, 2]", "not_a_dict"),
    ('"red square"', "not_a_dict"),
    ("null", "not_a_dict"),
    ('{"desc": {"name": "a"}, "bbox_2d": [' + coords(1, 2, 3, 4) + "]}", "nested_dict"),
    ('{"desc": "a", "bbox_2d": [' + coords(1, 2, 3, 4) + '], "more": {}}', "nested_dict"),
    ('{"desc": "a", "poly": [' + coords(1, 2, 3, 4, 5, 6) + "]}", "poly"),
    ('{"desc": "a", "bbox_2d": [' + coords(1, 2, 3, 4) + '], "poly": []}', "poly"),
    ('{"desc": "a", "bbox_2d": [' + coords(1, 2, 3, 4) + '], "score": 0.9}', "extra_keys"),
    ('{"desc": "a", "desc": "b", "bbox_2d": [' + coords(1, 2, 3, 4) + "]}", "duplicate_key"),
    ('{"bbox_2d": [' + coords(1, 2, 3, 4) + "]}", "missing_desc"),
    ("{}", "missing_desc"),
    ('{"desc": 5, "bbox_2d": [' + coords(1, 2, 3, 4) + "]}", "desc_not_string"),
    ('{"desc": ["a"], "bbox_2d": [' + coords(1, 2, 3, 4) + "]}", "desc_not_string"),
    ('{"desc": "", "bbox_2d": [' + coords(1, 2, 3, 4) + "]}", "empty_desc"),
    ('{"desc": "  ", "bbox_2d": [' + coords(1, 2, 3, 4) + "]}", "empty_desc"),
    # a desc spelling a special token: re-encoded as text (a clean-prefix target) it is that token
    ('{"desc": "<|coord_5|>", "bbox_2d": [' + coords(1, 2, 3, 4) + "]}", "special_token_in_desc"),
    ('{"desc": "red <|coord_5|> square", "bbox_2d": [' + coords(1, 2, 3, 4) + "]}", "special_token_in_desc"),
    ('{"desc": "a<|im_start|>b", "bbox_2d": [' + coords(1, 2, 3, 4) + "]}", "special_token_in_desc"),
    # ... also when spelled with JSON escapes: the rule reads the decoded text
    ('{"desc": "\\u003c|coord_5|\\u003e", "bbox_2d": [' + coords(1, 2, 3, 4) + "]}", "special_token_in_desc"),
    # half a surrogate pair: valid JSON, but no UTF-8 text to write again (a clean-prefix target)
    ('{"desc": "\\ud83d", "bbox_2d": [' + coords(1, 2, 3, 4) + "]}", "surrogate_in_desc"),
    ('{"desc": "cat \\udc31", "bbox_2d": [' + coords(1, 2, 3, 4) + "]}", "surrogate_in_desc"),
    ('{"desc": "a"}', "missing_bbox"),
    ('{"desc": "a", "bbox_2d": "<|coord_1|>"}', "bbox_not_list"),
    ('{"desc": "a", "bbox_2d": [1, 2, 3, 4]}', "non_coord_value"),
    ('{"desc": "a", "bbox_2d": ["1", "2", "3", "4"]}', "non_coord_value"),
    ('{"desc": "a", "bbox_2d": [' + coords(1, 2, 3) + ', ["<|coord_4|>"]]}', "non_coord_value"),
    ('{"desc": "a", "bbox_2d": [' + coords(1, 2, 3) + ', " <|coord_4|>"]}', "non_coord_value"),
    ('{"desc": "a", "bbox_2d": [' + coords(5, 1, 4, 9) + "]}", "bad_box_order"),
    ('{"desc": "a", "bbox_2d": [' + coords(1, 5, 9, 4) + "]}", "bad_box_order"),
]


@pytest.mark.parametrize(("value", "reason"), BAD_VALUES)
def test_each_invalid_object_is_dropped_with_its_reason(value: str, reason: str) -> None:
    assert reason in DROP_REASONS
    text = "{" + ", ".join([entry(VALID), entry(value, "object_2"), entry(VALID, "object_3")]) + "}"
    _, result = parse_text(text)
    assert [o.key_index for o in result.valid_objects] == [1, 3]
    assert result.dropped_by_reason == {reason: 1}
    assert [(d.reason, d.key_index) for d in result.dropped_objects] == [(reason, 2)]
    # Masked, not excluded: the dropped entry stays in the prefix, and its span is exactly its text.
    dropped_span = result.dropped_objects[0].token_span
    assert CHAR.text(result.prefix_token_ids[slice(*dropped_span)]) == ", " + entry(value, "object_2")
    assert prefix_text(result) == text[:-1]
    assert result.max_object_index == 3 and result.num_prefix_entries == 3


@pytest.mark.parametrize(
    ("key", "reason", "index"),
    [("obj_1", "bad_key", None), ("object_0", "bad_key", None), ("object_01", "bad_key", None),
     ("desc", "bad_key", None), ("object_1", "duplicate_key", 1)],
)  # fmt: skip
def test_keys_must_be_fresh_object_n(key: str, reason: str, index: int | None) -> None:
    _, result = parse_text("{" + entry(VALID) + ", " + entry(VALID, key) + "}")
    assert [o.key_index for o in result.valid_objects] == [1]
    assert [(d.reason, d.key_index) for d in result.dropped_objects] == [(reason, index)]


def test_coordinate_text_spelled_with_ordinary_tokens_is_not_a_coordinate() -> None:
    head = CHAR.encode('{"object_1": {"desc": "a", "bbox_2d": [' + coords(1, 2, 3) + ', "')
    spelled = [CHAR.table.index(bytes([b])) for b in b"<|coord_4|>"]  # same bytes, 11 tokens
    ids = head + spelled + CHAR.encode('"]}}')
    result = parse_rollout(ids, CHAR.vocab)
    assert result.valid_objects == [] and result.dropped_by_reason == {"non_coord_value": 1}


def test_degenerate_box_with_equal_corners_is_kept() -> None:
    _, result = parse_text("{" + entry('{"bbox_2d": [' + coords(7, 7, 7, 9) + '], "desc": "dot"}') + "}")
    assert [(o.desc, o.bbox_2d) for o in result.valid_objects] == [("dot", (7, 7, 7, 9))]  # either key order


def test_every_truncation_point_trims_to_the_last_complete_object() -> None:
    objects = [Obj("red square", (1, 2, 3, 4)), Obj("blue ring", (5, 6, 7, 8)), Obj("star", (9, 9, 10, 10))]
    text = serialize_objects(objects)
    ids = CHAR.encode(text)
    ends = [len(CHAR.encode(text[: m.end()])) for m in re.finditer(r'"\]\}', text)]  # tokens up to each `}`
    assert len(ends) == 3
    for k in range(1, len(ids)):
        result = parse_rollout(ids[:k], CHAR.vocab)
        complete = sum(e <= k for e in ends)
        assert len(result.valid_objects) == complete
        assert result.truncated and result.stop_reason == STOP_END_OF_INPUT
        expected_cut = ends[complete - 1] if complete else 1
        assert result.prefix_token_ids == ids[:expected_cut]
        tail = CHAR.text(ids[expected_cut:k]).strip(" ,")
        assert result.dropped_by_reason == ({"truncated": 1} if tail else {})
        completes_to_valid_json(result)


@pytest.mark.parametrize(
    "broken",
    [
        '"object_2": {"desc": "a", "bbox_2d": [<|coord_1|>, <|coord_2|>, <|coord_3|>, <|coord_4|>]}',
        '"object_2" {"desc": "a"}',
        '"object_2": {"desc": "a", "bbox_2d": [' + coords(1, 2, 3, 4) + "]]}",
        "}",
        "'object_2': 1",
    ],
)
def test_syntax_error_stops_the_scan_after_the_last_complete_object(broken: str) -> None:
    head = "{" + entry(VALID)
    _, result = parse_text(head + ", " + broken + ', "object_3": ' + VALID + "}")
    assert [o.key_index for o in result.valid_objects] == [1]
    assert result.stop_reason == STOP_SYNTAX_ERROR and not result.truncated
    assert result.dropped_by_reason == {"syntax_error": 1}
    assert prefix_text(result) == head
    completes_to_valid_json(result)


def test_ids_outside_the_vocabulary_never_raise() -> None:
    n = len(CHAR.table)
    head = CHAR.encode("{" + entry(VALID) + ", ")
    result = parse_rollout([*head, -1, n, 10**12], CHAR.vocab)
    assert len(result.valid_objects) == 1 and result.stop_reason == STOP_SYNTAX_ERROR
    assert max(result.prefix_token_ids) < n


def test_accepts_a_table_or_a_vocab() -> None:
    ids = CHAR.encode(serialize_objects([Obj("red square", (1, 2, 3, 4))]))
    assert parse_rollout(ids, CHAR.table) == parse_rollout(ids, CHAR.vocab)


@pytest.mark.parametrize(
    ("text", "ended"),
    [
        ("{" + entry(VALID) + "}", "valid_json"),
        ("{" + entry('{"desc": "a"}') + "}", "valid_json"),  # its entry is dropped; the JSON is whole
        ("{}" + EOT, "valid_json"),
        ("{" + entry(VALID), "truncated"),
        ("{" + entry(VALID) + EOT, "truncated"),
        ('{"object_1": {"desc": "bbox_2d": "bbox_2d": "<|coord_378|>", ', "not_json"),
        ("{" + entry(VALID) + "]", "not_json"),
        ("sure: {}", "not_json"),
        ("", "not_json"),
    ],
)
def test_every_answer_ended_exactly_one_way(text: str, ended: str) -> None:
    _, result = parse_text(text)
    ways = {"valid_json": result.valid_json, "truncated": result.truncated, "not_json": result.not_json}
    assert [way for way, holds in ways.items() if holds] == [ended]
