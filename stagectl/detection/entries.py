"""One complete top-level entry of a rollout, as the strict parse (`parse.py`, whose docstring states the
rules) judges it: kept, or dropped with one reason (`DROP_REASONS`, checked in that order; the first that
applies is counted), never repaired.

Two paths give one verdict for a canonical entry (compared in the tests: `parse._parse(..., fast=False)`).
`judge_entry` applies every rule to the scanner's tree (`json_scan`); `fast_entry` reads one regex match of
the canonical shape (`json_scan.FAST_*_ENTRY`) and answers None for anything it cannot keep, which then goes
through the scanner.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from stagectl.detection.json_scan import CoordNode, DictNode, ListNode, Node, StrNode, decode_string

# Why a complete entry was dropped; checked in this order, the first that applies is counted.
DROP_REASONS = (
    "bad_key",  # the key is not object_N (N >= 1, no leading zeros)
    "duplicate_key",  # object_N repeated at the top level, or a key repeated inside the value
    "not_a_dict",  # the value is not a JSON object
    "nested_dict",  # a value inside the entry is itself an object
    "poly",  # a `poly` key (polygons are not supported)
    "extra_keys",  # keys other than desc and bbox_2d
    "missing_desc",
    "desc_not_string",
    "empty_desc",  # empty or whitespace only
    "special_token_in_desc",  # the desc spells a special token (`<|coord_5|>`, `<|im_end|>`): written again as
    # text (a clean-prefix target, a reordered answer) it would encode as that token, not as a label
    "surrogate_in_desc",  # the desc escapes half a UTF-16 surrogate pair (`\ud83d` alone): valid JSON, but the
    # text has no UTF-8 form, so writing it again (a clean-prefix target) cannot encode it
    "missing_bbox",
    "bbox_not_list",
    "bbox_arity",  # not exactly 4 values
    "non_coord_value",  # a value that is not one quoted coordinate token
    "bad_box_order",  # x2 < x1 or y2 < y1
)

_OBJECT_KEY = re.compile(r"object_([1-9][0-9]*)")
# the spelling of a special token (Qwen's `<|coord_N|>`, `<|im_end|>`, `<|vision_start|>`, ...)
_SPECIAL_TOKEN_TEXT = re.compile(r"<\|[A-Za-z0-9_]+\|>")
# a lone surrogate, what a `\udXXX` escape without its pair decodes to (a pair decodes to one character)
_SURROGATE = re.compile("[\ud800-\udfff]")


def spells_special_token(text: str) -> bool:
    """Whether `text` spells a special token (`<|coord_5|>`, `<|im_end|>`): written into a target it would
    encode as that token, not as text. The rule for a rollout's desc here and for a label in the data."""
    return _SPECIAL_TOKEN_TEXT.search(text) is not None


def desc_drop_reason(desc: str) -> str | None:
    """Why a string desc is dropped (`empty_desc`, `special_token_in_desc`, `surrogate_in_desc`), or None."""
    if not desc.strip():
        return "empty_desc"
    if spells_special_token(desc):
        return "special_token_in_desc"
    if _SURROGATE.search(desc):
        return "surrogate_in_desc"
    return None


@dataclass(slots=True)
class Entry:
    """The verdict on one entry, with what a kept one needs to become a `parse.ParsedObject`."""

    region: tuple[int, int]  # bytes owned: end of the previous entry (or `{`) .. end of the value
    key_index: int | None
    reason: str | None  # None when kept
    desc: str = ""
    desc_bytes: tuple[int, int] = (0, 0)
    bins: tuple[int, ...] = ()
    coord_positions: tuple[int, ...] = ()


def judge_entry(buf: bytes, key: StrNode, value: Node, seen_keys: set[str], region: tuple[int, int]) -> Entry:
    """The verdict on the entry `key: value` (scanner nodes over `buf`), owning the bytes `region`; the key
    joins `seen_keys`."""
    key_text = decode_string(buf, key.start, key.end)
    key_match = _OBJECT_KEY.fullmatch(key_text)
    key_index = int(key_match.group(1)) if key_match else None
    duplicate = key_text in seen_keys
    seen_keys.add(key_text)

    def drop(reason: str) -> Entry:
        return Entry(region=region, key_index=key_index, reason=reason)

    if key_index is None:
        return drop("bad_key")
    if duplicate:
        return drop("duplicate_key")
    if not isinstance(value, DictNode):
        return drop("not_a_dict")
    fields = {decode_string(buf, k.start, k.end): v for k, v in value.items}
    if len(fields) != len(value.items):
        return drop("duplicate_key")
    if any(isinstance(v, DictNode) for v in fields.values()):
        return drop("nested_dict")
    if "poly" in fields:
        return drop("poly")
    if fields.keys() - {"desc", "bbox_2d"}:
        return drop("extra_keys")
    desc = fields.get("desc")
    if desc is None:
        return drop("missing_desc")
    if isinstance(desc, CoordNode):  # the text of one coordinate token is still a string
        desc = StrNode(desc.start, desc.end)
    if not isinstance(desc, StrNode):
        return drop("desc_not_string")
    desc_text = decode_string(buf, desc.start, desc.end)
    desc_problem = desc_drop_reason(desc_text)
    if desc_problem is not None:
        return drop(desc_problem)
    bbox = fields.get("bbox_2d")
    if bbox is None:
        return drop("missing_bbox")
    if not isinstance(bbox, ListNode):
        return drop("bbox_not_list")
    if len(bbox.items) != 4:
        return drop("bbox_arity")
    coords = [c for c in bbox.items if isinstance(c, CoordNode)]
    if len(coords) != 4:
        return drop("non_coord_value")
    x1, y1, x2, y2 = (c.bin for c in coords)
    if x2 < x1 or y2 < y1:
        return drop("bad_box_order")
    return Entry(
        region=region,
        key_index=key_index,
        reason=None,
        desc=desc_text,
        desc_bytes=(desc.start, desc.end),
        bins=(x1, y1, x2, y2),
        coord_positions=tuple(c.token_pos for c in coords),
    )


def fast_entry(
    match: re.Match[bytes], buf: bytes, coord_at: dict[int, tuple[int, int, int]], seen_keys: set[str]
) -> Entry | None:
    """A kept entry from a canonical-shape match, or None when any rule needs the full scanner."""
    key_text = "object_" + match.group(1).decode("ascii")
    if key_text in seen_keys:
        return None
    positions, bins = [], []
    for group in (3, 4, 5, 6):
        coord = coord_at.get(match.start(group))
        if coord is None or coord[2] != match.end(group):
            return None  # coordinate text spelled by ordinary tokens
        positions.append(coord[0])
        bins.append(coord[1])
    x1, y1, x2, y2 = bins
    if x2 < x1 or y2 < y1:
        return None
    desc_start, desc_end = match.start(2) + 1, match.end(2) - 1
    try:
        desc = decode_string(buf, desc_start, desc_end)
    except UnicodeDecodeError:
        return None
    if desc_drop_reason(desc) is not None:
        return None
    seen_keys.add(key_text)
    return Entry(
        region=(match.start(), match.end()),  # from the end of the previous entry: the match starts there
        key_index=int(match.group(1)),
        reason=None,
        desc=desc,
        desc_bytes=(desc_start, desc_end),
        bins=(x1, y1, x2, y2),
        coord_positions=tuple(positions),
    )
