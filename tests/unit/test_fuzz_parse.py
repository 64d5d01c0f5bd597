"""Fuzzing `parse_rollout` from text: model-like outputs written as text (JSON fragments, coordinate
tokens, multi-byte characters, stray quotes and escapes) and encoded by the real tiny BPE tokenizer,
so the parser sees the fused and byte-level tokens a model really emits. Extends
`test_detection_parse_fuzz.py` (random ids, toy-tokenizer JSON, token mutations) and reuses its
checker (`tests/unit/helpers.py`): parse_rollout never raises and its result is always consistent and usable.

Examples per property: 300 under `STAGECTL_FUZZ_PROFILE=full`, a tenth (at least 20) by default
(`tests.helpers.fuzz_examples`); `STAGECTL_FUZZ_EXAMPLES=5000` for a longer run.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stagectl.detection.vocab import TokenVocab
from stagectl.models.tokenizer import build_tiny_tokenizer
from tests.helpers import fuzz_examples
from tests.unit.helpers import parse_checked

SETTINGS = settings(
    max_examples=fuzz_examples(300),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TOKENIZER = build_tiny_tokenizer()
VOCAB = TokenVocab.from_tokenizer(TOKENIZER)
COORD = st.integers(-2, 1001).map(lambda n: f"<|coord_{n}|>")
FRAGMENTS = st.one_of(
    st.sampled_from(
        [
            "{",
            "}",
            '{"object_1": {"desc": "red circle", "bbox_2d": [',
            '"object_',
            '"desc": "',
            '", "bbox_2d": [',
            "]}",
            "]}, ",
            "}}",
            '"',
            "\\",
            '\\"',
            "\\u00e9",
            "\\ud800",
            ", ",
            ":",
            "[",
            "]",
            "null",
            "1e999",
            "<|im_end|>",
            "<|endoftext|>",
            "<|image_pad|>",
            "红色圆形",
            "é",
            "\U0001f600",
            "\n",
        ]
    ),
    COORD,
    st.integers(-5, 10**6).map(str),
    st.text(max_size=6),
)
TEXTS = st.lists(FRAGMENTS, max_size=40).map("".join)


@SETTINGS
@given(text=TEXTS)
def test_model_like_text_never_raises(text: str) -> None:
    parse_checked(TOKENIZER.encode(text, add_special_tokens=False), VOCAB)


@SETTINGS
@given(text=TEXTS, cut=st.integers(0, 200))
def test_truncated_model_like_text_never_raises(text: str, cut: int) -> None:
    ids = TOKENIZER.encode('{"object_1": {"desc": "' + text, add_special_tokens=False)
    parse_checked(ids[: cut % (len(ids) + 1)], VOCAB)
