"""The wire contract of the rollout server's inference side, shared by the server (`server.app`)
and the client; the weight endpoints' bodies and answers are `weightsync.protocol`, built on this
module's `WireRequest` / `WireResponse`.

Inference follows the `swift rollout` contract (ms-swift 4.6.0's client is tested against it, see
docs/swift_interop.md): `GET /health/`, `GET /get_world_size/`, `POST /infer/` with `InferBody` -> a
list of `RolloutItem` (swift's `RolloutOutput`: an `InferResponse` plus the weight version in
`rollout_infos`). stagectl's own server adds `GET /version/` (`VersionResponse`), `GET /stats/`
(`StatsResponse`) and the weight endpoints (`weightsync.protocol`).

Seeds: request `i` of one `/infer/` call is sampled with `request_config.seed + i` (when a seed is
given), so a request keeps its seed when the client retries or splits a chunk (it sends each half
with the seed shifted by the half's offset) and a rollout is reproducible from the logged base seed.

Requests are strict (`extra="forbid"`: a typo is a 422 naming the key); the `/infer/` models take every
field swift's client sends, null meaning the default (`server.swift_fields` refuses, with a 400, the
values stagectl cannot honour). Responses tolerate extra fields because a swift server sends more than
stagectl reads. No pickle anywhere: JSON and safetensors only.

Also here, because the engine interface (`engines.interface`) names them and weight sync imports the rollout
leaves, never the reverse: `TensorSpec` (a weight tensor's shape and dtype) and `read_token`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from stagectl.config.sampling import SamplingSpec
from stagectl.wire.text import lone_surrogate_at

if TYPE_CHECKING:
    import torch

IMAGE_TAG = "<image>"
LISTENING_PREFIX = "rollout-server: listening on "  # + base URL, printed once the socket listens


# A request body: an unknown key is a 422 naming it, and so is a string that is not Unicode text.
class WireRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @field_validator("*")
    @classmethod
    def _unicode_text(cls, value: Any) -> Any:
        """A `\\ud83d` escape without its pair is valid JSON but not text: pydantic's `str` lets it through (unless
        the field has a length bound), and the tokenizer then failed the call with a 500 and a traceback."""
        found = lone_surrogate_at(value)
        if found is not None:
            raise ValueError(
                f"holds a lone surrogate escape (\\ud800-\\udfff) at {found}: not Unicode text (half of a "
                "UTF-16 pair?); send the text as UTF-8"
            )
        return value


class _SwiftRequest(WireRequest):
    """A model swift's client fills: `null` for a known field means its default (swift sends `top_p:
    null`, `stop: null`, ...); unknown names still fail. Fields stagectl cannot honour are accepted at
    their defaults and refused by name otherwise (`server.swift_fields`, a 400)."""

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None or k not in cls.model_fields}
        return data


# An answer: fields this side does not read are ignored (a swift server sends more than stagectl reads).
class WireResponse(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ContentItem(WireRequest):
    """One part of a multimodal message: `{"type": "image"}` (the next entry of `images`) or text."""

    type: Literal["text", "image"]
    text: str | None = None


class Message(WireRequest):
    role: Literal["system", "user", "assistant"]
    content: str | list[ContentItem]
    """A string (each `<image>` tag takes the next entry of `images`, as in swift) or a list of items."""


class InferRequest(_SwiftRequest):
    """One request, as swift's `RolloutInferRequest` (every field swift's client sends is accepted)."""

    messages: list[Message] = Field(min_length=1)
    images: list[str] = Field(default_factory=list)
    """Image paths (under the server's `image_roots`) or inline `data:image/...;base64,` URLs, in order."""
    audios: list[Any] = Field(default_factory=list)
    """swift's audio inputs: only `[]` (stagectl serves images and text)."""
    videos: list[Any] = Field(default_factory=list)
    """swift's video inputs: only `[]`."""
    tools: list[Any] | None = None
    """swift's agent tools: only null or `[]` (no tool-call template)."""
    objects: dict[str, Any] = Field(default_factory=dict)
    """swift's grounding objects for the template: only `{}`."""
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Extra chat-template arguments: only `{}` (stagectl's template takes none)."""
    data_dict: dict[str, Any] = Field(default_factory=dict)
    """swift's dataset passthrough for a multi-turn scheduler: only `{}` (stagectl's server has none)."""
    uuid: str | None = Field(None, max_length=256)
    """Request id: echoed as the response's `id` (swift uses it as the request id too)."""
    add_eos: bool | Literal["auto"] | None = None
    """swift's suffix policy for scoring completed responses: only null (stagectl scores nothing)."""


MAX_SEED = 2**64 - 1  # request i samples with seed + i: torch's generators take seeds below 2**64
# The hf engine builds transformers' stop-string matcher for every call, in time proportional to the stop strings'
# total length over the vocabulary (about 0.4 ms a character on a CPU with Qwen's): one 1 MB stop string held the
# engine, and so every other caller, for over five minutes. At most 16 x 256 characters: about 2 s.
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256


class RequestConfig(_SwiftRequest):
    """Sampling settings, as swift's `RequestConfig`; null means the default shown here. Numbers are finite
    (`NaN` / `Infinity`, which Python's JSON reader accepts, are a 422)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    max_tokens: int = Field(256, ge=1)
    temperature: float = Field(1.0, ge=0)
    """0 decodes greedily."""
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int | None = None
    """None, 0 or -1 disable top-k."""
    repetition_penalty: float = Field(1.0, gt=0)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    """Base seed: request i of the call samples with seed + i, which must stay below 2**64 (what torch's
    generators take: a larger seed failed the whole generate batch it was in, other callers' requests
    included)."""
    stop: list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]] = Field(
        default_factory=list, max_length=MAX_STOP_STRINGS
    )
    """Stop strings; the text is cut before the first one, token ids end with the token completing it. An
    empty string is refused (it would end every generation after one token), and so are more than
    `MAX_STOP_STRINGS` or one longer than `MAX_STOP_CHARS` characters (see there)."""
    return_details: bool = False
    """Return `prompt_token_ids` and `choices[0].token_ids` (the learner always asks for them)."""
    logprobs: bool = False
    """Return `choices[0].logprobs`: per generated token, the log-probability of the chosen token under
    the model's own distribution (before temperature, top-k/top-p and repetition penalty), aligned with
    `choices[0].token_ids` (OpenAI's / swift's field; no alternatives: `top_logprobs` is always empty)."""
    n: int = Field(1, ge=1)
    """Completions per request: stagectl's server generates exactly one (more is refused)."""
    stream: bool = False
    """Streaming answers: only false."""
    min_p: float | None = Field(None, ge=0, le=1)
    """Min-p sampling: only null or 0 (not implemented by stagectl's engines)."""
    num_beams: int = Field(1, ge=1)
    """Beam search: only 1."""
    top_logprobs: int | None = Field(None, ge=0)
    """Alternatives per token: only null or 0 (`logprobs.content[i].top_logprobs` is always empty)."""
    prompt_logprobs: int | None = Field(None, ge=0)
    """Prompt-token logprobs: only null."""
    best_of: int | None = Field(None, ge=1)
    """Candidates per request: only null or 1."""
    presence_penalty: float = 0.0
    """Only 0 (stagectl's engines apply `repetition_penalty` only)."""
    frequency_penalty: float = 0.0
    """Only 0."""
    length_penalty: float = 1.0
    """A beam-search setting: only 1."""
    structured_outputs_regex: str | None = None
    """Guided decoding: only null."""

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


class InferBody(_SwiftRequest):
    infer_requests: list[InferRequest]
    request_config: RequestConfig = Field(default_factory=RequestConfig)
    metrics: list[Any] | None = None
    """swift's client-side metric objects: only null or `[]` (the server computes none)."""
    use_tqdm: bool | None = None
    """A server-side progress bar: only null or false."""
    adapter_request: dict[str, Any] | None = None
    """A LoRA adapter to generate with: only null (stagectl serves one set of weights)."""
    weight_version: int | None = Field(None, ge=0)
    """stagectl's extension (swift sends none): answer with this weight version or refuse (409). A call
    tagged with the version serving now is admitted even while a committed sync waits to be swapped in
    (the swap waits for it); an older tag is refused. See `weightsync.gate`."""

    @model_validator(mode="after")
    def _last_seed_fits(self) -> InferBody:
        seed = self.request_config.seed
        if seed is not None and seed + len(self.infer_requests) - 1 > MAX_SEED:
            raise ValueError(
                f"request_config.seed {seed} + {len(self.infer_requests) - 1} (the call's last request) is above "
                f"{MAX_SEED}, the largest seed a generator takes"
            )
        return self


class ChatMessage(WireResponse):
    role: str = "assistant"
    content: str


class TokenLogprob(WireResponse):
    """One generated token and its log-probability (OpenAI's / swift's `logprobs.content[i]`)."""

    token: str
    logprob: float
    bytes: list[int] | None = None
    """The token's exact bytes (a byte-level token may be part of a UTF-8 character)."""
    top_logprobs: list[dict[str, Any]] = Field(default_factory=list)
    """Alternatives: stagectl's server sends none."""


class ChoiceLogprobs(WireResponse):
    content: list[TokenLogprob] = Field(default_factory=list)
    """One entry per generated token, aligned with `Choice.token_ids`."""


class Choice(WireResponse):
    index: int = 0
    message: ChatMessage
    finish_reason: str | None = None
    """`stop` (a stop token or string ended it) or `length` (max_tokens reached)."""
    token_ids: list[int] | None = None
    logprobs: ChoiceLogprobs | None = None
    """Present when the request asked for `request_config.logprobs`."""


class Usage(WireResponse):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class InferResponse(WireResponse):
    """swift's `ChatCompletionResponse`: what a swift deploy server answers per request, and the `response`
    of a `RolloutItem`."""

    model: str = ""
    choices: list[Choice] = Field(min_length=1)
    usage: Usage = Field(default_factory=Usage)
    id: str = ""
    object: str = "chat.completion"
    created: int = 0
    prompt_token_ids: list[int] | None = None
    version: int | None = Field(None, exclude=True)
    """The weight version that generated this response: read from `RolloutItem.rollout_infos` (stagectl's
    server; None from swift's). Never serialised here: swift's parser refuses an unknown top-level key."""


WEIGHT_VERSION_KEY = "weight_version"  # the key of the weight version in `RolloutItem.rollout_infos`


class RolloutItem(WireResponse):
    """One item of the `/infer/` answer in swift's `RolloutOutput` shape (what a `swift rollout` server
    answers, and what swift's client parses first); stagectl's server adds the weight version in
    `rollout_infos` (a free-form dict to swift). See docs/swift_interop.md."""

    @classmethod
    def of(cls, response: InferResponse) -> RolloutItem:
        """The wire item of one of stagectl's responses (token ids and logprobs also as swift's per-turn lists)."""
        choice = response.choices[0]
        logprobs = [] if choice.logprobs is None else [[e.logprob for e in choice.logprobs.content]]
        return cls(
            response=response,
            response_token_ids=[] if choice.token_ids is None else [choice.token_ids],
            rollout_infos={WEIGHT_VERSION_KEY: response.version},
            rollout_logprobs=logprobs,
        )

    response: InferResponse
    response_token_ids: list[list[int]] = Field(default_factory=list)
    """The generated token ids per turn (one turn here), when `return_details` asked for them."""
    rollout_infos: dict[str, Any] = Field(default_factory=dict)
    rollout_logprobs: list[list[float]] = Field(default_factory=list)
    """The generated tokens' logprobs per turn, when `logprobs` asked for them (swift's trainer reads
    them for its importance-sampling correction)."""

    @field_validator("response_token_ids", mode="before")
    @classmethod
    def _one_turn_as_list(cls, value: Any) -> Any:
        """A flat list is one turn, as swift's own `RolloutOutput` reads it."""
        if isinstance(value, list) and value and isinstance(value[0], int):
            return [value]
        return value


class HealthResponse(WireResponse):
    status: str = "ok"
    instance_id: str = ""
    """Random per server process, new at every start: a learner that sees it change knows the server
    restarted (its weights are the base again) and re-syncs it in full. "" from a server older than it."""


class WorldSizeResponse(WireResponse):
    world_size: int


class VersionResponse(WireResponse):
    version: int
    model: str
    engine: str = ""
    weight_stream_port: int | None = None
    """The port of the weight-stream listener (same host; `POST /update_weights/` there); None: send
    weight chunks to this port."""
    stagectl_version: str = ""
    """The server's stagectl version ("" from a server older than this field)."""
    sync_dtype: str = ""
    """The dtype a weight sync must carry (most of the engine's tensors: the serving dtype, or float32 for
    an hf server that merges pushed adapters); "" from a server older than this field."""
    batch_size: int | None = Field(None, ge=1)
    """The most requests the engine decodes in one generate call (`rollout_server.max_batch_size`); the
    async prefetcher sizes its requests in whole batches of it. None: no fixed batch, or a server older
    than this field."""
    instance_id: str = ""
    """As `HealthResponse.instance_id`: new at every start of the server process ("" from an older server)."""
    version_tags: bool = False
    """The server honours `/infer/`'s `weight_version` and swaps a sync in between calls (`weightsync.gate`);
    False from a server older than the field. The async learner's `in_flight_sync` needs it."""


class StatsResponse(WireResponse):
    version: int
    num_requests: int
    num_batches: int
    batch_sizes: dict[str, int]
    """Histogram of generate batch sizes: `{"1": 3, "8": 2}` (keys are sizes as strings, JSON style)."""
    num_syncs: int
    num_failed_syncs: int
    num_deferred_syncs: int = 0
    """Syncs committed while rollout calls were in progress, swapped in when the last of them ended."""


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


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def spec_of(tensor: torch.Tensor) -> TensorSpec:
    return TensorSpec(tuple(tensor.shape), dtype_name(tensor.dtype))


def read_token(env_name: str | None, key: str) -> str | None:
    """The bearer token held by environment variable `env_name` (None when no variable is configured)."""
    if env_name is None:
        return None
    token = os.environ.get(env_name, "").strip()
    if not token:
        raise ValueError(f"{key} names ${env_name}, which is unset or empty; export the token there")
    return token
