"""A small JSON scanner over the joined bytes of a token sequence, for the rollout parser.

It reads one JSON value at a time from a byte offset and returns a light tree whose strings are
byte spans, so the parser can map every piece back to tokens. A string whose content is exactly one
coordinate token (given as `coord_at`: byte offset -> (token index, bin, end offset)) becomes a
`CoordNode`; the same text spelled by ordinary tokens stays a `StrNode`.

Errors are two exceptions the parser catches: `Incomplete` (the bytes ran out inside a value: a
truncated rollout) and `Invalid` (the next byte cannot continue valid JSON). Strings must be valid
UTF-8 with valid escapes; nesting deeper than `MAX_DEPTH` counts as invalid (recursion stays bounded).

`FAST_FIRST_ENTRY` / `FAST_NEXT_ENTRY` match one whole canonical entry
(`"object_N": {"desc": "...", "bbox_2d": ["<|coord_a|>", ...x4]}`, any JSON whitespace) in a single
regex call; the parser uses them as a fast path and falls back to the scanner when they do not match.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

MAX_DEPTH = 16
WS = b" \t\n\r"

_W = rb"[ \t\n\r]*"
STRING_PATTERN = rb'"[^"\\\x00-\x1f]*(?:\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4})[^"\\\x00-\x1f]*)*"'
# One lexeme after optional whitespace: group 1 punctuation | 2 string | 3 number | 4 literal.
_LEXEME = re.compile(
    _W + rb"(?:([{}\[\]:,])|(" + STRING_PATTERN + rb")|(-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?)"
    rb"|(true|false|null))"
)
# A lexeme cut off by the end of the bytes.
_PARTIAL_LEXEME = re.compile(
    rb'(?:"[^"\\\x00-\x1f]*(?:\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4})[^"\\\x00-\x1f]*)*(?:\\(?:u[0-9a-fA-F]{0,3})?)?'
    rb"|-?[0-9]*\.?[0-9]*(?:[eE][+-]?[0-9]*)?|t(?:r(?:u)?)?|f(?:a(?:l(?:s)?)?)?|n(?:u(?:l)?)?)\Z"
)
STRING_KIND, NUMBER_KIND, LITERAL_KIND = 2, 3, 4  # lexeme kinds; punctuation's kind is its byte value
LBRACE, RBRACE, LBRACKET, RBRACKET, COLON, COMMA = b"{}[]:,"

_COORD = _W + rb'"(<\|coord_[0-9]{1,3}\|>)"'
_CANONICAL_ENTRY = (
    _W + rb'"object_([1-9][0-9]*)"' + _W + rb":" + _W + rb"\{" + _W + rb'"desc"' + _W + rb":" + _W
    + rb"(" + STRING_PATTERN + rb")" + _W + rb"," + _W + rb'"bbox_2d"' + _W + rb":" + _W + rb"\["
    + _COORD + (_W + rb"," + _COORD) * 3 + _W + rb"\]" + _W + rb"\}"
)  # fmt: skip
# Groups: 1 = N, 2 = the desc string (quotes included), 3..6 = the coordinate token texts.
FAST_FIRST_ENTRY = re.compile(_CANONICAL_ENTRY)
FAST_NEXT_ENTRY = re.compile(_W + rb"," + _CANONICAL_ENTRY)


class Incomplete(Exception):
    """The bytes ended inside a value."""


class Invalid(Exception):
    """The next byte cannot continue valid JSON."""


@dataclass(slots=True)
class StrNode:
    start: int  # byte offsets of the content, quotes excluded
    end: int


@dataclass(slots=True)
class CoordNode:
    start: int  # byte offsets of the content (one coordinate token), quotes excluded
    end: int
    bin: int
    token_pos: int


@dataclass(slots=True)
class DictNode:
    items: list[tuple[StrNode, Node]]


@dataclass(slots=True)
class ListNode:
    items: list[Node]


class ScalarNode:
    """A number, true, false or null."""


SCALAR = ScalarNode()
Node = StrNode | CoordNode | DictNode | ListNode | ScalarNode


def decode_string(buf: bytes, start: int, end: int) -> str:
    """The text of string content buf[start:end] (already checked: valid UTF-8, valid escapes)."""
    raw = buf[start:end].decode("utf-8")
    if "\\" not in raw:
        return raw
    decoded = json.loads('"' + raw + '"')
    assert isinstance(decoded, str)
    return decoded


class Scanner:
    """Reads JSON values from `buf` starting at `pos`; `pos` advances past what was read."""

    def __init__(self, buf: bytes, coord_at: dict[int, tuple[int, int, int]], pos: int = 0) -> None:
        self.buf = buf
        self.coord_at = coord_at  # byte offset -> (token index, bin, end offset) of each coordinate token
        self.pos = pos

    def lex(self) -> tuple[int, int, int]:
        """The next lexeme as (kind, start, end)."""
        match = _LEXEME.match(self.buf, self.pos)
        if match is None:
            rest = self.pos
            while rest < len(self.buf) and self.buf[rest] in WS:
                rest += 1
            if rest == len(self.buf) or _PARTIAL_LEXEME.match(self.buf, rest):
                raise Incomplete
            raise Invalid
        self.pos = match.end()
        kind = match.lastindex
        assert kind is not None
        if kind == 1:
            return self.buf[match.start(1)], match.start(1), match.end()
        return kind, match.start(kind), match.end()

    def string(self, start: int, end: int) -> StrNode | CoordNode:
        """The string lexeme buf[start:end] (quotes included)."""
        coord = self.coord_at.get(start + 1)
        if coord is not None and coord[2] == end - 1:
            return CoordNode(start + 1, end - 1, coord[1], coord[0])
        try:
            self.buf[start + 1 : end - 1].decode("utf-8")
        except UnicodeDecodeError:
            raise Invalid from None
        return StrNode(start + 1, end - 1)

    def key(self) -> StrNode:
        kind, start, end = self.lex()
        if kind != STRING_KIND:
            raise Invalid
        node = self.string(start, end)
        return StrNode(node.start, node.end)  # a coordinate token used as a key is plain text

    def colon(self) -> None:
        if self.lex()[0] != COLON:
            raise Invalid

    def closes(self, closer: int) -> bool:
        """Consume `closer` if it comes next."""
        saved = self.pos
        if self.lex()[0] == closer:
            return True
        self.pos = saved
        return False

    def separator(self, closer: int) -> bool:
        """After an item: True at `closer`, False at `,`, else invalid."""
        kind = self.lex()[0]
        if kind == closer:
            return True
        if kind != COMMA:
            raise Invalid
        return False

    def value(self, depth: int = 0) -> Node:
        kind, start, end = self.lex()
        if kind == STRING_KIND:
            return self.string(start, end)
        if kind in (NUMBER_KIND, LITERAL_KIND):
            return SCALAR
        if depth >= MAX_DEPTH or kind not in (LBRACE, LBRACKET):
            raise Invalid
        if kind == LBRACE:
            items: list[tuple[StrNode, Node]] = []
            if self.closes(RBRACE):
                return DictNode(items)
            while True:
                key = self.key()
                self.colon()
                items.append((key, self.value(depth + 1)))
                if self.separator(RBRACE):
                    return DictNode(items)
        elements: list[Node] = []
        if self.closes(RBRACKET):
            return ListNode(elements)
        while True:
            elements.append(self.value(depth + 1))
            if self.separator(RBRACKET):
                return ListNode(elements)
