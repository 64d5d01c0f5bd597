"""swift's `/infer/` fields that stagectl's server accepts only at their defaults, and the check that
refuses any other value by name (HTTP 400), so that nothing swift's client asks for is silently ignored.

Every field of swift's `RolloutInferRequest`, `RequestConfig` and `/infer/` body is accepted by the
models in `protocol.py` (null means the default). The sampling fields stagectl implements (`max_tokens`,
`temperature`, `top_p`, `top_k`, `repetition_penalty`, `seed`, `stop`, `return_details`, `logprobs`, `n` = 1, `uuid`)
are honoured; the fields below are not implemented, so a value other than their default is refused.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from stagectl.wire.protocol import InferBody, InferRequest, RequestConfig


def _empty(value: Any) -> bool:
    return value is None or value == [] or value == {}


# (field, is the value one stagectl honours?, why any other value is refused)
_BODY: list[tuple[str, Callable[[Any], bool], str]] = [
    ("metrics", _empty, "the server computes no client-side metrics"),
    ("use_tqdm", lambda v: not v, "the server shows no progress bar"),
    ("adapter_request", _empty, "stagectl serves one set of weights, no LoRA adapters by request"),
]
_CONFIG: list[tuple[str, Callable[[Any], bool], str]] = [
    ("n", lambda v: v == 1, "the server generates one completion per request; send 1"),
    ("best_of", lambda v: v in (None, 1), "the server generates one candidate per request; send null or 1"),
    ("num_beams", lambda v: v == 1, "no beam search; send 1"),
    ("length_penalty", lambda v: v == 1.0, "a beam-search setting; send 1.0"),
    ("stream", lambda v: not v, "answers are not streamed; send false"),
    ("min_p", lambda v: not v, "min-p sampling is not implemented; send null"),
    ("presence_penalty", lambda v: v == 0.0, "not implemented (use repetition_penalty); send 0"),
    ("frequency_penalty", lambda v: v == 0.0, "not implemented (use repetition_penalty); send 0"),
    ("top_logprobs", lambda v: not v, "no alternatives per token are returned; send null"),
    ("prompt_logprobs", lambda v: v is None, "prompt logprobs are not returned; send null"),
    ("structured_outputs_regex", lambda v: v is None, "guided decoding is not implemented; send null"),
]
_REQUEST: list[tuple[str, Callable[[Any], bool], str]] = [
    ("audios", _empty, "the server takes images and text only"),
    ("videos", _empty, "the server takes images and text only"),
    ("tools", _empty, "no agent/tool-call template"),
    ("objects", _empty, "no grounding objects in the template"),
    ("chat_template_kwargs", _empty, "the chat template takes no extra arguments"),
    ("data_dict", _empty, "no multi-turn scheduler reads it (swift's vllm_server_pass_dataset)"),
    ("add_eos", lambda v: v is None, "the server scores no completed responses"),
]


def _check(model: InferBody | RequestConfig | InferRequest, table: list, prefix: str) -> list[str]:
    problems = []
    for name, honoured, why in table:
        value = getattr(model, name)
        if not honoured(value):
            problems.append(f"{prefix}{name}={value!r} cannot be honoured: {why}")
    return problems


def refusals(body: InferBody) -> list[str]:
    """One line per field of `body` set to a value stagectl's server cannot honour (empty: serve it)."""
    problems = _check(body, _BODY, "")
    problems += _check(body.request_config, _CONFIG, "request_config.")
    for i, request in enumerate(body.infer_requests):
        problems += _check(request, _REQUEST, f"infer_requests[{i}].")
    return problems
