"""What the parser and the target builder need to know about a tokenizer, as plain data.

`TokenVocab` holds the exact bytes of every token id, where the coordinate tokens are, which ids
end a turn, and a bytes -> id map of ordinary tokens used to re-encode the head of a fused token
(`}}`, `},`) when a rollout prefix is cut inside it. It is built once per tokenizer, either from a
token-bytes table (`table[id]` = the bytes token `id` stands for, as
`token_bytes_table` below returns) or from a tokenizer. `token_bytes_table` works for any byte-level
BPE tokenizer (the tiny one, real Qwen ones): ordinary tokens are mapped back through the ByteLevel
unicode alphabet, added tokens are their content in UTF-8.

Re-encoding rule (documented because it decides prefix token ids): the bytes are spelled by the
single ordinary token with exactly those bytes when one exists, else greedily by the longest
ordinary token at each position. Every byte must have a single-byte token (true of every
byte-level BPE), so re-encoding always succeeds.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING

from stagectl.detection.coords import CoordTokenIds

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@cache
def _unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: the printable stand-in character -> the byte it encodes."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    byte_values = list(printable)
    chars = list(printable)
    for b in range(256):
        if b not in printable:  # unprintable bytes are shifted to 256, 257, ... in byte order
            byte_values.append(b)
            chars.append(256 + len(chars) - len(printable))
    return {chr(c): b for b, c in zip(byte_values, chars, strict=True)}


def token_bytes_table(tokenizer: PreTrainedTokenizerBase, vocab_size: int | None = None) -> list[bytes]:
    """`table[id]` = the exact bytes token `id` decodes to, for every id of a byte-level BPE tokenizer.

    `vocab_size` pads the table with `b""` up to the model's embedding size (which may exceed the
    tokenizer's length); ids with no token (holes) also map to `b""`.
    """
    added = {i: t.content for i, t in tokenizer.added_tokens_decoder.items()}
    token_of_id = {i: t for t, i in tokenizer.get_vocab().items()}
    unicode_to_byte = _unicode_to_byte()
    size = max(len(tokenizer), vocab_size or 0)
    table: list[bytes] = []
    for token_id in range(len(tokenizer)):
        if token_id in added:
            table.append(added[token_id].encode("utf-8"))
        elif token_id in token_of_id:
            table.append(bytes(unicode_to_byte[ch] for ch in token_of_id[token_id]))
        else:
            table.append(b"")
    table.extend(b"" for _ in range(size - len(table)))
    return table


END_OF_TURN = "<|im_end|>"
# Other ids that also end a response (a hard stop like end-of-turn) when the vocabulary has them.
EXTRA_STOP_TOKENS = ("<|endoftext|>",)
# Tokens that look like `<|name|>` are treated as special (never used to re-encode) in a bare table.
_SPECIAL_LOOKING = re.compile(rb"<\|[^<>|]*\|>")


@dataclass(frozen=True)
class TokenVocab:
    """Token bytes plus the ids the detection code cares about (see the module docstring)."""

    token_bytes: Sequence[bytes]  # [vocab_size]
    coords: CoordTokenIds
    end_of_turn_id: int  # appended after every target segment
    stop_ids: frozenset[int]  # end-of-turn and extra stops: a response is cut at the first of these
    ordinary_id_of_bytes: dict[bytes, int]  # re-encoding map: ordinary (non-added) tokens only
    max_token_bytes: int

    @classmethod
    def from_table(
        cls,
        token_bytes: Sequence[bytes],
        *,
        end_of_turn: str = END_OF_TURN,
        special_ids: Sequence[int] = (),
    ) -> TokenVocab:
        """Build from a token-bytes table. `special_ids` (added tokens) are never used to re-encode;
        without them, tokens spelled like `<|name|>` are treated as special."""
        by_bytes: dict[bytes, list[int]] = {}
        for token_id, raw in enumerate(token_bytes):
            by_bytes.setdefault(raw, []).append(token_id)
        eot_ids = by_bytes.get(end_of_turn.encode("utf-8"), [])
        if not eot_ids:
            raise ValueError(f"vocabulary has no single token {end_of_turn!r} (the end-of-turn token)")
        stop_ids = set(eot_ids)
        for name in EXTRA_STOP_TOKENS:
            stop_ids.update(by_bytes.get(name.encode("utf-8"), []))
        coords = CoordTokenIds.from_table(token_bytes)
        excluded = stop_ids | set(coords.ids) | {int(i) for i in special_ids}
        ordinary: dict[bytes, int] = {}
        for token_id, raw in enumerate(token_bytes):
            if not raw or token_id in excluded or raw in ordinary:
                continue
            if not special_ids and _SPECIAL_LOOKING.fullmatch(raw):
                continue
            ordinary[raw] = token_id
        missing = [b for b in range(256) if bytes([b]) not in ordinary]
        if missing:
            raise ValueError(
                f"vocabulary lacks single-byte tokens for {len(missing)} byte values (first: {missing[0]:#04x}); "
                "a byte-level BPE vocabulary is required"
            )
        return cls(
            token_bytes=token_bytes,
            coords=coords,
            end_of_turn_id=eot_ids[0],
            stop_ids=frozenset(stop_ids),
            ordinary_id_of_bytes=ordinary,
            max_token_bytes=max(len(raw) for raw in ordinary),
        )

    @classmethod
    def from_tokenizer(
        cls, tokenizer: PreTrainedTokenizerBase, *, end_of_turn: str = END_OF_TURN
    ) -> TokenVocab:
        """Build from a byte-level BPE tokenizer (the tiny one or a real Qwen one)."""
        special_ids = sorted(tokenizer.added_tokens_decoder)
        return cls.from_table(token_bytes_table(tokenizer), end_of_turn=end_of_turn, special_ids=special_ids)

    def encode_bytes(self, raw: bytes) -> list[int]:
        """Spell `raw` with ordinary tokens: one exact token if it exists, else greedy longest match."""
        exact = self.ordinary_id_of_bytes.get(raw)
        if exact is not None:
            return [exact]
        ids: list[int] = []
        pos = 0
        while pos < len(raw):
            for length in range(min(self.max_token_bytes, len(raw) - pos), 0, -1):
                token_id = self.ordinary_id_of_bytes.get(raw[pos : pos + length])
                if token_id is not None:
                    ids.append(token_id)
                    pos += length
                    break
            else:  # unreachable: every single byte is an ordinary token (checked in from_table)
                raise AssertionError(f"no token spells byte {raw[pos]:#04x}")
        return ids


_CACHE_SIZE = 8
# id(source) -> (source, size when built, vocab). Holding `source` keeps its id from being reused.
_cache: OrderedDict[int, tuple[object, int, TokenVocab]] = OrderedDict()


def as_vocab(source: TokenVocab | Sequence[bytes] | PreTrainedTokenizerBase) -> TokenVocab:
    """A `TokenVocab` for a vocab, a token-bytes table or a tokenizer (the last two built once and cached;
    do not mutate a table after handing it in)."""
    if isinstance(source, TokenVocab):
        return source
    size = len(source)
    hit = _cache.get(id(source))
    if hit is not None and hit[0] is source and hit[1] == size:
        return hit[2]
    if isinstance(source, (list, tuple)):
        vocab = TokenVocab.from_table(source)
    else:
        vocab = TokenVocab.from_tokenizer(source)  # type: ignore[arg-type]
    _cache[id(source)] = (source, size, vocab)
    while len(_cache) > _CACHE_SIZE:
        _cache.popitem(last=False)
    return vocab
