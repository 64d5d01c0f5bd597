"""Serialize GT -> tokenize with the tiny tokenizer -> parse recovers every object exactly."""

from __future__ import annotations

import random

from stagectl.detection.coords import CoordTokenIds
from stagectl.detection.parse import STOP_CLOSED, parse_rollout
from stagectl.detection.serialize import serialize_objects, sort_objects
from stagectl.detection.vocab import TokenVocab
from stagectl.models.tokenizer import build_tiny_tokenizer
from tests.unit.helpers import Obj, random_objects


def test_real_tokenizer_round_trip_of_1000_random_answers() -> None:
    tokenizer = build_tiny_tokenizer()
    vocab = TokenVocab.from_tokenizer(tokenizer)
    rng = random.Random(0)
    for k in range(1000):
        objects = sort_objects(random_objects(rng))
        if k % 10 == 0 and objects:  # now and then a desc that needs escaping
            objects[0] = Obj('a "quoted" {brace} \\ desc', objects[0].bbox_2d)
            objects = sort_objects(objects)
        text = serialize_objects(objects)
        ids = tokenizer.encode(text, add_special_tokens=False)
        result = parse_rollout([*ids, vocab.end_of_turn_id], tokenizer if k % 2 else vocab)
        assert [(o.desc, o.bbox_2d) for o in result.valid_objects] == [(o.desc, o.bbox_2d) for o in objects]
        assert [o.key_index for o in result.valid_objects] == list(range(1, len(objects) + 1))
        assert result.dropped_by_reason == {} and result.stop_reason == STOP_CLOSED
        assert tokenizer.decode(result.prefix_token_ids) == text[:-1]


def test_vocab_from_the_tiny_tokenizer() -> None:
    tokenizer = build_tiny_tokenizer()
    vocab = TokenVocab.from_tokenizer(tokenizer)
    assert vocab.end_of_turn_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert vocab.stop_ids == {vocab.end_of_turn_id, tokenizer.convert_tokens_to_ids("<|endoftext|>")}
    assert vocab.coords.ids[0] == tokenizer.convert_tokens_to_ids("<|coord_0|>")
    assert vocab.coords.ids[999] == tokenizer.convert_tokens_to_ids("<|coord_999|>")
    assert vocab.coords.bin_of_id[vocab.coords.ids[123]] == 123
    assert CoordTokenIds.from_tokenizer(tokenizer) == vocab.coords
    added = set(tokenizer.added_tokens_decoder)
    for raw in (b'"]}', b"}", b"{", b'red square"]}', "红".encode()):
        ids = vocab.encode_bytes(raw)
        assert b"".join(vocab.token_bytes[t] for t in ids) == raw and not added & set(ids)
