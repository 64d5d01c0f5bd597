"""Batched generation with a Qwen-VL (or text) model: left-padded prompts, one `generate` call.

Shared by the learner's in-process rollouts (`rollout_backend: hf`) and the rollout server's `hf`
engine. Sampling is seeded per call (`seed`), so a chunk of rollouts is reproducible from the seed
that is logged with it. The server's engine adds its own logits processors (per-request seeded
sampling) and stop strings, which `generate` checks while decoding.

Log-probabilities (`spec.logprobs`): each generated token's log-probability under the model's raw
next-token distribution (log-softmax of the logits, before repetition penalty, temperature, top-k and
top-p), as vLLM reports by default. `ChosenLogprobs` is the first logits processor, so it sees the raw
logits; the repetition penalty then runs as our own processor after it instead of as transformers'.
It keeps one step's (B, V) log-softmax and gathers the chosen token's entry when the next step (or
the end) shows which token was chosen, so memory stays O(B x V), not O(B x V x steps).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
from transformers import LogitsProcessor, LogitsProcessorList, RepetitionPenaltyLogitsProcessor

from stagectl.config.sampling import SamplingSpec

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

FinishReason = Literal["stop", "length"]
KvCache = Literal["dynamic", "static"]  # transformers' DynamicCache, or a preallocated StaticCache


@dataclass(frozen=True)
class PromptInputs:
    """One prompt: token ids plus (optional) its images, as produced by `models.chat.encode_prompt`."""

    input_ids: list[int]
    mm_token_type_ids: list[int] | None = None
    pixel_values: torch.Tensor | None = None  # (num_patches, patch_dim)
    image_grid_thw: torch.Tensor | None = None  # (num_images, 3)


@dataclass(frozen=True)
class Generation:
    token_ids: list[int]  # generated ids, up to and including the first stop id
    finish_reason: FinishReason
    logprobs: list[float] | None = None  # per entry of token_ids (raw model log-probability), when asked


class ChosenLogprobs(LogitsProcessor):
    """Records the raw log-probability of each row's chosen token, step by step (see the module docstring)."""

    def __init__(self) -> None:
        self._steps: list[torch.Tensor] = []  # (B,) per finished step
        self._pending: torch.Tensor | None = None  # (B, V) log-softmax of the last step seen

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self._pending is not None:  # input_ids now ends with the token chosen from _pending
            self._steps.append(self._pending.gather(-1, input_ids[:, -1:]).squeeze(-1))
        self._pending = torch.log_softmax(scores.float(), dim=-1)
        return scores

    def finish(self, new_tokens: torch.Tensor) -> list[list[float]]:
        """Per row, the log-probability of every generated token; `new_tokens` is (B, T)."""
        if self._pending is not None and len(self._steps) < new_tokens.shape[1]:
            self._steps.append(
                self._pending.gather(-1, new_tokens[:, len(self._steps)].unsqueeze(-1)).squeeze(-1)
            )
        self._pending = None
        if not self._steps:
            return [[] for _ in range(new_tokens.shape[0])]
        per_step = torch.stack(self._steps, dim=1).cpu()  # (B, T)
        return [[float(v) for v in row] for row in per_step.tolist()]


@torch.no_grad()
def generate_batch(
    model: Any,
    prompts: Sequence[PromptInputs],
    spec: SamplingSpec,
    *,
    stop_token_ids: Sequence[int],
    pad_token_id: int,
    seed: int | None = None,
    logits_processor: LogitsProcessorList | None = None,
    stop_strings: Sequence[str] = (),
    tokenizer: PreTrainedTokenizerBase | None = None,
    kv_cache: KvCache = "dynamic",
) -> list[Generation]:
    """Generate for every prompt in one left-padded batch; outputs in prompt order.

    `logits_processor` runs after transformers' own processors; a row also ends at the token that
    completes one of `stop_strings` (which needs `tokenizer`; the ids are not cut at the string).
    `kv_cache: static` preallocates the KV cache for prompt + `max_new_tokens` (transformers' StaticCache);
    on CUDA transformers then compiles the one-token decode step (`torch.compile`, recompiled for each new
    batch shape), which removes the per-step Python and kernel-launch overhead of eager decoding.
    """
    if stop_strings and tokenizer is None:
        raise ValueError("generate_batch: stop_strings need the tokenizer")
    if not prompts:
        return []
    device = next(model.parameters()).device
    longest = max(len(p.input_ids) for p in prompts)
    ids = torch.full((len(prompts), longest), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), longest), dtype=torch.long)
    mm_types = torch.zeros((len(prompts), longest), dtype=torch.int)
    for row, prompt in enumerate(prompts):
        n = len(prompt.input_ids)
        ids[row, longest - n :] = torch.tensor(prompt.input_ids)
        mask[row, longest - n :] = 1
        if prompt.mm_token_type_ids is not None:
            mm_types[row, longest - n :] = torch.tensor(prompt.mm_token_type_ids, dtype=torch.int)
    kwargs: dict[str, Any] = {"input_ids": ids.to(device), "attention_mask": mask.to(device)}
    pixel = [p.pixel_values for p in prompts if p.pixel_values is not None]
    if pixel:
        grids = [p.image_grid_thw for p in prompts if p.image_grid_thw is not None]
        kwargs["pixel_values"] = torch.cat(pixel).to(device=device, dtype=model.dtype)
        kwargs["image_grid_thw"] = torch.cat(grids).to(device)
        kwargs["mm_token_type_ids"] = mm_types.to(device)
    greedy = spec.temperature <= 0
    sampling: dict[str, Any] = {"do_sample": not greedy}
    if not greedy:
        sampling.update(temperature=spec.temperature, top_p=spec.top_p, top_k=spec.top_k or None)
    if seed is not None:
        torch.manual_seed(seed)
    repetition_penalty = spec.repetition_penalty
    recorder: ChosenLogprobs | None = None
    if spec.logprobs:  # the recorder must see the raw logits: it goes first, the penalty after it
        recorder = ChosenLogprobs()
        processors: list[LogitsProcessor] = [recorder]
        if repetition_penalty != 1.0:
            processors.append(RepetitionPenaltyLogitsProcessor(repetition_penalty))
            repetition_penalty = 1.0
        logits_processor = LogitsProcessorList([*processors, *(logits_processor or [])])
    if logits_processor is not None:
        sampling["logits_processor"] = logits_processor
    if stop_strings:
        sampling.update(stop_strings=list(stop_strings), tokenizer=tokenizer)
    if kv_cache == "static":
        sampling["cache_implementation"] = "static"
    elif kv_cache != "dynamic":
        raise ValueError(f"generate_batch: kv_cache must be dynamic or static, got {kv_cache!r}")
    out = model.generate(
        **kwargs,
        **sampling,
        max_new_tokens=spec.max_new_tokens,
        repetition_penalty=repetition_penalty,
        eos_token_id=list(stop_token_ids),
        pad_token_id=pad_token_id,
        use_cache=True,
        # never lock-step with other ranks: under FSDP the caller unshards first (`sharding.gathered`)
        synced_gpus=False,
    )
    new_tokens = out[:, longest:]  # (B, <= max_new_tokens)
    row_logprobs = recorder.finish(new_tokens) if recorder is not None else None
    stops = set(stop_token_ids)
    results = []
    for b, row in enumerate(new_tokens.tolist()):
        cut = next((k for k, token in enumerate(row) if token in stops), None)
        end = spec.max_new_tokens if cut is None else cut + 1
        logprobs = row_logprobs[b][:end] if row_logprobs is not None else None
        results.append(Generation(row[:end], "length" if cut is None else "stop", logprobs))
    return results
