"""Property tests: parse_rollout never raises, and what it returns is always consistent and usable."""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stagectl.detection.serialize import serialize_objects
from stagectl.detection.vocab import TokenVocab
from stagectl.models.tokenizer import build_tiny_tokenizer
from tests.helpers import fuzz_examples
from tests.unit.helpers import parse_checked, random_objects, toy_tokenizer

TOKENIZER = build_tiny_tokenizer()
VOCAB = TokenVocab.from_tokenizer(TOKENIZER)
FUSED = toy_tokenizer(['"]}}', '"]},', '"]}', "}}", "},", ' "', '{"', '":', '",', "object_", "desc"])
JSONISH = FUSED.ids(*'{}[]:, "x\\', '"]}}', '"]},', "},", ' "', '{"', '":', "object_", "desc", "<|coord_1|>")
SETTINGS = settings(
    max_examples=fuzz_examples(300), deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


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
