"""Objects -> the one-line assistant JSON, and the FN-append fragment that extends a rollout prefix.

The answer format (docs/design.md#data-and-the-answer-format):
`{"object_1": {"desc": "red square", "bbox_2d": ["<|coord_12|>", "<|coord_34|>", "<|coord_256|>", "<|coord_480|>"]}, ...}`
keys `object_1..N`, `desc` first, objects sorted top-to-bottom then left-to-right, `{}` when empty.
Descriptions are JSON-escaped (`json.dumps(..., ensure_ascii=False)`), so quotes, backslashes and
braces inside a desc stay inside its string.

The `*_with_desc_spans` variants also return, for each object, the UTF-8 byte span of its desc
*content* (between the quotes) in the returned text; Channel-B targets use them to weight desc tokens.
"""

from __future__ import annotations

import json
import operator
from collections.abc import Sequence
from typing import Protocol, TypeVar

from stagectl.detection.coords import coord_token

ByteSpan = tuple[int, int]  # [start, end) in UTF-8 bytes of the text


class BoxedObject(Protocol):
    """Anything with a desc and a box in bins (`stagectl.data.sample.DetObject`, parsed objects)."""

    @property
    def desc(self) -> str: ...

    @property
    def bbox_2d(self) -> Sequence[int]: ...


ObjT = TypeVar("ObjT", bound=BoxedObject)


def sort_objects(objects: Sequence[ObjT]) -> list[ObjT]:
    """Answer order: top-to-bottom (y1), then left-to-right (x1); y2, x2, desc break remaining ties."""
    return sorted(objects, key=lambda o: (o.bbox_2d[1], o.bbox_2d[0], o.bbox_2d[3], o.bbox_2d[2], o.desc))


def object_record(obj: BoxedObject) -> dict[str, object]:
    """`{"desc": ..., "bbox_2d": [x1, y1, x2, y2]}` with plain bins: the JSONL and log form of an object."""
    return {"desc": obj.desc, "bbox_2d": list(obj.bbox_2d)}


def _entry(index: int, obj: BoxedObject) -> tuple[str, str, str]:
    """`"object_<index>": {"desc": "<desc>", "bbox_2d": [...]}` split as (before desc, desc, after desc)."""
    if len(obj.bbox_2d) != 4:
        raise ValueError(f"bbox_2d must have 4 bins, got {list(obj.bbox_2d)}")
    if not obj.desc:
        raise ValueError("desc must be a non-empty string")
    quoted_desc = json.dumps(obj.desc, ensure_ascii=False)
    coords = ", ".join(f'"{coord_token(operator.index(b))}"' for b in obj.bbox_2d)  # bins are integers
    return f'"object_{index}": {{"desc": "', quoted_desc[1:-1], f'", "bbox_2d": [{coords}]}}'


def _render(
    objects: Sequence[BoxedObject], *, first_index: int, leading_comma: bool, opening: str, sort: bool = True
) -> tuple[str, list[ByteSpan]]:
    parts: list[str] = [opening]
    num_bytes = len(opening.encode("utf-8"))
    desc_spans: list[ByteSpan] = []
    for k, obj in enumerate(sort_objects(objects) if sort else objects):
        separator = ", " if (k > 0 or leading_comma) else ""
        head, desc, tail = _entry(first_index + k, obj)
        num_bytes += len((separator + head).encode("utf-8"))
        desc_bytes = len(desc.encode("utf-8"))
        desc_spans.append((num_bytes, num_bytes + desc_bytes))
        num_bytes += desc_bytes + len(tail.encode("utf-8"))
        parts += [separator, head, desc, tail]
    parts.append("}")
    return "".join(parts), desc_spans


def serialize_objects_with_desc_spans(objects: Sequence[BoxedObject]) -> tuple[str, list[ByteSpan]]:
    """`serialize_objects` plus the desc byte span of each object, in answer (sorted) order."""
    return _render(objects, first_index=1, leading_comma=False, opening="{")


def serialize_in_order_with_desc_spans(objects: Sequence[BoxedObject]) -> tuple[str, list[ByteSpan]]:
    """The canonical answer text for `objects` in the GIVEN order (keys object_1..N; `{}` when empty),
    plus each object's desc byte span: the clean-prefix Channel-B target keeps the rollout's order."""
    return _render(objects, first_index=1, leading_comma=False, opening="{", sort=False)


def serialize_objects(objects: Sequence[BoxedObject]) -> str:
    """The assistant answer for these objects (sorted; keys object_1..N; `{}` when empty)."""
    return serialize_objects_with_desc_spans(objects)[0]


def append_fragment_with_desc_spans(
    fn_objects: Sequence[BoxedObject], *, max_object_index: int, prefix_has_entries: bool
) -> tuple[str, list[ByteSpan]]:
    """`append_fragment` plus the desc byte span (within the fragment) of each appended object."""
    if max_object_index < 0:
        raise ValueError(f"max_object_index must be >= 0, got {max_object_index}")
    return _render(fn_objects, first_index=max_object_index + 1, leading_comma=prefix_has_entries, opening="")


def append_fragment(
    fn_objects: Sequence[BoxedObject], *, max_object_index: int, prefix_has_entries: bool
) -> str:
    """The text that completes a rollout prefix: the missed objects, then the closing `}`.

    Keys continue at `max_object_index + 1` (the largest `object_N` seen in the prefix, dropped
    entries included); a comma leads only when the prefix already holds an entry. The prefix must
    end right after `{` or right after an entry's value. E.g. after `{"object_3": {...}` with one
    missed object: `, "object_4": {"desc": ..., "bbox_2d": [...]}}`; with none: `}`.
    """
    return append_fragment_with_desc_spans(
        fn_objects, max_object_index=max_object_index, prefix_has_entries=prefix_has_entries
    )[0]
