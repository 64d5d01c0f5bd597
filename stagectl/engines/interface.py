"""The engine `Protocol` behind the rollout server, and the plain data it takes and returns.

An engine turns normalised requests (template-ready messages + decoded images + sampling
parameters + a seed) into results, and swaps its weights atomically. Implementations: `hf`
(`engines.hf`, transformers with a batching worker), `fake` (`engines.fake`, a deterministic echo
for tests) and `vllm` (the `vllm` extra). The server owns everything else: HTTP, limits, image
paths, weight staging and verification.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

from stagectl.config.engines import EngineCapabilities
from stagectl.config.sampling import SamplingSpec
from stagectl.wire.protocol import TensorSpec

if TYPE_CHECKING:
    import torch
    from PIL import Image

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class EngineRequest:
    messages: list[dict[str, Any]]  # chat-template messages (`prompts.normalize_messages`)
    images: list[Image.Image]  # decoded RGB images, in placeholder order
    params: SamplingSpec
    seed: int | None  # None: the engine draws a fresh one


@dataclass(frozen=True)
class EngineResult:
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated ids; ends with the stop id / the token completing a stop string
    text: str  # decoded `token_ids` (special tokens skipped), cut before a stop string
    finish_reason: FinishReason
    version: int  # the weight version that generated it
    logprobs: list[float] | None = None  # per entry of token_ids, when `params.logprobs` (raw model log-prob)
    token_bytes: list[bytes] | None = (
        None  # per entry of token_ids, with `logprobs`: each token's exact bytes
    )


class EngineStopping(RuntimeError):
    """A request failed because the engine is stopping (`Engine.cancel_queued`): the server answers 503."""


class Engine(Protocol):
    """What the server needs from an inference engine. Every method is safe to call from any thread."""

    name: str  # "hf", "vllm", "fake"
    capabilities: EngineCapabilities  # what it can do (`config.engines.ENGINES[name]`): checks read these
    model_name: str  # what /version/ reports
    max_model_len: int  # context length: prompt + generated tokens of one request (`guards.check_context`)

    @property
    def max_batch_size(self) -> int | None:
        """The most requests one generate call decodes (`/version/` reports it as `batch_size`); None: no
        fixed batch."""
        ...

    @property
    def version(self) -> int:
        """Version of the weights serving now (0 at start, then the version of each applied sync)."""
        ...

    def generate(self, requests: Sequence[EngineRequest]) -> list[EngineResult]:
        """One result per request, in order; blocks until all are done. `ValueError`: an input it cannot
        encode, or a prompt + max_new_tokens beyond `max_model_len` (`guards.TooManyTokens`): the server
        answers 400; any other error is a server failure (500, the client retries)."""
        ...

    def weight_specs(self) -> dict[str, TensorSpec]:
        """Name -> shape/dtype of every tensor a full sync must provide."""
        ...

    def apply_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        """Swap in `weights` (already verified against `weight_specs`) and set `version`, atomically
        with respect to generation: no request ever sees half-updated weights."""
        ...

    def batch_sizes(self) -> dict[int, int]:
        """Histogram of generate batch sizes so far."""
        ...

    def cancel_queued(self, reason: str) -> None:
        """Fail every request not in the running generate call with `EngineStopping(reason)`, at once, and
        every later one (a stopping server); the running call finishes."""
        ...

    def close(self) -> None: ...
