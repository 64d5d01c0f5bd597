"""What the rollout server does, without HTTP: validate and load request inputs, call the engine,
shape swift-style responses, run weight syncs, count. `server.app` maps HTTP onto these methods."""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import stagectl
from stagectl.config.rollout import TRANSPORTS
from stagectl.engines.interface import Engine, EngineRequest, EngineResult
from stagectl.engines.text import normalize_messages
from stagectl.server.swift_fields import refusals
from stagectl.weightsync.factory import build_receivers
from stagectl.weightsync.receiver import WeightSync
from stagectl.wire.guards import CallLimits, TooManyTokens, check_call
from stagectl.wire.paths import load_image
from stagectl.wire.protocol import (
    ChatMessage,
    Choice,
    ChoiceLogprobs,
    InferBody,
    InferResponse,
    StatsResponse,
    TensorSpec,
    TokenLogprob,
    Usage,
    VersionResponse,
)


class BadRequest(ValueError):
    """The request is well-formed JSON but cannot be served as asked (HTTP 400)."""


@dataclass(frozen=True)
class ServerSettings:
    image_roots: Sequence[Path] = ()
    weight_dirs: Sequence[Path] = ()
    auth_token: str | None = None  # None: every endpoint is open (loopback only)
    open_infer: bool = False  # True: /infer/ and /get_world_size/ need no token (the swift contract)
    limits: CallLimits = field(
        default_factory=CallLimits
    )  # bounds of one /infer/ call (max_tokens, number of requests)
    max_request_bytes: int = 32 * 1024 * 1024
    max_weight_chunk_bytes: int = 512 * 1024 * 1024
    body_timeout_s: float = 120.0  # a request body must arrive within this (slow-client guard: 408)
    weight_stream_host: str = "127.0.0.1"  # the weight-stream listener (`weightsync.stream`): its address,
    weight_stream_port: int | None = 0  # its port (0: a free one; None: off, chunks go to the app's port)
    tls_certfile: Path | None = None  # both set: TLS on both ports (`wire.tls`)
    tls_keyfile: Path | None = None
    # the weight-sync transports whose routes the app mounts (an embedded server: its learner's one only)
    weight_transports: frozenset[str] = frozenset(TRANSPORTS)


class RolloutService:
    def __init__(self, engine: Engine, settings: ServerSettings) -> None:
        self.engine = engine
        self.settings = settings
        transports = settings.weight_transports
        self.sync = WeightSync(engine)  # the staging the receivers below share
        # the receivers of the transports whose routes the app mounts, no other
        receivers = build_receivers(self.sync, transports, settings.weight_dirs)
        self.http, self.collective, self.disk = receivers.http, receivers.collective, receivers.disk
        self.num_requests = 0
        self.instance_id = uuid.uuid4().hex  # new at every start: a learner re-syncs a restarted server
        self.weight_stream_port: int | None = None  # set by the app while its weight-stream listener runs
        self.sync_dtype = sync_dtype(engine.weight_specs().values())
        self.stopping = False  # set once a SIGTERM/SIGINT began the graceful shutdown (`server.serving`)
        self._count_lock = threading.Lock()

    def infer(self, body: InferBody) -> list[InferResponse]:
        refused = refusals(body)
        if refused:
            raise BadRequest("; ".join(refused))
        if not body.infer_requests:
            return []
        config = body.request_config
        # refused before any image is read or token generated (413 / 400)
        check_call(
            len(body.infer_requests), config.max_tokens, self.settings.limits, self.engine.max_model_len
        )
        params = config.sampling()
        requests = []
        for i, item in enumerate(body.infer_requests):
            try:
                images = [load_image(ref, self.settings.image_roots) for ref in item.images]
                messages = normalize_messages(item.messages, len(images))
            except ValueError as exc:
                raise BadRequest(f"infer_requests[{i}]: {exc}") from None
            seed = None if config.seed is None else config.seed + i
            requests.append(EngineRequest(messages, images, params, seed))
        try:
            with self.sync.gate.admit(body.weight_version):  # one version for the whole call
                results = self.engine.generate(requests)
        except TooManyTokens as exc:  # a prompt + max_tokens beyond the context: its own message names both
            if exc.index is None:
                raise
            raise TooManyTokens(f"infer_requests[{exc.index}]: {exc}", exc.index) from None
        except ValueError as exc:  # raised while encoding this call's inputs (e.g. an extreme aspect ratio)
            raise BadRequest(f"cannot encode the request: {exc}") from None
        with self._count_lock:
            self.num_requests += len(requests)
        return [
            self._response(result, config.return_details, item.uuid)
            for result, item in zip(results, body.infer_requests, strict=True)
        ]

    def _response(self, result: EngineResult, details: bool, request_id: str | None) -> InferResponse:
        return InferResponse(
            id=request_id or f"chatcmpl-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=self.engine.model_name,
            choices=[
                Choice(
                    index=0,
                    message=ChatMessage(role="assistant", content=result.text),
                    finish_reason=result.finish_reason,
                    token_ids=result.token_ids if details else None,
                    logprobs=_choice_logprobs(result),
                )
            ],
            usage=Usage(
                prompt_tokens=len(result.prompt_token_ids),
                completion_tokens=len(result.token_ids),
                total_tokens=len(result.prompt_token_ids) + len(result.token_ids),
            ),
            prompt_token_ids=result.prompt_token_ids if details else None,
            version=result.version,
        )

    def version(self) -> VersionResponse:
        return VersionResponse(
            version=self.sync.gate.committed_version,
            model=self.engine.model_name,
            engine=self.engine.name,
            weight_stream_port=self.weight_stream_port,
            stagectl_version=stagectl.__version__,
            sync_dtype=self.sync_dtype,
            batch_size=self.engine.max_batch_size,
            instance_id=self.instance_id,
            version_tags=True,
        )

    def stats(self) -> StatsResponse:
        histogram = self.engine.batch_sizes()
        return StatsResponse(
            version=self.sync.gate.committed_version,
            num_requests=self.num_requests,
            num_batches=sum(histogram.values()),
            batch_sizes={str(size): count for size, count in sorted(histogram.items())},
            num_syncs=self.sync.num_syncs,
            num_failed_syncs=self.sync.num_failed_syncs + self.sync.gate.num_failed,
            num_deferred_syncs=self.sync.gate.num_deferred,
        )

    def stop_queued(self) -> None:
        """The graceful shutdown's deadline is near: every call the engine has not started yet is answered
        503 now (`EngineStopping`), so it neither runs past the deadline nor keeps the process decoding
        for clients that are gone; the running generate call finishes."""
        self.engine.cancel_queued(
            "the rollout server is stopping (SIGTERM/SIGINT) and had not started this call; send it to "
            "another server"
        )

    def close(self) -> None:
        self.engine.close()


def sync_dtype(specs: Iterable[TensorSpec]) -> str:
    """The dtype most of the engine's weights have: what a weight sync must carry ("" without weights)."""
    counts = Counter(spec.dtype for spec in specs)
    return counts.most_common(1)[0][0] if counts else ""


def _choice_logprobs(result: EngineResult) -> ChoiceLogprobs | None:
    """OpenAI/swift-shaped `choices[0].logprobs` (None when the request did not ask for them)."""
    if result.logprobs is None:
        return None
    if result.token_bytes is None or not (
        len(result.logprobs) == len(result.token_bytes) == len(result.token_ids)
    ):
        raise RuntimeError("the engine returned logprobs that are not aligned with its token ids")
    return ChoiceLogprobs(
        content=[
            TokenLogprob(token=piece.decode("utf-8", errors="replace"), logprob=logprob, bytes=list(piece))
            for logprob, piece in zip(result.logprobs, result.token_bytes, strict=True)
        ]
    )
