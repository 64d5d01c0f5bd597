"""The tiny tokenizer: determinism, coordinate tokens, round trips, and the token -> bytes table."""

from __future__ import annotations

import random

import pytest

from stagectl.models.tokenizer import (
    IM_END,
    IMAGE_PAD,
    NUM_COORD_BINS,
    SPECIAL_TOKENS,
    build_tiny_tokenizer,
    coord_token,
    coord_token_ids,
    token_bytes_table,
    train_tiny_bpe,
)

ANSWER = (
    '{"object_1": {"desc": "red circle", "bbox_2d": ["<|coord_12|>", "<|coord_34|>", "<|coord_256|>", '
    '"<|coord_480|>"]}, "object_2": {"desc": "blue square", "bbox_2d": ["<|coord_0|>", "<|coord_1|>", '
    '"<|coord_998|>", "<|coord_999|>"]}}'
)


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def test_training_is_deterministic() -> None:
    # Two independent trainings (fresh Rust hash maps each time) give the same vocab and merges.
    assert train_tiny_bpe() == train_tiny_bpe()


def test_size_and_layout(tok) -> None:
    assert 1000 + len(SPECIAL_TOKENS) + 256 < len(tok) < 3000
    ids = coord_token_ids(tok)
    assert ids == list(range(ids[0], ids[0] + NUM_COORD_BINS))  # contiguous, in bin order
    assert ids[-1] == len(tok) - 1
    for special in SPECIAL_TOKENS:
        assert len(tok.encode(special, add_special_tokens=False)) == 1
    assert tok.eos_token == IM_END
    assert tok.image_token == IMAGE_PAD


@pytest.mark.parametrize("bin_index", [0, 1, 7, 500, 998, 999])
def test_coord_tokens_are_single_non_special_ids(tok, bin_index: int) -> None:
    text = coord_token(bin_index)
    ids = tok.encode(f'["{text}", "{text}"]', add_special_tokens=False)
    assert ids.count(coord_token_ids(tok)[bin_index]) == 2
    # Not special: survives decode even when special tokens are skipped.
    assert tok.decode(ids, skip_special_tokens=True) == f'["{text}", "{text}"]'


def test_coord_token_rejects_out_of_range() -> None:
    with pytest.raises(ValueError, match="1000"):
        coord_token(1000)


def test_detection_answer_round_trip(tok) -> None:
    ids = tok.encode(ANSWER, add_special_tokens=False)
    assert tok.decode(ids) == ANSWER
    assert sum(1 for i in ids if i in set(coord_token_ids(tok))) == 8
    # The answer format is in the training corpus, so it should be compact (well under 1 token/char).
    assert len(ids) < len(ANSWER) / 3


@pytest.mark.parametrize(
    "text",
    [ANSWER, "Verdict: 通过\nReason: naïve ✓ émoji 🙂", "<|im_start|>user\nDetect.<|im_end|>\n", "  \t\n{}"],
)
def test_token_bytes_table_concatenates_to_utf8_of_decode(tok, text: str) -> None:
    table = token_bytes_table(tok)
    ids = tok.encode(text, add_special_tokens=False)
    assert b"".join(table[i] for i in ids) == tok.decode(ids).encode("utf-8") == text.encode("utf-8")


def test_token_bytes_table_covers_every_id(tok) -> None:
    table = token_bytes_table(tok, vocab_size=len(tok) + 10)
    assert len(table) == len(tok) + 10
    assert table[-10:] == [b""] * 10
    assert all(table[i] for i in range(len(tok)))  # no holes in the tiny tokenizer
    assert len({table[i] for i in range(256)}) >= 200  # the byte alphabet maps to distinct bytes
    # Random id sequences: wherever decode yields valid text, the table agrees byte for byte.
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randint(1, 12))]
        joined = b"".join(table[i] for i in ids)
        decoded = tok.decode(ids, skip_special_tokens=False)
        if "\ufffd" not in decoded:
            assert joined == decoded.encode("utf-8")
        else:
            assert joined.decode("utf-8", errors="replace") == decoded


def test_chat_template_places_vision_tokens(tok) -> None:
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Detect."}]}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Detect.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
