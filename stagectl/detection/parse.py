"""Strict, token-aligned parse of one rollout into predicted objects and a reusable prefix.

`parse_rollout(response_token_ids, vocab_or_table_or_tokenizer) -> RolloutParse`. It never raises on
model output (any sequence of ints; ids outside the vocabulary read as a byte that breaks the JSON).

Rules (docs/design.md#strict-parse):
- The response is cut at the first end-of-turn (or `<|endoftext|>`): a hard stop.
- The token bytes are joined and scanned once as JSON. Leading whitespace is allowed; anything else
  before the opening `{` (or no `{` at all) is an invalid rollout: prefix `{`, zero objects,
  `stop_reason == "no_open_brace"`.
- The top level is a JSON object. Each complete entry is judged on its own: it is kept when the key
  is `object_N` (N >= 1, no leading zeros, not seen before) and the value is exactly
  `{"desc": non-blank string, "bbox_2d": [4 coordinate strings]}` (either key order) with
  x1 <= x2 and y1 <= y2, and a desc that spells no special token (`<|coord_5|>`) and holds no lone surrogate. A coordinate string is `"` + ONE coordinate token + `"`: the same text spelled
  with ordinary tokens, or a number, is not a coordinate. Anything else is dropped with one reason
  (`entries.DROP_REASONS`, checked in that order), never repaired. Kept objects keep appearance order.
- Scanning stops at the top-level `}` ("closed"), at the end of the tokens ("end_of_input", which
  sets `truncated`) or at the first byte that cannot continue valid JSON ("syntax_error"). Text after
  the last complete entry, if any, counts as one dropped entry with reason "truncated" or
  "syntax_error". Text after the closing `}` is ignored.

The prefix. `prefix_token_ids` is the response cut right after the value of the last complete entry
(kept or dropped), or right after the opening `{` when there is none; whitespace before `{` stays.
It stays in token space: the tokens before the cut are kept as generated, and a token that straddles
the cut (a fused `}}`, `},`, `"]},`) is replaced by the re-encoding of its bytes before the cut
(`TokenVocab.encode_bytes`). Appending `append_fragment(...)` (`, "object_K": {...}}` or `}`) to the
prefix therefore gives valid JSON.

Dropped entries are MASKED, not excluded: a complete but invalid entry stays in the prefix as
generated (it is valid JSON, so the prefix still is) and is listed in `dropped_objects` with its
token span, which the target builder masks out. Its `object_N` index still counts in
`max_object_index`, so appended keys never collide with it.

Speed: the token bytes are joined once and scanned with regexes; a canonical entry is matched by one
regex (`json_scan.FAST_*_ENTRY`) and only anything else goes through the lexeme scanner, which gives
the same result for canonical entries (`_parse(..., fast=False)`, compared in the tests).

Token spans: every entry owns the bytes from the end of the previous entry (or the `{`) to the end
of its value, so the separating `, ` belongs to the entry after it. `token_span` is the half-open
range of prefix tokens overlapping those bytes; a fused token at a boundary overlaps both neighbours.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from typing import TYPE_CHECKING

from stagectl.detection.coords import Box
from stagectl.detection.entries import Entry, fast_entry, judge_entry
from stagectl.detection.json_scan import (
    COMMA,
    FAST_FIRST_ENTRY,
    FAST_NEXT_ENTRY,
    LBRACE,
    RBRACE,
    WS,
    Incomplete,
    Invalid,
    Scanner,
)
from stagectl.detection.vocab import TokenVocab, as_vocab

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

TokenSpan = tuple[int, int]  # [start, end) token indices into prefix_token_ids

STOP_CLOSED = "closed"
STOP_END_OF_INPUT = "end_of_input"
STOP_SYNTAX_ERROR = "syntax_error"
STOP_NO_OPEN_BRACE = "no_open_brace"

# The unfinished text after the last complete entry.
UNFINISHED_REASONS = ("truncated", "syntax_error")

_UNKNOWN_TOKEN_BYTES = b"\x00"  # ids outside the vocabulary: a byte no JSON may contain


@dataclass(frozen=True)
class ParsedObject:
    """A kept object. Positions index `prefix_token_ids` (and the response: coordinate tokens are never
    re-encoded)."""

    key_index: int  # N of object_N
    desc: str
    bbox_2d: Box  # (x1, y1, x2, y2) bins
    coord_positions: tuple[int, int, int, int]  # token index of each coordinate slot
    token_span: TokenSpan  # the whole entry, leading separator included
    desc_token_span: TokenSpan  # tokens overlapping the desc text (between its quotes)
    desc_bytes: tuple[int, int]  # [start, end) of the desc text as written (between its quotes), in bytes


@dataclass(frozen=True)
class DroppedObject:
    """A complete but invalid entry; it stays in the prefix and is masked by the target builder."""

    reason: str  # one of entries.DROP_REASONS
    key_index: int | None  # N when the key is object_N
    token_span: TokenSpan


@dataclass(frozen=True)
class RolloutParse:
    prefix_token_ids: list[int]
    valid_objects: list[ParsedObject]
    dropped_objects: list[DroppedObject]  # complete invalid entries inside the prefix
    dropped_by_reason: dict[str, int]  # dropped_objects by reason + the unfinished tail (UNFINISHED_REASONS)
    max_object_index: int  # largest object_N among complete entries (kept or dropped); 0 if none
    num_prefix_entries: int  # complete entries in the prefix (kept + dropped)
    truncated: bool  # the input ended before the top-level object closed
    stop_reason: str  # STOP_CLOSED | STOP_END_OF_INPUT | STOP_SYNTAX_ERROR | STOP_NO_OPEN_BRACE
    num_response_tokens: int  # tokens scanned: the response up to (excluding) the first stop token
    stop_token_seen: bool  # the response contained an end-of-turn / stop token
    dropped_total: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "dropped_total", sum(self.dropped_by_reason.values()))

    @property
    def prefix_has_entries(self) -> bool:
        return self.num_prefix_entries > 0

    @property
    def invalid_rollout(self) -> bool:
        """No opening `{`: nothing of the answer is kept (the prefix is a bare `{`)."""
        return self.stop_reason == STOP_NO_OPEN_BRACE

    # How an answer ended, three ways that partition every rollout (the rollout stats and the eval count
    # them): `valid_json`, `truncated` (more tokens could still have closed it) or `not_json`.

    @property
    def valid_json(self) -> bool:
        """The answer is one complete JSON object: the top level closed. Its entries may still have been
        dropped (counted per entry); text after the closing `}` is ignored."""
        return self.stop_reason == STOP_CLOSED

    @property
    def not_json(self) -> bool:
        """The answer can never be the JSON object: no opening `{`, or a byte no JSON may have there."""
        return self.stop_reason in (STOP_NO_OPEN_BRACE, STOP_SYNTAX_ERROR)


# ---------------------------------------------------------------------------------------------------
# The rollout.


def _cut_at_stop(ids: list[int], stop_ids: frozenset[int]) -> tuple[list[int], bool]:
    first = len(ids)
    for stop_id in stop_ids:
        try:
            first = min(first, ids.index(stop_id, 0, first))
        except ValueError:
            continue
    return ids[:first], first < len(ids)


def _token_bytes(ids: list[int], vocab: TokenVocab) -> list[bytes]:
    table = vocab.token_bytes
    if ids and (min(ids) < 0 or max(ids) >= len(table)):
        return [table[i] if 0 <= i < len(table) else _UNKNOWN_TOKEN_BYTES for i in ids]
    return list(map(table.__getitem__, ids))


def _span(starts: Sequence[int], start: int, end: int) -> TokenSpan:
    """Tokens overlapping bytes [start, end), given token start offsets (`starts[-1]` = total bytes)."""
    if start >= end:
        return (0, 0)
    return (bisect_right(starts, start) - 1, bisect_left(starts, end))


def _scan_entries(
    buf: bytes, coord_at: dict[int, tuple[int, int, int]], open_at: int, fast: bool
) -> tuple[list[Entry], int, str]:
    """Judge the top-level entries after the `{` at `open_at`: (entries, end of the last one, stop reason).

    Each entry first tries the one-regex canonical shape (`fast`); anything else goes through the
    scanner, which gives the same verdict for canonical entries (tested) and judges the rest."""
    scanner = Scanner(buf, coord_at, pos=open_at + 1)
    boundary = open_at + 1  # end of the last complete entry, or just after `{`
    entries: list[Entry] = []
    seen_keys: set[str] = set()
    while True:
        if fast:
            match = (FAST_NEXT_ENTRY if entries else FAST_FIRST_ENTRY).match(buf, boundary)
            entry = fast_entry(match, buf, coord_at, seen_keys) if match else None
            if entry is not None:
                entries.append(entry)
                boundary = scanner.pos = entry.region[1]
                continue
        try:
            if scanner.closes(RBRACE):
                return entries, boundary, STOP_CLOSED
            if entries and scanner.lex()[0] != COMMA:
                raise Invalid
            key = scanner.key()
            scanner.colon()
            value = scanner.value()
        except Incomplete:
            return entries, boundary, STOP_END_OF_INPUT
        except Invalid:
            return entries, boundary, STOP_SYNTAX_ERROR
        entries.append(judge_entry(buf, key, value, seen_keys, (boundary, scanner.pos)))
        boundary = scanner.pos


def parse_rollout(
    response_token_ids: Sequence[int], vocab: TokenVocab | Sequence[bytes] | PreTrainedTokenizerBase
) -> RolloutParse:
    """Parse one response (generated ids, prompt excluded) strictly; see the module docstring."""
    return _parse(response_token_ids, as_vocab(vocab), fast=True)


def _parse(response_token_ids: Sequence[int], vocab: TokenVocab, fast: bool) -> RolloutParse:
    ids, stop_seen = _cut_at_stop(list(map(int, response_token_ids)), vocab.stop_ids)
    pieces = _token_bytes(ids, vocab)
    buf = b"".join(pieces)
    starts = list(accumulate(map(len, pieces), initial=0))  # [T + 1] byte offset of each token

    open_at = 0
    while open_at < len(buf) and buf[open_at] in WS:
        open_at += 1
    if open_at == len(buf) or buf[open_at] != LBRACE:
        return RolloutParse(
            prefix_token_ids=vocab.encode_bytes(b"{"),
            valid_objects=[],
            dropped_objects=[],
            dropped_by_reason={},
            max_object_index=0,
            num_prefix_entries=0,
            truncated=False,
            stop_reason=STOP_NO_OPEN_BRACE,
            num_response_tokens=len(ids),
            stop_token_seen=stop_seen,
        )

    bin_of_id = vocab.coords.bin_of_id
    coord_at = {
        starts[k]: (k, bin_of_id[token_id], starts[k + 1])
        for k, token_id in enumerate(ids)
        if token_id in bin_of_id
    }
    entries, boundary, stop_reason = _scan_entries(buf, coord_at, open_at, fast)

    dropped_by_reason: dict[str, int] = {}
    for entry in entries:
        if entry.reason is not None:
            dropped_by_reason[entry.reason] = dropped_by_reason.get(entry.reason, 0) + 1
    if stop_reason != STOP_CLOSED:
        tail = buf[boundary:].lstrip(WS)
        if entries and tail.startswith(b","):
            tail = tail[1:].lstrip(WS)
        if tail:
            reason = "truncated" if stop_reason == STOP_END_OF_INPUT else "syntax_error"
            dropped_by_reason[reason] = dropped_by_reason.get(reason, 0) + 1

    # Prefix: whole tokens before the cut, then the re-encoded head of a token straddling it.
    num_whole = bisect_right(starts, boundary) - 1
    prefix_ids = ids[:num_whole]
    prefix_starts = starts[: num_whole + 1]
    if starts[num_whole] < boundary:
        for token_id in vocab.encode_bytes(buf[starts[num_whole] : boundary]):
            prefix_ids.append(token_id)
            prefix_starts.append(prefix_starts[-1] + len(vocab.token_bytes[token_id]))

    valid: list[ParsedObject] = []
    dropped: list[DroppedObject] = []
    for entry in entries:
        token_span = _span(prefix_starts, *entry.region)
        if entry.reason is not None:
            dropped.append(DroppedObject(entry.reason, entry.key_index, token_span))
            continue
        assert entry.key_index is not None
        x1, y1, x2, y2 = entry.bins
        p1, p2, p3, p4 = entry.coord_positions
        valid.append(
            ParsedObject(
                key_index=entry.key_index,
                desc=entry.desc,
                bbox_2d=(x1, y1, x2, y2),
                coord_positions=(p1, p2, p3, p4),
                token_span=token_span,
                desc_token_span=_span(prefix_starts, *entry.desc_bytes),
                desc_bytes=entry.desc_bytes,
            )
        )
    return RolloutParse(
        prefix_token_ids=prefix_ids,
        valid_objects=valid,
        dropped_objects=dropped,
        dropped_by_reason=dropped_by_reason,
        max_object_index=max((e.key_index for e in entries if e.key_index is not None), default=0),
        num_prefix_entries=len(entries),
        truncated=stop_reason == STOP_END_OF_INPUT,
        stop_reason=stop_reason,
        num_response_tokens=len(ids),
        stop_token_seen=stop_seen,
    )
