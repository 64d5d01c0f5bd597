"""The assistant JSON and the FN-append fragment."""

from __future__ import annotations

import json

import pytest

from stagectl.detection.serialize import (
    append_fragment,
    append_fragment_with_desc_spans,
    serialize_objects,
    serialize_objects_with_desc_spans,
    sort_objects,
)
from tests.unit.helpers import Obj


def test_exact_format() -> None:
    text = serialize_objects([Obj("blue ring", (1, 500, 2, 600)), Obj("red square", (12, 34, 256, 480))])
    assert text == (
        '{"object_1": {"desc": "red square", "bbox_2d": ["<|coord_12|>", "<|coord_34|>", "<|coord_256|>", '
        '"<|coord_480|>"]}, "object_2": {"desc": "blue ring", "bbox_2d": ["<|coord_1|>", "<|coord_500|>", '
        '"<|coord_2|>", "<|coord_600|>"]}}'
    )
    assert serialize_objects([]) == "{}"


def test_sorted_top_to_bottom_then_left_to_right() -> None:
    objects = [Obj("c", (50, 10, 60, 20)), Obj("b", (5, 10, 9, 30)), Obj("a", (900, 0, 999, 5))]
    assert [o.desc for o in sort_objects(objects)] == ["a", "b", "c"]


def test_desc_is_escaped_and_spans_point_at_it() -> None:
    descs = ['say "hi" {now}', "back\\slash", "红色 圆形"]
    objects = [Obj(d, (k, k, k + 1, k + 1)) for k, d in enumerate(descs)]
    text, spans = serialize_objects_with_desc_spans(objects)
    answer = json.loads(text)
    assert [answer[f"object_{k + 1}"]["desc"] for k in range(3)] == descs
    raw = text.encode("utf-8")
    assert [json.loads(b'"' + raw[a:b] + b'"') for a, b in spans] == descs


def test_append_fragment_numbering_comma_and_close() -> None:
    missed = [Obj("late star", (7, 8, 9, 10))]
    entry = '"object_6": {"desc": "late star", "bbox_2d": ["<|coord_7|>", "<|coord_8|>", "<|coord_9|>", "<|coord_10|>"]}'
    assert append_fragment(missed, max_object_index=5, prefix_has_entries=True) == ", " + entry + "}"
    assert append_fragment(missed, max_object_index=5, prefix_has_entries=False) == entry + "}"
    assert append_fragment([], max_object_index=5, prefix_has_entries=True) == "}"
    prefix = '{"object_5": {"desc": "x", "bbox_2d": []}'
    two = [Obj("b", (0, 9, 1, 10)), Obj("a", (0, 1, 1, 2))]
    completed = json.loads(prefix + append_fragment(two, max_object_index=5, prefix_has_entries=True))
    assert list(completed) == ["object_5", "object_6", "object_7"]
    assert [completed["object_6"]["desc"], completed["object_7"]["desc"]] == ["a", "b"]  # sorted too
    fragment, spans = append_fragment_with_desc_spans(two, max_object_index=0, prefix_has_entries=False)
    assert [fragment.encode()[a:b] for a, b in spans] == [b"a", b"b"]


def test_bad_objects_raise() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        serialize_objects([Obj("", (1, 2, 3, 4))])
    with pytest.raises(ValueError, match="outside"):
        serialize_objects([Obj("a", (1, 2, 3, 1000))])
    with pytest.raises(ValueError, match="max_object_index"):
        append_fragment([], max_object_index=-1, prefix_has_entries=False)
