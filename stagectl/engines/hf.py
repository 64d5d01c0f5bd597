"""The `hf` engine: any transformers chat model (text, or Qwen-VL with images) behind one batching worker.

Requests are encoded (`models.chat.encode_messages`: the checkpoint's chat template; for Qwen-VL image
preprocessing and `<|image_pad|>` expansion) on the calling thread; the worker groups requests with
equal sampling parameters into one left-padded `generate_batch` call (up to `max_batch_size`, waiting
`batch_wait_ms` to fill), with per-request seeds (`PerRowSampler`) and stop strings. Generation stops
at the checkpoint's own stop ids (`ModelBundle.stop_token_ids`: the chat template's end-of-turn and
every eos id). `kv_cache: static` (`rollout_server.hf_kv_cache`) decodes with a preallocated cache and,
on CUDA, a compiled decode step. Under `vllm.sync.mode: adapter` a sync carries only the adapter, which `AdapterMerger`
merges onto its float32 base copy. `apply_weights` copies verified tensors into the model under the same lock the worker
holds while generating, so a batch sees either the old or the new weights, never a mix.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from functools import cached_property

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from stagectl.config.engines import ENGINES
from stagectl.config.sampling import SamplingSpec
from stagectl.detection.vocab import token_bytes_table
from stagectl.engines.batching import BatchingWorker
from stagectl.engines.hf_adapter import AdapterMerger
from stagectl.engines.interface import EngineRequest, EngineResult, EngineStopping, TensorSpec
from stagectl.engines.sampling import PerRowSampler
from stagectl.engines.text import cut_at_stop
from stagectl.models.chat import encode_messages
from stagectl.models.generate import KvCache, PromptInputs, generate_batch
from stagectl.models.loading import ModelBundle
from stagectl.wire.guards import check_context
from stagectl.wire.protocol import spec_of


class _Job:
    def __init__(self, request: EngineRequest, prompt: PromptInputs) -> None:
        self.request = request
        self.prompt = prompt


class HFEngine:
    name = "hf"
    capabilities = ENGINES["hf"]

    def __init__(
        self,
        bundle: ModelBundle,
        *,
        model_name: str,
        max_batch_size: int,
        batch_wait_ms: float,
        adapter: AdapterMerger | None = None,
        kv_cache: KvCache = "dynamic",
    ) -> None:
        self.bundle = bundle
        self.kv_cache = kv_cache  # `rollout_server.hf_kv_cache`
        self.adapter = adapter  # `vllm.sync.mode: adapter`: syncs carry the adapter, merged in here
        self.model_name = model_name
        self.max_batch_size = max_batch_size
        self.model = bundle.model
        self.model.eval()
        self.stop_token_ids = list(bundle.stop_token_ids)
        self.max_model_len = int(self.model.config.get_text_config().max_position_embeddings)
        pad = bundle.tokenizer.pad_token_id
        self.pad_token_id = int(pad if pad is not None else self.stop_token_ids[0])
        self._version = 0
        self._lock = threading.Lock()  # held while generating and while swapping weights
        self._worker: BatchingWorker[_Job, EngineResult] = BatchingWorker(
            self._run_batch,
            key=lambda job: job.request.params,
            max_batch_size=max_batch_size,
            batch_wait_ms=batch_wait_ms,
            name="hf-engine",
        )

    @property
    def version(self) -> int:
        return self._version

    def generate(self, requests: Sequence[EngineRequest]) -> list[EngineResult]:
        bundle = self.bundle
        jobs = [
            _Job(
                r,
                encode_messages(
                    bundle.tokenizer,
                    bundle.image_processor,
                    r.messages,
                    r.images,
                    model_type=bundle.model_type,
                ),
            )
            for r in requests
        ]
        for i, job in enumerate(jobs):
            check_context(len(job.prompt.input_ids), job.request.params.max_new_tokens, self.max_model_len, i)
        return self._worker.run(jobs)

    def _run_batch(self, jobs: list[_Job]) -> list[EngineResult]:
        params: SamplingSpec = jobs[0].request.params
        spec = SamplingSpec(
            max_new_tokens=params.max_new_tokens,
            temperature=0.0,
            repetition_penalty=params.repetition_penalty,
            logprobs=params.logprobs,
        )
        processors: list[LogitsProcessor] = []
        if params.temperature > 0:
            seeds = [job.request.seed for job in jobs]
            processors.append(PerRowSampler(seeds, params.temperature, params.top_p, params.top_k))
        with self._lock:
            generations = generate_batch(
                self.model,
                [job.prompt for job in jobs],
                spec,
                stop_token_ids=self.stop_token_ids,
                pad_token_id=self.pad_token_id,
                logits_processor=LogitsProcessorList(processors),
                stop_strings=params.stop,
                tokenizer=self.bundle.tokenizer,
                kv_cache=self.kv_cache,
            )
            version = self._version
        results = []
        for job, generation in zip(jobs, generations, strict=True):
            ids, text, hit = cut_at_stop(generation.token_ids, params.stop, self._decode)
            finish = "stop" if hit else generation.finish_reason
            logprobs = generation.logprobs[: len(ids)] if generation.logprobs is not None else None
            pieces = [self._token_bytes[i] for i in ids] if logprobs is not None else None
            results.append(
                EngineResult(list(job.prompt.input_ids), ids, text, finish, version, logprobs, pieces)
            )
        return results

    @cached_property
    def _token_bytes(self) -> list[bytes]:
        """Exact bytes of every token id (built on the first request that asks for logprobs)."""
        return token_bytes_table(
            self.bundle.tokenizer, int(self.model.get_output_embeddings().weight.shape[0])
        )

    def _decode(self, ids: Sequence[int]) -> str:
        return str(self.bundle.tokenizer.decode(list(ids), skip_special_tokens=True))

    def weight_specs(self) -> dict[str, TensorSpec]:
        if self.adapter is not None:
            return dict(self.adapter.specs)
        return {name: spec_of(t) for name, t in self.model.state_dict().items()}

    def apply_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        state = self.model.state_dict()  # tensors share storage with the model's parameters/buffers
        if self.adapter is not None:  # merged outside the lock: generation goes on meanwhile
            weights = self.adapter.merged(weights)
        with self._lock, torch.no_grad():
            for name, tensor in weights.items():
                state[name].copy_(tensor)
            self._version = version

    def batch_sizes(self) -> dict[int, int]:
        return self._worker.batch_sizes()

    def cancel_queued(self, reason: str) -> None:
        self._worker.cancel_queued(EngineStopping(reason))

    def close(self) -> None:
        self._worker.close()
