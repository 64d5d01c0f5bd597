"""swift's `/infer/` request fields (accepted, null = default, unhonourable values refused by name, typos
still refused) and both answer shapes read back (pure: no server; the real ms-swift package is exercised
in tests/interop)."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from stagectl.inference.requests import read_answer_item, to_generation
from stagectl.server.swift_fields import refusals
from stagectl.wire.protocol import InferBody, InferResponse, RequestConfig, RolloutItem

# What ms-swift 4.6.0's VLLMInferClient posts for `RolloutInferRequest(messages=...)` and a default
# `RequestConfig()`: `asdict` of its dataclasses, nulls included.
SWIFT_REQUEST = {
    "messages": [{"role": "user", "content": "hi"}],
    "images": [],
    "audios": [],
    "videos": [],
    "tools": None,
    "objects": {},
    "chat_template_kwargs": {},
    "data_dict": {},
    "uuid": None,
    "add_eos": None,
}
SWIFT_CONFIG = {
    "max_tokens": None,
    "temperature": None,
    "top_k": None,
    "top_p": None,
    "min_p": None,
    "repetition_penalty": None,
    "num_beams": 1,
    "stop": [],
    "seed": None,
    "stream": False,
    "logprobs": False,
    "top_logprobs": None,
    "prompt_logprobs": None,
    "n": 1,
    "best_of": None,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "length_penalty": 1.0,
    "return_details": False,
    "structured_outputs_regex": None,
}


def _swift_body(
    request: dict[str, Any] | None = None, config: dict[str, Any] | None = None
) -> dict[str, Any]:
    return {
        "infer_requests": [{**SWIFT_REQUEST, **(request or {})}],
        "request_config": {**SWIFT_CONFIG, **(config or {})},
        "metrics": None,
        "use_tqdm": False,
        "adapter_request": None,
    }


def test_swift_default_payload_is_accepted_and_nulls_mean_our_defaults() -> None:
    body = InferBody.model_validate(_swift_body())
    assert refusals(body) == []
    assert body.request_config.sampling() == RequestConfig().sampling()
    assert body.request_config.stop == [] and body.request_config.seed is None


def test_null_stop_and_sampling_values_are_defaults() -> None:
    config = RequestConfig.model_validate({"stop": None, "top_p": None, "max_tokens": None})
    assert (config.stop, config.top_p, config.max_tokens) == ([], 1.0, 256)


@pytest.mark.parametrize(
    ("where", "value"),
    [
        ("request_config", {"temprature": 0.5}),
        ("request_config", {"num_beam": 1}),
        ("request_config", {"typo": None}),  # a null does not make an unknown name acceptable
        ("request", {"audio": []}),
        ("body", {"use_tqmd": False}),
    ],
)
def test_unknown_names_still_fail(where: str, value: dict[str, Any]) -> None:
    body = _swift_body(request=value) if where == "request" else _swift_body(config=value)
    if where == "body":
        body.update(value)
    with pytest.raises(ValidationError, match=next(iter(value))):
        InferBody.model_validate(body)


@pytest.mark.parametrize(
    ("field", "request_fields", "config"),
    [
        ("request_config.n", None, {"n": 4}),
        ("request_config.best_of", None, {"best_of": 4}),
        ("request_config.num_beams", None, {"num_beams": 4}),
        ("request_config.length_penalty", None, {"length_penalty": 2.0}),
        ("request_config.stream", None, {"stream": True}),
        ("request_config.min_p", None, {"min_p": 0.05}),
        ("request_config.presence_penalty", None, {"presence_penalty": 0.1}),
        ("request_config.frequency_penalty", None, {"frequency_penalty": 0.1}),
        ("request_config.top_logprobs", None, {"top_logprobs": 5}),
        ("request_config.prompt_logprobs", None, {"prompt_logprobs": 0}),
        ("request_config.structured_outputs_regex", None, {"structured_outputs_regex": ".*"}),
        ("infer_requests[0].audios", {"audios": ["x.wav"]}, None),
        ("infer_requests[0].videos", {"videos": ["x.mp4"]}, None),
        ("infer_requests[0].tools", {"tools": [{"type": "function"}]}, None),
        ("infer_requests[0].objects", {"objects": {"ref": ["cat"]}}, None),
        ("infer_requests[0].chat_template_kwargs", {"chat_template_kwargs": {"x": 1}}, None),
        ("infer_requests[0].data_dict", {"data_dict": {"solution": "1"}}, None),
        ("infer_requests[0].add_eos", {"add_eos": "auto"}, None),
    ],
)
def test_unhonourable_values_are_refused_by_name(
    field: str, request_fields: dict[str, Any] | None, config: dict[str, Any] | None
) -> None:
    (line,) = refusals(InferBody.model_validate(_swift_body(request_fields, config)))
    assert line.startswith(f"{field}=") and "cannot be honoured" in line


@pytest.mark.parametrize(
    "extra", [{"use_tqdm": True}, {"metrics": [{"name": "acc"}]}, {"adapter_request": {"name": "a"}}]
)
def test_top_level_fields_refused_by_name(extra: dict[str, Any]) -> None:
    (line,) = refusals(InferBody.model_validate({**_swift_body(), **extra}))
    assert line.startswith(f"{next(iter(extra))}=")


def test_every_refusal_is_listed_at_once() -> None:
    body = InferBody.model_validate(_swift_body({"videos": ["v"]}, {"num_beams": 2, "top_logprobs": 3}))
    assert len(refusals(body)) == 3


CHOICE = {"index": 0, "message": {"role": "assistant", "content": "x"}, "finish_reason": "length"}
USAGE = {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}


def test_read_rollout_output_shape_with_weight_version() -> None:
    item = {
        "response": {"model": "m", "choices": [{**CHOICE, "token_ids": [4, 5]}], "usage": USAGE},
        "response_token_ids": [[4, 5]],
        "rollout_infos": {"weight_version": 7},
    }
    response = read_answer_item(item)
    assert response.version == 7 and to_generation(response).token_ids == [4, 5]
    assert to_generation(response).finish_reason == "length"


def test_read_swift_rollout_token_ids_from_response_token_ids_and_no_version() -> None:
    item = {"response": {"model": "m", "choices": [CHOICE], "usage": USAGE}, "response_token_ids": [4, 5]}
    response = read_answer_item(item)  # swift wraps a flat list into one turn; so do we (pydantic)
    assert response.version is None and to_generation(response).token_ids == [4, 5]


def test_read_flat_chat_completion_shape() -> None:
    response = read_answer_item({"model": "m", "choices": [{**CHOICE, "token_ids": [1]}], "usage": USAGE})
    assert response.version is None and response.choices[0].token_ids == [1]


def test_read_refuses_multi_turn_and_a_bad_version() -> None:
    base = {"response": {"model": "m", "choices": [CHOICE]}}
    with pytest.raises(ValueError, match="multi-turn"):
        read_answer_item({**base, "response_token_ids": [[1], [2]]})
    with pytest.raises(ValueError, match="weight_version"):
        read_answer_item({**base, "rollout_infos": {"weight_version": "7"}})


def test_version_is_never_serialised_inside_the_response() -> None:
    response = InferResponse.model_validate({"choices": [CHOICE], "version": 3})
    assert response.version == 3 and "version" not in response.model_dump()


def test_our_wire_item_round_trips_through_our_reader() -> None:
    logprobs = {"content": [{"token": "a", "logprob": -0.5}, {"token": "b", "logprob": -1.0}]}
    ours = InferResponse.model_validate(
        {"choices": [{**CHOICE, "token_ids": [97, 98], "logprobs": logprobs}], "version": 4}
    )
    wire = RolloutItem.of(ours).model_dump(mode="json")
    assert "version" not in wire["response"] and wire["rollout_infos"] == {"weight_version": 4}
    assert wire["response_token_ids"] == [[97, 98]] and wire["rollout_logprobs"] == [[-0.5, -1.0]]
    back = read_answer_item(wire)
    assert back.version == 4 and to_generation(back).logprobs == [-0.5, -1.0]
