"""The wire contract of the rollout server, shared by the server (`rollout.app`) and the client.

Inference follows the `swift rollout` contract, so the learner can also be pointed at a swift
server: `GET /health/`, `GET /get_world_size/`, `POST /infer/` with `InferBody` -> a list of
`InferResponse`. stagectl's own server adds `GET /version/`, `GET /stats/` and the weight endpoints:

- `POST /update_weights/?sync_id=&chunk_index=&digest=&version=[&base_version=]` with a raw safetensors
  body (one chunk, `application/octet-stream`, streamed; `digest` is its XXH3-128 in hex); chunks are
  sent in order 0, 1, 2, ... A delta names `base_version`: a server not serving it answers 409.
- `POST /update_weights/commit/` with `CommitBody`; `POST /update_weights/abort/` with `AbortBody`.
- `POST /update_weights/from_disk/` with `DiskSyncBody` (a snapshot under an allowed directory).
- `POST /update_weights/from_shm/` with `ShmSyncBody` (a `/dev/shm/stagectl-<pid>-<id>.safetensors` snapshot).

Seeds: request `i` of one `/infer/` call is sampled with `request_config.seed + i` (when a seed is
given), so a request keeps its seed when the client retries or splits a chunk (it sends each half
with the seed shifted by the half's offset) and a rollout is reproducible from the logged base seed.

Requests are strict (`extra="forbid"`: a typo is a 422 naming the key); responses tolerate extra
fields because a swift server sends more than stagectl reads. No pickle anywhere: JSON and
safetensors only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from stagectl.models.sampling import SamplingSpec

IMAGE_TAG = "<image>"
LISTENING_PREFIX = "rollout-server: listening on "  # + base URL, printed once the socket listens


WEIGHT_CHUNK_PATH = "/update_weights/"  # one weight chunk: POST, on the app port or the weight-stream port


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Response(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ContentItem(_Request):
    """One part of a multimodal message: `{"type": "image"}` (the next entry of `images`) or text."""

    type: Literal["text", "image"]
    text: str | None = None


class Message(_Request):
    role: Literal["system", "user", "assistant"]
    content: str | list[ContentItem]
    """A string (each `<image>` tag takes the next entry of `images`, as in swift) or a list of items."""


class InferRequest(_Request):
    messages: list[Message] = Field(min_length=1)
    images: list[str] = Field(default_factory=list)
    """Image paths (under the server's `image_roots`) or inline `data:image/...;base64,` URLs, in order."""


class RequestConfig(_Request):
    max_tokens: int = Field(256, ge=1)
    temperature: float = Field(1.0, ge=0)
    """0 decodes greedily."""
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int | None = None
    """None, 0 or -1 disable top-k."""
    repetition_penalty: float = Field(1.0, gt=0)
    seed: int | None = Field(None, ge=0)
    """Base seed: request i of the call samples with seed + i."""
    stop: list[str] = Field(default_factory=list)
    """Stop strings; the text is cut before the first one, token ids end with the token completing it."""
    return_details: bool = False
    """Return `prompt_token_ids` and `choices[0].token_ids` (the learner always asks for them)."""
    logprobs: bool = False
    """Return `choices[0].logprobs`: per generated token, the log-probability of the chosen token under
    the model's own distribution (before temperature, top-k/top-p and repetition penalty), aligned with
    `choices[0].token_ids` (OpenAI's / swift's field; no alternatives: `top_logprobs` is always empty)."""
    n: int = Field(1, ge=1, le=1)
    """Completions per request: stagectl's server generates exactly one."""
    stream: Literal[False] = False

    @classmethod
    def from_sampling(
        cls, spec: SamplingSpec, seed: int | None, *, return_details: bool = False
    ) -> RequestConfig:
        return cls(
            max_tokens=spec.max_new_tokens,
            temperature=spec.temperature,
            top_p=spec.top_p,
            top_k=spec.top_k,
            repetition_penalty=spec.repetition_penalty,
            stop=list(spec.stop),
            seed=seed,
            return_details=return_details,
            logprobs=spec.logprobs,
        )

    def sampling(self) -> SamplingSpec:
        return SamplingSpec(
            max_new_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k if self.top_k is not None and self.top_k > 0 else 0,
            repetition_penalty=self.repetition_penalty,
            stop=tuple(self.stop),
            logprobs=self.logprobs,
        )


class InferBody(_Request):
    infer_requests: list[InferRequest]
    request_config: RequestConfig = Field(default_factory=RequestConfig)


class ChatMessage(_Response):
    role: str = "assistant"
    content: str


class TokenLogprob(_Response):
    """One generated token and its log-probability (OpenAI's / swift's `logprobs.content[i]`)."""

    token: str
    logprob: float
    bytes: list[int] | None = None
    """The token's exact bytes (a byte-level token may be part of a UTF-8 character)."""
    top_logprobs: list[dict[str, Any]] = Field(default_factory=list)
    """Alternatives: stagectl's server sends none."""


class ChoiceLogprobs(_Response):
    content: list[TokenLogprob] = Field(default_factory=list)
    """One entry per generated token, aligned with `Choice.token_ids`."""


class Choice(_Response):
    index: int = 0
    message: ChatMessage
    finish_reason: str | None = None
    """`stop` (a stop token or string ended it) or `length` (max_tokens reached)."""
    token_ids: list[int] | None = None
    logprobs: ChoiceLogprobs | None = None
    """Present when the request asked for `request_config.logprobs`."""


class Usage(_Response):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class InferResponse(_Response):
    model: str = ""
    choices: list[Choice] = Field(min_length=1)
    usage: Usage = Field(default_factory=Usage)
    prompt_token_ids: list[int] | None = None
    version: int | None = None
    """stagectl's server: the weight version that generated this response (absent from swift)."""


class HealthResponse(_Response):
    status: str = "ok"


class WorldSizeResponse(_Response):
    world_size: int


class VersionResponse(_Response):
    version: int
    model: str
    engine: str = ""
    weight_stream_port: int | None = None
    """The port of the weight-stream listener (same host; `POST /update_weights/` there); None: send
    weight chunks to this port."""


class CommitBody(_Request):
    sync_id: str = Field(min_length=1, max_length=128)
    version: int = Field(ge=0)
    """Target version; must be above the serving version."""
    num_chunks: int = Field(ge=1)


class AbortBody(_Request):
    sync_id: str = Field(min_length=1, max_length=128)


class GroupInitBody(_Request):
    """`transport: collective`: join the learner's weight group (see `rollout.collective`)."""

    master_address: str = Field(min_length=1, max_length=256)
    master_port: int = Field(ge=1, le=65535)
    rank: int = Field(ge=1)
    world_size: int = Field(ge=2)
    timeout_s: float = Field(gt=0, le=3600)


class GroupTensor(_Request):
    name: str = Field(min_length=1)
    dtype: str = Field(min_length=1, max_length=32)
    shape: list[int]


class GroupStartBody(_Request):
    """A collective sync: the tensors rank 0 is about to broadcast, in that order (checked against the
    model before a byte moves)."""

    sync_id: str = Field(min_length=1, max_length=128)
    version: int = Field(ge=0)
    tensors: list[GroupTensor] = Field(min_length=1)


class GroupFinishBody(_Request):
    sync_id: str = Field(min_length=1, max_length=128)
    version: int = Field(ge=0)


class DiskSyncBody(_Request):
    path: str
    """A `.safetensors` snapshot under one of the server's weight directories."""
    version: int = Field(ge=0)


class ShmSyncBody(_Request):
    path: str
    """`/dev/shm/stagectl-<pid>-<id>.safetensors`, written by a learner on this node."""
    version: int = Field(ge=0)
    digest: str = Field(pattern=r"^[0-9a-fA-F]{32}$")
    """XXH3-128 of the whole file, hex."""


class ChunkResponse(_Response):
    sync_id: str
    chunk_index: int
    num_tensors: int


class SyncResponse(_Response):
    version: int
    num_tensors: int
    num_bytes: int
    apply_s: float
    """Seconds the swap held the generation lock."""


class StatsResponse(_Response):
    version: int
    num_requests: int
    num_batches: int
    batch_sizes: dict[str, int]
    """Histogram of generate batch sizes: `{"1": 3, "8": 2}` (keys are sizes as strings, JSON style)."""
    num_syncs: int
    num_failed_syncs: int


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of one weight tensor, as a weight sync names and checks it."""

    shape: tuple[int, ...]
    dtype: str  # torch dtype name without the prefix: "float32", "bfloat16", ...

    @property
    def num_elements(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count


def read_token(env_name: str | None, key: str) -> str | None:
    """The bearer token held by environment variable `env_name` (None when no variable is configured)."""
    if env_name is None:
        return None
    token = os.environ.get(env_name, "").strip()
    if not token:
        raise ValueError(f"{key} names ${env_name}, which is unset or empty; export the token there")
    return token
