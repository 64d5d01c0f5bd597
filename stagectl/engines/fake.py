"""A deterministic echo engine (a fake of our own `Engine` protocol) so tests and benchmarks can run
the real server without a model.

Token ids are UTF-8 bytes. The prompt is the rendered messages, with `<image WxH>` for each image;
the response is `echo <last user text> seed=<seed> ver=<version> w=<sum of weight "w0">`, cut to
`max_tokens` bytes and at stop strings. With `logprobs`, token k (byte b) has log-probability
`fake_logprob(b) = -b / 256`, so a test can tell which tokens a score was computed from. It batches through the real `BatchingWorker`, and
`step_delay_ms` makes each batch take that long, so concurrent requests visibly share batches.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence

import torch

from stagectl.config.engines import ENGINES
from stagectl.config.sampling import SamplingSpec
from stagectl.engines.batching import BatchingWorker
from stagectl.engines.interface import EngineRequest, EngineResult, EngineStopping, FinishReason, TensorSpec
from stagectl.engines.text import cut_at_stop
from stagectl.wire.guards import check_context
from stagectl.wire.protocol import spec_of


def default_weights(num_mib: int = 0, block_mib: int = 4) -> dict[str, torch.Tensor]:
    """`w0` (4 x 4, drives the echoed checksum) plus `num_mib` MiB of float32 blocks of `block_mib` MiB."""
    weights = {"w0": torch.zeros(4, 4)}
    rows_per_mib = 1024 * 1024 // (4 * 1024)  # rows of 1024 float32
    for k in range(-(-num_mib // block_mib)):
        mib = min(block_mib, num_mib - k * block_mib)
        weights[f"block{k}"] = torch.zeros(mib * rows_per_mib, 1024)
    return weights


def fake_logprob(token_id: int) -> float:
    """The fake engine's log-probability of token (byte) `token_id`: deterministic, in (-1, 0]."""
    return -token_id / 256


def _decode(ids: Sequence[int]) -> str:
    return bytes(ids).decode("utf-8", errors="replace")


def _render(request: EngineRequest) -> str:
    images = iter(request.images)
    parts = []
    for message in request.messages:
        content = message["content"]
        if isinstance(content, str):
            parts.append(f"{message['role']}: {content}")
            continue
        body = []
        for item in content:
            if item["type"] == "image":
                image = next(images)
                body.append(f"<image {image.width}x{image.height}>")
            else:
                body.append(item["text"])
        parts.append(f"{message['role']}: {''.join(body)}")
    return "\n".join(parts)


def _last_user_text(request: EngineRequest) -> str:
    content = request.messages[-1]["content"]
    if isinstance(content, str):
        return content
    return "".join(item.get("text", "") for item in content if item["type"] == "text")


class FakeEngine:
    name = "fake"
    capabilities = ENGINES["fake"]

    def __init__(
        self,
        weights: Mapping[str, torch.Tensor] | None = None,
        *,
        max_batch_size: int = 8,
        batch_wait_ms: float = 10.0,
        step_delay_ms: float = 0.0,
        model_name: str = "fake-echo",
        max_model_len: int = 32768,
    ) -> None:
        self.model_name = model_name
        self.max_batch_size = max_batch_size
        self.max_model_len = max_model_len  # prompt bytes + max_new_tokens must fit (as an engine's context)
        self.weights = {k: v.clone() for k, v in (weights or default_weights()).items()}
        self.step_delay_s = step_delay_ms / 1000.0
        self._version = 0
        self._lock = threading.Lock()  # the generation lock: apply_weights swaps under it
        self.fail_next_batches = 0  # testing aid: the next N batches raise RuntimeError
        self._worker: BatchingWorker[EngineRequest, EngineResult] = BatchingWorker(
            self._run_batch,
            key=lambda r: r.params,
            max_batch_size=max_batch_size,
            batch_wait_ms=batch_wait_ms,
            name="fake-engine",
        )

    @property
    def version(self) -> int:
        return self._version

    def generate(self, requests: Sequence[EngineRequest]) -> list[EngineResult]:
        for i, request in enumerate(requests):
            check_context(
                len(_render(request).encode("utf-8")), request.params.max_new_tokens, self.max_model_len, i
            )
        return self._worker.run(requests)

    def _run_batch(self, batch: list[EngineRequest]) -> list[EngineResult]:
        with self._lock:
            if self.fail_next_batches > 0:
                self.fail_next_batches -= 1
                raise RuntimeError("fake engine: injected failure")
            if self.step_delay_s:
                time.sleep(self.step_delay_s)
            checksum = float(self.weights["w0"].sum()) if "w0" in self.weights else 0.0
            return [self._one(r, checksum) for r in batch]

    def _one(self, request: EngineRequest, checksum: float) -> EngineResult:
        params: SamplingSpec = request.params
        prompt_ids = list(_render(request).encode("utf-8"))
        reply = f"echo {_last_user_text(request)} seed={request.seed} ver={self._version} w={checksum:g}"
        ids = list(reply.encode("utf-8"))
        truncated = len(ids) > params.max_new_tokens
        ids, text, hit = cut_at_stop(ids[: params.max_new_tokens], params.stop, _decode)
        logprobs = [fake_logprob(i) for i in ids] if params.logprobs else None
        pieces = [bytes([i]) for i in ids] if params.logprobs else None
        finish: FinishReason = "length" if truncated and not hit else "stop"
        return EngineResult(prompt_ids, ids, text, finish, self._version, logprobs, pieces)

    def weight_specs(self) -> dict[str, TensorSpec]:
        return {name: spec_of(t) for name, t in self.weights.items()}

    def apply_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        with self._lock:
            for name, tensor in weights.items():
                self.weights[name].copy_(tensor)
            self._version = version

    def batch_sizes(self) -> dict[int, int]:
        return self._worker.batch_sizes()

    def cancel_queued(self, reason: str) -> None:
        self._worker.cancel_queued(EngineStopping(reason))

    def close(self) -> None:
        self._worker.close()
