"""The `hf` engine: a transformers Qwen-VL model behind one batching worker thread.

Requests are encoded (chat template, image preprocessing, `<|image_pad|>` expansion) on the calling
thread; the worker groups requests with equal sampling parameters into one left-padded
`generate_batch` call (up to `max_batch_size`, waiting `batch_wait_ms` to fill), with per-request
seeds (`PerRowSampler`) and stop strings. `apply_weights` copies verified tensors into the model
under the same lock the worker holds while generating, so a batch sees either the old or the new
weights, never a mix.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from stagectl.models.generate import PromptInputs, SamplingSpec, generate_batch
from stagectl.models.images import preprocess_images
from stagectl.models.loading import ModelBundle
from stagectl.models.tokenizer import IMAGE_PAD, token_id
from stagectl.rollout.batching import BatchingWorker
from stagectl.rollout.engine import EngineRequest, EngineResult, SamplingParams, TensorSpec
from stagectl.rollout.engines.sampling import PerRowSampler
from stagectl.rollout.text import cut_at_stop
from stagectl.rollout.weights import spec_of


def encode_messages(bundle: ModelBundle, messages: list[dict[str, Any]], images: list[Any]) -> PromptInputs:
    """Chat template over `messages` + generation prompt, each `<|image_pad|>` expanded to its image's
    merged-token count (the same ids `models.chat.encode_prompt` gives for detection prompts)."""
    text = bundle.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert isinstance(text, str)
    template_ids = bundle.tokenizer.encode(text, add_special_tokens=False)
    image_pad_id = token_id(bundle.tokenizer, IMAGE_PAD)
    if template_ids.count(image_pad_id) != len(images):
        raise ValueError(
            f"the chat template produced {template_ids.count(image_pad_id)} image placeholders "
            f"for {len(images)} images"
        )
    if not images:
        return PromptInputs(list(template_ids))
    inputs = preprocess_images(images, bundle.image_processor)
    counts = iter(inputs.num_image_tokens)
    ids: list[int] = []
    for tid in template_ids:
        ids.extend([image_pad_id] * next(counts) if tid == image_pad_id else [tid])
    return PromptInputs(
        ids, [int(i == image_pad_id) for i in ids], inputs.pixel_values, inputs.image_grid_thw
    )


class _WithGenerateExtras:
    """`generate_batch` drives `model.generate`; this passes our sampler and stop strings into that call.
    (To be replaced by `generate_batch(..., logits_processor=, stop_strings=)` once it takes them.)"""

    def __init__(self, model: Any, extras: dict[str, Any]) -> None:
        self.model = model
        self.extras = extras

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    def parameters(self) -> Any:
        return self.model.parameters()

    def generate(self, **kwargs: Any) -> torch.Tensor:
        return self.model.generate(**kwargs, **self.extras)


class _Job:
    def __init__(self, request: EngineRequest, prompt: PromptInputs) -> None:
        self.request = request
        self.prompt = prompt


class HFEngine:
    name = "hf"

    def __init__(
        self, bundle: ModelBundle, *, model_name: str, max_batch_size: int, batch_wait_ms: float
    ) -> None:
        self.bundle = bundle
        self.model_name = model_name
        self.model = bundle.model
        self.model.eval()
        eos = self.model.generation_config.eos_token_id
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        self.stop_token_ids = sorted({*eos_ids, bundle.end_of_turn_id})
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
        jobs = [_Job(r, encode_messages(self.bundle, r.messages, r.images)) for r in requests]
        return self._worker.run(jobs)

    def _run_batch(self, jobs: list[_Job]) -> list[EngineResult]:
        params: SamplingParams = jobs[0].request.params
        spec = SamplingSpec(
            max_new_tokens=params.max_tokens, temperature=0.0, repetition_penalty=params.repetition_penalty
        )
        processors: list[LogitsProcessor] = []
        if params.temperature > 0:
            seeds = [job.request.seed for job in jobs]
            processors.append(PerRowSampler(seeds, params.temperature, params.top_p, params.top_k))
        extras: dict[str, Any] = {"logits_processor": LogitsProcessorList(processors)}
        if params.stop:
            extras.update(stop_strings=list(params.stop), tokenizer=self.bundle.tokenizer)
        with self._lock:
            generations = generate_batch(
                _WithGenerateExtras(self.model, extras),
                [job.prompt for job in jobs],
                spec,
                stop_token_ids=self.stop_token_ids,
                pad_token_id=self.pad_token_id,
            )
            version = self._version
        results = []
        for job, generation in zip(jobs, generations, strict=True):
            ids, text, hit = cut_at_stop(generation.token_ids, params.stop, self._decode)
            finish = "stop" if hit else generation.finish_reason
            results.append(EngineResult(list(job.prompt.input_ids), ids, text, finish, version))
        return results

    def _decode(self, ids: Sequence[int]) -> str:
        return str(self.bundle.tokenizer.decode(list(ids), skip_special_tokens=True))

    def weight_specs(self) -> dict[str, TensorSpec]:
        return {name: spec_of(t) for name, t in self.model.state_dict().items()}

    def apply_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        state = self.model.state_dict()  # tensors share storage with the model's parameters/buffers
        with self._lock, torch.no_grad():
            for name, tensor in weights.items():
                state[name].copy_(tensor)
            self._version = version

    def batch_sizes(self) -> dict[int, int]:
        return self._worker.batch_sizes()

    def close(self) -> None:
        self._worker.close()
