"""Batched generation with a Qwen-VL (or text) model: left-padded prompts, one `generate` call.

Shared by the learner's in-process rollouts (`rollout_backend: hf`) and the rollout server's `hf`
engine. Sampling is seeded per call (`seed`), so a chunk of rollouts is reproducible from the seed
that is logged with it. The server's engine adds its own logits processors (per-request seeded
sampling) and stop strings, which `generate` checks while decoding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

from stagectl.models.sampling import SamplingSpec

if TYPE_CHECKING:
    from transformers import LogitsProcessorList, PreTrainedTokenizerBase

FinishReason = Literal["stop", "length"]


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
) -> list[Generation]:
    """Generate for every prompt in one left-padded batch; outputs in prompt order.

    `logits_processor` runs after transformers' own processors; a row also ends at the token that
    completes one of `stop_strings` (which needs `tokenizer`; the ids are not cut at the string).
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
    if logits_processor is not None:
        sampling["logits_processor"] = logits_processor
    if stop_strings:
        sampling.update(stop_strings=list(stop_strings), tokenizer=tokenizer)
    out = model.generate(
        **kwargs,
        **sampling,
        max_new_tokens=spec.max_new_tokens,
        repetition_penalty=spec.repetition_penalty,
        eos_token_id=list(stop_token_ids),
        pad_token_id=pad_token_id,
        use_cache=True,
        # never lock-step with other ranks: under FSDP the caller unshards first (`sharding.gathered`)
        synced_gpus=False,
    )
    new_tokens = out[:, longest:].tolist()  # (B, <= max_new_tokens)
    stops = set(stop_token_ids)
    results = []
    for row in new_tokens:
        cut = next((k for k, token in enumerate(row) if token in stops), None)
        if cut is None:
            results.append(Generation(token_ids=row[: spec.max_new_tokens], finish_reason="length"))
        else:
            results.append(Generation(token_ids=row[: cut + 1], finish_reason="stop"))
    return results
