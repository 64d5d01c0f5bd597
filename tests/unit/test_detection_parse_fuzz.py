"""Property tests: parse_rollout never raises, and what it returns is always consistent and usable."""

from __future__ import annotations

import json
import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stagectl.detection.parse import (
    STOP_END_OF_INPUT,
    UNFINISHED_REASONS,
    RolloutParse,
    _parse,
    parse_rollout,
)
from stagectl.detection.serialize import append_fragment, serialize_objects
from stagectl.detection.vocab import TokenVocab
from stagectl.models.tokenizer import build_tiny_tokenizer
from tests.unit.test_detection_support import Obj, random_objects, toy_tokenizer

TOKENIZER = build_tiny_tokenizer()
VOCAB = TokenVocab.from_tokenizer(TOKENIZER)
FUSED = toy_tokenizer(['"]}}', '"]},', '"]}', "}}", "},", ' "', '{"', '":', '",', "object_", "desc"])
JSONISH = FUSED.ids(*'{}[]:, "x\\', '"]}}', '"]},', "},", ' "', '{"', '":', "object_", "desc", "<|coord_1|>")
SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


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


@SETTINGS
@given(st.lists(st.integers(min_value=-3, max_value=len(VOCAB.token_bytes) + 3), max_size=120))
def test_random_token_ids_never_raise(ids: list[int]) -> None:
    parse_checked(ids, VOCAB)


@SETTINGS
@given(st.lists(st.sampled_from(JSONISH), max_size=150))
def test_random_json_like_tokens_never_raise(ids: list[int]) -> None:
    parse_checked([FUSED.encode("{")[0], *ids], FUSED.vocab)


MUTATION = st.tuples(
    st.sampled_from(["delete", "insert", "replace", "swap", "truncate"]),
    st.integers(min_value=0, max_value=10**6),
    st.integers(min_value=0, max_value=len(VOCAB.token_bytes) - 1),
)


@SETTINGS
@given(seed=st.integers(min_value=0, max_value=10**6), mutations=st.lists(MUTATION, min_size=1, max_size=6))
def test_mutated_valid_outputs_never_raise(seed: int, mutations: list[tuple[str, int, int]]) -> None:
    rng = random.Random(seed)
    ids = TOKENIZER.encode(serialize_objects(random_objects(rng)), add_special_tokens=False)
    structural = TOKENIZER.encode('{}[]:, "', add_special_tokens=False) + list(VOCAB.coords.ids[:3])
    for op, where, token in mutations:
        at = where % (len(ids) + 1)
        if rng.random() < 0.7:  # mostly JSON-ish tokens, which reach deeper into the scanner
            token = structural[token % len(structural)]
        if op == "delete" and at < len(ids):
            del ids[at]
        elif op == "insert":
            ids.insert(at, token)
        elif op == "replace" and at < len(ids):
            ids[at] = token
        elif op == "swap" and at + 1 < len(ids):
            ids[at], ids[at + 1] = ids[at + 1], ids[at]
        elif op == "truncate":
            ids = ids[:at]
    parse_checked(ids, VOCAB)
