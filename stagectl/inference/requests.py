"""Pure helpers around the wire models: building detection requests and request configs, reading
`/infer/` answers (stagectl's or a swift server's, both shapes) and token ids out of them, and the chunk
arithmetic of the client (contiguous parts, seed offsets)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from stagectl.config.sampling import SamplingSpec
from stagectl.data.sample import DetectionSample
from stagectl.models.corpus import DETECTION_INSTRUCTION
from stagectl.models.generate import Generation
from stagectl.wire.protocol import (
    IMAGE_TAG,
    WEIGHT_VERSION_KEY,
    ContentItem,
    InferRequest,
    InferResponse,
    Message,
    RequestConfig,
    RolloutItem,
)


def detection_request(image_paths: Sequence[str | Path], instruction: str) -> InferRequest:
    """The swift-style request for one detection prompt: `<image>` per image, then the instruction.
    Paths are made absolute (the server resolves them against its `image_roots`)."""
    content = IMAGE_TAG * len(image_paths) + instruction
    return InferRequest(
        messages=[Message(role="user", content=content)],
        images=[str(Path(p).expanduser().absolute()) for p in image_paths],
    )


def detection_infer_request(sample: DetectionSample) -> InferRequest:
    """The server request for one sample's detection prompt: its images, then the instruction (the
    same prompt the learner encodes in process)."""
    content = [ContentItem(type="image") for _ in sample.images]
    content.append(ContentItem(type="text", text=DETECTION_INSTRUCTION))
    return InferRequest(messages=[Message(role="user", content=content)], images=list(sample.images))


def request_config(spec: SamplingSpec, seed: int | None) -> RequestConfig:
    """`spec` (Channel-B's sampling) as a request config that always returns token ids."""
    return RequestConfig.from_sampling(spec, seed, return_details=True)


def read_answer_item(item: Any) -> InferResponse:
    """One `/infer/` answer item as the learner reads it. Two shapes, as swift's own client reads them:
    swift's `RolloutOutput` (`{"response": {...}, "response_token_ids": [[...]], "rollout_infos": {...}}`:
    stagectl's and `swift rollout` servers) or a bare `ChatCompletionResponse` (`swift deploy`). The
    weight version comes from `rollout_infos.weight_version` (None from a swift server); token ids from
    `choices[0].token_ids`, else from the one turn of `response_token_ids`. Raises pydantic's
    `ValidationError` or `ValueError` on anything else."""
    if not (isinstance(item, dict) and "response" in item):
        return InferResponse.model_validate(item)
    rollout = RolloutItem.model_validate(item)
    response = rollout.response
    if len(rollout.response_token_ids) > 1:
        raise ValueError(
            f"a multi-turn rollout ({len(rollout.response_token_ids)} turns of response_token_ids): "
            "stagectl trains single-turn detection rollouts only"
        )
    choice = response.choices[0]
    if choice.token_ids is None and rollout.response_token_ids:
        choice = choice.model_copy(update={"token_ids": rollout.response_token_ids[0]})
    version = rollout.rollout_infos.get(WEIGHT_VERSION_KEY)
    if version is not None and not isinstance(version, int):
        raise ValueError(f"rollout_infos.{WEIGHT_VERSION_KEY} is {version!r}, not an integer")
    return response.model_copy(update={"choices": [choice, *response.choices[1:]], "version": version})


def to_generation(response: InferResponse) -> Generation:
    """The learner's view of one response: generated token ids and why generation ended."""
    choice = response.choices[0]
    if choice.token_ids is None:
        raise ValueError("the response has no token_ids: send request_config.return_details=true")
    logprobs = None
    if choice.logprobs is not None:
        logprobs = [entry.logprob for entry in choice.logprobs.content]
        if len(logprobs) != len(choice.token_ids):
            raise ValueError(
                f"the response has {len(logprobs)} logprobs for {len(choice.token_ids)} token_ids; "
                "they must be aligned (one per generated token)"
            )
    return Generation(
        token_ids=list(choice.token_ids),
        finish_reason="length" if choice.finish_reason == "length" else "stop",
        logprobs=logprobs,
    )


def contiguous_parts(n: int, num_parts: int) -> list[tuple[int, int]]:
    """[start, stop) of `num_parts` contiguous parts of `n` items, sizes differing by at most one,
    larger parts first; empty parts are left out."""
    base, extra = divmod(n, num_parts)
    parts, start = [], 0
    for k in range(num_parts):
        size = base + (1 if k < extra else 0)
        if size:
            parts.append((start, start + size))
        start += size
    return parts


def with_seed_offset(config: RequestConfig, offset: int) -> RequestConfig:
    """`config` for a piece that starts `offset` requests into a call: its request i keeps seed base + offset + i."""
    if config.seed is None or offset == 0:
        return config
    return config.model_copy(update={"seed": config.seed + offset})
