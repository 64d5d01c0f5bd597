"""Per-request seeded sampling inside one batched `generate` call (hf engine).

transformers samples a whole batch from one global RNG, so a row's tokens would depend on which
other requests shared its batch. `PerRowSampler` is a logits processor that draws each row's next
token from that row's own `torch.Generator` (seeded with the request's seed) after temperature,
top-k and top-p, and then masks every other token; `generate` runs greedily and picks it. A request
therefore gets the same tokens alone or batched (up to floating-point effects of padding).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch
from transformers import LogitsProcessor


def warp_logits(logits: torch.Tensor, temperature: float, top_p: float, top_k: int) -> torch.Tensor:
    """Temperature, then top-k (k > 0), then nucleus top-p (< 1); removed entries become -inf. (B, V)"""
    logits = logits.float() / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs  # (B, V) mass of strictly better tokens
        remove_sorted = mass_before > top_p  # the top token always stays (its mass_before is 0)
        remove = remove_sorted.scatter(-1, order, remove_sorted)
        logits = logits.masked_fill(remove, float("-inf"))
    return logits


class PerRowSampler(LogitsProcessor):
    def __init__(self, seeds: Sequence[int | None], temperature: float, top_p: float, top_k: int) -> None:
        if temperature <= 0:
            raise ValueError("PerRowSampler is for sampling (temperature > 0); decode greedily otherwise")
        self.generators = [
            torch.Generator().manual_seed(random.SystemRandom().getrandbits(63) if seed is None else seed)
            for seed in seeds
        ]
        self.temperature = temperature
        self.top_p = top_p
        self.top_k = top_k

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        # scores: (B, V) after transformers' own processors (repetition penalty)
        probs = torch.softmax(warp_logits(scores, self.temperature, self.top_p, self.top_k), dim=-1).cpu()
        chosen = torch.stack(
            [torch.multinomial(probs[row], 1, generator=gen) for row, gen in enumerate(self.generators)]
        )  # (B, 1)
        forced = torch.full_like(scores, float("-inf"))
        forced.scatter_(-1, chosen.to(scores.device), 0.0)
        return forced  # type: ignore[return-value]
