"""The `/infer/` request models: values no engine can serve are a 422 naming the field, before any request
of the call reaches a generate batch it would share with other callers."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from stagectl.wire.protocol import MAX_SEED, InferBody, RequestConfig

ONE_REQUEST = [{"messages": [{"role": "user", "content": "hi"}]}]


@pytest.mark.parametrize(
    ("config", "field"),
    [
        ({"seed": 2**70}, "request_config.seed"),  # torch's generator raised inside the shared batch
        ({"seed": MAX_SEED + 1}, "request_config.seed"),
        ({"stop": ["</s>", ""]}, "request_config.stop.1"),  # "" ended every generation after one token
        # the hf engine builds its stop-string matcher per call in time ~ their total length: one 1 MB stop
        # string (or 100,000 short ones) held the engine, and every other caller, for minutes
        ({"stop": [f"s{i}" for i in range(17)]}, "request_config.stop"),  # at most 16
        ({"stop": ["</s>", "x" * 257]}, "request_config.stop.1"),  # at most 256 characters
        ({"temperature": float("inf")}, "request_config.temperature"),
        ({"repetition_penalty": float("inf")}, "request_config.repetition_penalty"),
        ({"top_p": float("nan")}, "request_config.top_p"),
    ],
)
def test_unservable_sampling_values_are_refused_naming_the_field(config: dict, field: str) -> None:
    body = json.dumps({"infer_requests": ONE_REQUEST, "request_config": config})  # `Infinity`, `NaN`
    with pytest.raises(ValidationError) as raised:
        InferBody.model_validate(json.loads(body))  # as FastAPI reads a body (Python's JSON reader)
    assert [".".join(map(str, e["loc"])) for e in raised.value.errors()] == [field]


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        ({"messages": [{"role": "user", "content": "red \ud83d"}]}, "infer_requests.0.messages.0.content"),
        (
            {"messages": [{"role": "system", "content": "\udc80"}, {"role": "user", "content": "hi"}]},
            "infer_requests.0.messages.0.content",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]},
            "infer_requests.0.messages.0.content.list[ContentItem].0.text",
        ),
        (
            {"messages": [{"role": "user", "content": "<image>"}], "images": ["a.png", "b\ud800.png"]},
            "infer_requests.0.images",
        ),
    ],
)
def test_a_lone_surrogate_in_any_request_string_is_refused_naming_the_field(
    request_: dict[str, Any], field: str
) -> None:
    """`\\ud83d` without its pair is valid JSON but not text. pydantic's `str` let it through (a field without a
    length bound), and the hf engine's tokenizer then failed the call with a 500 and a traceback."""
    body = json.dumps({"infer_requests": [request_]})  # the surrogate as the escape a client sends
    assert "\\ud" in body
    with pytest.raises(ValidationError) as raised:
        InferBody.model_validate(json.loads(body))  # as FastAPI reads a body (Python's JSON reader)
    errors = {".".join(map(str, e["loc"])): e["msg"] for e in raised.value.errors()}
    assert "holds a lone surrogate escape" in errors[field]


def test_a_surrogate_pair_is_one_character_and_served() -> None:
    body = json.dumps({"infer_requests": [{"messages": [{"role": "user", "content": "red \U0001f600"}]}]})
    assert "\\ud83d\\ude00" in body  # the pair, as an ASCII-only JSON writer sends it
    assert (
        InferBody.model_validate(json.loads(body)).infer_requests[0].messages[0].content == "red \U0001f600"
    )


def test_the_largest_seed_and_real_stop_strings_are_served_as_sent() -> None:
    config = RequestConfig.model_validate({"seed": MAX_SEED, "stop": ["</s>", "\n\n"], "temperature": 0})
    assert config.seed == MAX_SEED and config.sampling().stop == ("</s>", "\n\n")
    most = ["x" * 256] * 16  # MAX_STOP_CHARS, MAX_STOP_STRINGS
    assert RequestConfig.model_validate({"stop": most}).sampling().stop == tuple(most)


def test_seeds_up_to_the_generators_limit_are_served_and_the_last_request_must_fit() -> None:
    """Seeds from 2**63 to 2**64 - 1 were served before the seed check, and torch's generators take them: the
    check refused them (its bound was 2**63 - 1). The call's last request samples with seed + n - 1."""
    body = InferBody.model_validate({"infer_requests": ONE_REQUEST * 3, "request_config": {"seed": 2**63}})
    assert body.request_config.seed == 2**63 == MAX_SEED // 2 + 1
    InferBody.model_validate({"infer_requests": ONE_REQUEST * 3, "request_config": {"seed": MAX_SEED - 2}})
    with pytest.raises(ValidationError, match=r"request_config.seed \d+ \+ 2 \(the call's last request\)"):
        InferBody.model_validate(
            {"infer_requests": ONE_REQUEST * 3, "request_config": {"seed": MAX_SEED - 1}}
        )
