"""Shared helpers for the detection tests (no tests here): a toy byte-level vocabulary whose token
boundaries the tests choose, and random objects."""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from stagectl.detection.coords import COORD_TOKENS
from stagectl.detection.vocab import TokenVocab

SPECIALS = ("<|im_end|>", "<|endoftext|>", "<|im_start|>")
COLOURS = ("red", "green", "blue", "yellow", "purple", "black", "white", "orange")
SHAPES = ("circle", "square", "triangle", "star", "ring", "oval", "box", "diamond")


@dataclass(frozen=True)
class Obj:
    desc: str
    bbox_2d: tuple[int, int, int, int]


@dataclass(frozen=True)
class ToyTokenizer:
    """256 single-byte tokens, then `merges` (multi-byte ordinary tokens), then the coordinate and
    special tokens. `encode` splits out added tokens, then spells the rest greedily (longest first)."""

    table: list[bytes]
    vocab: TokenVocab
    encode: Callable[[str], list[int]]

    def ids(self, *pieces: str) -> list[int]:
        """Token ids with explicit boundaries: each piece must be exactly one token."""
        return [self.table.index(p.encode("utf-8")) for p in pieces]

    def text(self, ids: Sequence[int]) -> str:
        return b"".join(self.table[i] for i in ids).decode("utf-8")


def toy_tokenizer(merges: Sequence[str] = ()) -> ToyTokenizer:
    table = [bytes([b]) for b in range(256)]
    table += [m.encode("utf-8") for m in merges]
    table += [t.encode("utf-8") for t in (*COORD_TOKENS, *SPECIALS)]
    added = {
        t: len(table) - len(SPECIALS) - len(COORD_TOKENS) + k
        for k, t in enumerate((*COORD_TOKENS, *SPECIALS))
    }
    ordinary = {raw: i for i, raw in enumerate(table[: 256 + len(merges)])}
    longest = max(len(raw) for raw in ordinary)
    splitter = re.compile("(" + "|".join(re.escape(t) for t in added) + ")")

    def encode(text: str) -> list[int]:
        ids: list[int] = []
        for k, piece in enumerate(splitter.split(text)):
            if k % 2:
                ids.append(added[piece])
                continue
            raw, pos = piece.encode("utf-8"), 0
            while pos < len(raw):
                for length in range(min(longest, len(raw) - pos), 0, -1):
                    if raw[pos : pos + length] in ordinary:
                        ids.append(ordinary[raw[pos : pos + length]])
                        pos += length
                        break
        return ids

    return ToyTokenizer(table=table, vocab=TokenVocab.from_table(table), encode=encode)


def random_objects(rng: random.Random, max_objects: int = 6) -> list[Obj]:
    objects = []
    for _ in range(rng.randint(0, max_objects)):
        x1, x2 = sorted(rng.randrange(1000) for _ in range(2))
        y1, y2 = sorted(rng.randrange(1000) for _ in range(2))
        objects.append(Obj(f"{rng.choice(COLOURS)} {rng.choice(SHAPES)}", (x1, y1, x2, y2)))
    return objects
