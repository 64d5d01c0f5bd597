"""The norm-1000 coordinate codec and the 1000 coordinate tokens.

A pixel coordinate `x` on an axis of `size` pixels (corner positions 0..size-1) is stored as the bin
`round(999 * x / (size - 1))` clamped to 0..999 and decoded as `bin / 999 * (size - 1)`. Python's
`round` (half to even) is used, the same as `stagectl.data.sample`. A 1-pixel axis maps everything to
bin 0. Each bin is written as one added token, `<|coord_0|>`..`<|coord_999|>`.

`CoordTokenIds` is the id lookup for one tokenizer: the id of every bin and the reverse map
id -> bin. It is built either from a tokenizer or from a token-bytes table (`table[id]` = the exact
bytes of token `id`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

NUM_BINS = 1000
MAX_BIN = NUM_BINS - 1

Box = tuple[int, int, int, int]  # (x1, y1, x2, y2) in bins

COORD_TOKEN_RE = re.compile(r"<\|coord_(0|[1-9][0-9]{0,2})\|>")


def coord_token(bin_index: int) -> str:
    """The token text of one bin, e.g. `coord_token(12) == "<|coord_12|>"`."""
    if not 0 <= bin_index <= MAX_BIN:
        raise ValueError(f"coordinate bin {bin_index} is outside 0..{MAX_BIN}")
    return f"<|coord_{bin_index}|>"


COORD_TOKENS: tuple[str, ...] = tuple(coord_token(b) for b in range(NUM_BINS))


def bin_of_coord_token(text: str) -> int | None:
    """`"<|coord_12|>"` -> 12; None for anything that is not exactly one coordinate token."""
    match = COORD_TOKEN_RE.fullmatch(text)
    return int(match.group(1)) if match else None


def to_bin(x: float, size: int) -> int:
    """Pixel coordinate on the 0..size-1 axis -> norm-1000 bin (round, then clamp to 0..999)."""
    if size < 1:
        raise ValueError(f"axis size must be >= 1 pixel, got {size}")
    if size == 1:
        return 0
    return min(MAX_BIN, max(0, round(MAX_BIN * x / (size - 1))))


def from_bin(bin_index: int, size: int) -> float:
    """Norm-1000 bin -> pixel coordinate on the 0..size-1 axis."""
    if size < 1:
        raise ValueError(f"axis size must be >= 1 pixel, got {size}")
    return bin_index / MAX_BIN * (size - 1)


def box_to_bins(box: Sequence[float], width: int, height: int) -> Box:
    """`(x1, y1, x2, y2)` in pixels -> the same box in bins."""
    x1, y1, x2, y2 = box
    return (to_bin(x1, width), to_bin(y1, height), to_bin(x2, width), to_bin(y2, height))


def bins_to_box(bins: Sequence[int], width: int, height: int) -> tuple[float, float, float, float]:
    """`(x1, y1, x2, y2)` in bins -> the same box in (fractional) pixels."""
    x1, y1, x2, y2 = bins
    return (from_bin(x1, width), from_bin(y1, height), from_bin(x2, width), from_bin(y2, height))


@dataclass(frozen=True)
class CoordTokenIds:
    """Where the coordinate tokens live in one vocabulary.

    `ids[b]` is the token id of bin `b` (1000 entries); `bin_of_id` is the reverse map.
    """

    ids: tuple[int, ...]
    bin_of_id: dict[int, int]

    @classmethod
    def from_ids(cls, ids: Sequence[int]) -> CoordTokenIds:
        if len(ids) != NUM_BINS:
            raise ValueError(f"need {NUM_BINS} coordinate token ids, got {len(ids)}")
        if len(set(ids)) != NUM_BINS:
            raise ValueError("coordinate token ids must be distinct")
        return cls(ids=tuple(int(i) for i in ids), bin_of_id={int(i): b for b, i in enumerate(ids)})

    @classmethod
    def from_table(cls, token_bytes: Sequence[bytes]) -> CoordTokenIds:
        """Find the ids whose bytes are exactly `<|coord_B|>`; `ValueError` if a bin has no such token."""
        found: dict[int, int] = {}
        for token_id, raw in enumerate(token_bytes):
            if raw.startswith(b"<|coord_") and raw.endswith(b"|>"):
                bin_index = bin_of_coord_token(raw.decode("ascii", errors="replace"))
                if bin_index is not None:
                    found.setdefault(bin_index, token_id)
        missing = [b for b in range(NUM_BINS) if b not in found]
        if missing:
            raise ValueError(
                f"vocabulary lacks {len(missing)} coordinate tokens (first: {coord_token(missing[0])}); "
                "add them as single tokens to the tokenizer"
            )
        return cls.from_ids([found[b] for b in range(NUM_BINS)])

    @classmethod
    def from_tokenizer(cls, tokenizer: PreTrainedTokenizerBase) -> CoordTokenIds:
        """Look the 1000 tokens up in a tokenizer; `ValueError` if any is not a single known token."""
        ids = tokenizer.convert_tokens_to_ids(list(COORD_TOKENS))
        assert isinstance(ids, list)
        unk = tokenizer.unk_token_id
        missing = [b for b, i in enumerate(ids) if i is None or i == unk]
        if missing:
            raise ValueError(
                f"tokenizer lacks {len(missing)} coordinate tokens (first: {coord_token(missing[0])}); "
                "add them as single tokens to the tokenizer"
            )
        return cls.from_ids(ids)
