"""The tiny tokenizer recipe and the token -> bytes table shared with the detection parser.

`build_tiny_tokenizer` trains a small byte-level BPE (Qwen2's normaliser and pre-tokeniser) on the
built-in corpus, wraps it in transformers' `Qwen2Tokenizer` (the class real Qwen-VL checkpoints
load as, so a saved tiny tokenizer reloads exactly), then adds the Qwen special tokens and the
1000 coordinate tokens. Ids are laid out as: trained byte-level vocab, then special tokens, then
`<|coord_0|>`..`<|coord_999|>`; the build is deterministic.

`token_bytes_table` (defined in `stagectl.detection.vocab`, re-exported here) gives, for every token
id, the exact bytes the token stands for.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from functools import cache

from tokenizers import AddedToken, Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast
from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

from stagectl.detection.coords import NUM_BINS as NUM_COORD_BINS
from stagectl.detection.coords import coord_token
from stagectl.detection.vocab import token_bytes_table
from stagectl.models.corpus import corpus

BPE_VOCAB_SIZE = 1024
ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"
# Same names and order as the Qwen2-VL / Qwen2.5-VL tokenizers.
SPECIAL_TOKENS = (
    ENDOFTEXT,
    IM_START,
    IM_END,
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    VISION_START,
    VISION_END,
    "<|vision_pad|>",
    IMAGE_PAD,
    VIDEO_PAD,
)
# Qwen2's pre-tokenisation regex: digits split one by one, punctuation runs kept together.
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"""
    r"""\s+(?!\S)|\s+"""
)
_COORD_RE = re.compile(r"<\|coord_\d+\|>")

# Qwen2-VL's chat template (vision placeholders inside user content lists).
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _training_fragments() -> Iterator[str]:
    # Coordinate tokens are added tokens: at encode time they cut the text, so train on the pieces
    # between them rather than letting BPE learn merges for "<|coord_" that would never be used.
    for line in corpus():
        yield from (piece for piece in _COORD_RE.split(line) if piece)


def byte_level_pre_tokenizer(regex: str) -> pre_tokenizers.PreTokenizer:
    """Split with a GPT-style regex, then map bytes to the ByteLevel alphabet (Qwen2, Llama 3)."""
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def train_tiny_bpe(regex: str = QWEN2_PRETOKENIZE_REGEX) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Train a byte-level BPE (pre-tokenised by `regex`) on the built-in corpus; returns (vocab, merges).
    Deterministic."""
    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = byte_level_pre_tokenizer(regex)
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(_training_fragments(), trainer=trainer)
    merges = json.loads(bpe.to_str())["model"]["merges"]
    return bpe.get_vocab(with_added_tokens=False), [(a, b) for a, b in merges]


_train_tiny_bpe_once = cache(train_tiny_bpe)


def build_tiny_tokenizer(*, with_coord_tokens: bool = True) -> PreTrainedTokenizerFast:
    """Train (once per process) and return the tiny Qwen-style tokenizer; same ids on every build.

    `with_coord_tokens=False` leaves out the coordinate tokens, like a stock Qwen tokenizer.
    """
    vocab, merges = _train_tiny_bpe_once()
    tokenizer = Qwen2Tokenizer(
        vocab=dict(vocab),
        merges=list(merges),  # type: ignore[arg-type]  # tokenizers' BPE takes (left, right) pairs
        unk_token=None,  # type: ignore[arg-type]  # byte-level: nothing is unknown (as in real Qwen)
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        clean_up_tokenization_spaces=False,
        model_max_length=32768,
        extra_special_tokens={"image_token": IMAGE_PAD, "video_token": VIDEO_PAD},
    )
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    if with_coord_tokens:
        add_coord_tokens(tokenizer)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def token_id(tokenizer: PreTrainedTokenizerBase, token: str) -> int:
    """The id of one whole token (special or added); `ValueError` if the tokenizer does not have it."""
    found = tokenizer.convert_tokens_to_ids(token)
    if not isinstance(found, int) or found == tokenizer.unk_token_id:
        raise ValueError(f"tokenizer has no token {token!r}")
    return found


def coord_token_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Ids of `<|coord_0|>`..`<|coord_999|>` in bin order; `ValueError` if any is not a single token."""
    vocab = tokenizer.get_vocab()
    missing = [i for i in range(NUM_COORD_BINS) if coord_token(i) not in vocab]
    if missing:
        first = coord_token(missing[0])
        raise ValueError(f"tokenizer lacks {len(missing)} coordinate tokens (first missing: {first})")
    return [vocab[coord_token(i)] for i in range(NUM_COORD_BINS)]


def add_coord_tokens(tokenizer: PreTrainedTokenizerBase) -> int:
    """Add any missing coordinate tokens (not special, so they survive decode); returns how many."""
    return tokenizer.add_tokens(
        [AddedToken(coord_token(i), special=False, normalized=False) for i in range(NUM_COORD_BINS)]
    )


__all__ = [
    "CHAT_TEMPLATE",
    "NUM_COORD_BINS",
    "SPECIAL_TOKENS",
    "add_coord_tokens",
    "build_tiny_tokenizer",
    "coord_token",
    "coord_token_ids",
    "token_bytes_table",
    "token_id",
    "train_tiny_bpe",
]
