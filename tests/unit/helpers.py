"""Shared builders for the unit tests (no tests here): a toy byte-level vocabulary whose token boundaries
the tests choose, random objects, the hand-built Channel-A/B expectations of the target tests, and the
parse checker the fuzz tests share."""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from stagectl.config.plan import CleanPrefix, RawPrefix, ReorderedGT, TargetPlan
from stagectl.detection.coords import COORD_TOKENS
from stagectl.detection.parse import (
    STOP_END_OF_INPUT,
    UNFINISHED_REASONS,
    RolloutParse,
    _parse,
    parse_rollout,
)
from stagectl.detection.serialize import append_fragment
from stagectl.detection.vocab import TokenVocab

if TYPE_CHECKING:
    from stagectl.models.chat import EncodedSample

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


CHAR = toy_tokenizer()  # one token per character; coordinate tokens and <|im_end|> whole
EOT = "<|im_end|>"
TOY_PROMPT = "<prompt>"


@dataclass
class ToyEncoder:
    """What `learner.channel_b.build_b_segments` needs from a `SampleEncoder`, over the character
    tokenizer: every prompt is `TOY_PROMPT`."""

    samples: Sequence[Any]  # DetectionSample
    vocab: Any = CHAR.vocab

    def encode_text(self, text: str) -> list[int]:
        return CHAR.encode(text)

    def prompt(self, index: int) -> EncodedSample:
        from stagectl.models.chat import EncodedSample  # imports torch: only the tests that build B steps
        from stagectl.models.images import ImageInputs

        ids = CHAR.encode(TOY_PROMPT)
        return EncodedSample(ids, [0] * len(ids), len(ids), ImageInputs(None, None, []))  # type: ignore[arg-type]


def coord(b: int) -> str:
    return f"<|coord_{b}|>"


def expand(tok: ToyTokenizer, pieces: list[tuple[str, float]]) -> tuple[list[int], list[float]]:
    """Hand-built expectation: each piece's tokens get that piece's weight."""
    ids: list[int] = []
    weights: list[float] = []
    for text, weight in pieces:
        piece_ids = tok.encode(text)
        ids += piece_ids
        weights += [weight] * len(piece_ids)
    return ids, weights


def box_pieces(bins: tuple[int, int, int, int], structure: float) -> list[tuple[str, float]]:
    """`["<c>", "<c>", "<c>", "<c>"]}` with coordinate slots at 0 (their loss comes from the group)."""
    x1, y1, x2, y2 = bins
    return [
        ('", "bbox_2d": ["', structure),
        (coord(x1), 0.0),
        ('", "', structure),
        (coord(y1), 0.0),
        ('", "', structure),
        (coord(x2), 0.0),
        ('", "', structure),
        (coord(y2), 0.0),
        ('"]}', structure),
    ]


def coord_positions(ids: list[int], start: int) -> list[tuple[int, int, int, int]]:
    """Coordinate token positions from `start` on, in groups of 4."""
    found = [k for k, t in enumerate(ids) if t in CHAR.vocab.coords.bin_of_id and k >= start]
    return [(found[k], found[k + 1], found[k + 2], found[k + 3]) for k in range(0, len(found), 4)]


def parse_checked(ids: list[int], vocab: TokenVocab) -> RolloutParse:
    """parse_rollout, checked against the scanner-only path (no canonical-entry fast path)."""
    result = parse_rollout(ids, vocab)
    assert result == _parse(ids, vocab, fast=False)
    check_invariants(result, vocab)
    return result


def check_invariants(result: RolloutParse, vocab: TokenVocab) -> None:
    prefix = result.prefix_token_ids
    assert all(0 <= t < len(vocab.token_bytes) for t in prefix)
    assert result.num_prefix_entries == len(result.valid_objects) + len(result.dropped_objects)
    unfinished = sum(result.dropped_by_reason.get(r, 0) for r in UNFINISHED_REASONS)
    assert unfinished in (0, 1)
    assert result.dropped_total == len(result.dropped_objects) + unfinished
    assert result.truncated == (result.stop_reason == STOP_END_OF_INPUT)
    for obj in result.valid_objects:
        x1, y1, x2, y2 = obj.bbox_2d
        assert x1 <= x2 and y1 <= y2 and obj.desc.strip()
        assert tuple(vocab.coords.bin_of_id.get(prefix[p]) for p in obj.coord_positions) == obj.bbox_2d
        assert 0 <= obj.token_span[0] < obj.token_span[1] <= len(prefix)
        assert obj.token_span[0] <= obj.desc_token_span[0] < obj.desc_token_span[1] <= obj.token_span[1]
    for dropped in result.dropped_objects:
        assert 0 <= dropped.token_span[0] < dropped.token_span[1] <= len(prefix)
    # The prefix plus an FN append is valid JSON that holds every kept object.
    fragment = append_fragment(
        [Obj("missed", (1, 2, 3, 4))],
        max_object_index=result.max_object_index,
        prefix_has_entries=result.prefix_has_entries,
    )
    completed = json.loads(b"".join(vocab.token_bytes[t] for t in prefix).decode("utf-8") + fragment)
    assert completed[f"object_{result.max_object_index + 1}"]["desc"] == "missed"
    keys = [o.key_index for o in result.valid_objects]
    if len(set(keys)) == len(keys) and not any(d.reason == "duplicate_key" for d in result.dropped_objects):
        for obj in result.valid_objects:
            assert completed[f"object_{obj.key_index}"]["desc"] == obj.desc


def target_plan(kind: str, **knobs: Any) -> TargetPlan:
    """The `TargetPlan` of the target form `kind` (`stage2_ab.channel_b.target`), with `knobs` (its
    weights, duplicate threshold) as given."""
    shapes = {"raw_prefix": RawPrefix(), "clean_prefix": CleanPrefix(), "reordered_gt": ReorderedGT()}
    return TargetPlan(shape=shapes[kind], **knobs)  # type: ignore[arg-type]


def answer_entry(index: int, desc: str, bins: tuple[int, int, int, int]) -> str:
    """One `"object_N": {...}` entry of an answer, its box as coordinate tokens."""
    coords = ", ".join(f'"<|coord_{b}|>"' for b in bins)
    return f'"object_{index}": {{"desc": "{desc}", "bbox_2d": [{coords}]}}'
