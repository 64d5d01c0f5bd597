"""Per-request seeded sampling inside one batched `generate` call (hf engine).

transformers samples a whole batch from one global RNG, so a row's tokens would depend on which
other requests shared its batch. `PerRowSampler` is a logits processor that draws each row's next
token with that row's own `torch.Generator` (seeded with the request's seed) after temperature,
top-k and top-p, and then masks every other token; `generate` runs greedily and picks it. A request
therefore gets the same tokens alone or batched (up to floating-point effects of padding).

How a row draws (`sample_tokens`): one uniform u from its generator, then the token where the
cumulative probability of the kept tokens, best first, passes u. With top-p the nucleus is first
looked for among the row's `CANDIDATES` best tokens (one `topk` and one log-sum-exp over the
vocabulary); only a batch with a row whose nucleus is wider sorts the whole vocabulary. Both ways
give the same token, so the choice never changes a draw. Everything stays on the logits' device:
per step the host sends B uniforms, never a (B, V) tensor. Before this, a full sort, a copy of the
probabilities to the host and one `multinomial` per row took as long as the model's forward on the
tiny models (profiled in the hf server: 39% of the decode loop).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch
from transformers import LogitsProcessor

CANDIDATES = 64  # where a row's nucleus is looked for first (its best tokens, by logit)


def sample_tokens(
    scores: torch.Tensor,
    uniforms: torch.Tensor,
    temperature: float,
    top_p: float,
    top_k: int,
    *,
    candidates: int = CANDIDATES,
) -> torch.Tensor:
    """One token per row of `scores` (B, V) for `uniforms` (B,) in [0, 1): temperature, then top-k (k > 0:
    the k best and any tied with the k-th), then nucleus top-p (< 1: the fewest best tokens whose mass
    reaches top_p; the best token always stays), then inverse-CDF over the kept tokens. Returns (B,) ids.
    `candidates`: how many of each row's best tokens the nucleus is looked for among before a full sort
    (any value gives the same tokens, up to rounding; it only moves the cost)."""
    logits = scores.float() / temperature  # (B, V)
    # a row past float32's range (+inf, or NaN once the temperature itself rounds to 0): its limit, no host sync
    overflowed = (torch.isposinf(logits) | torch.isnan(logits)).any(dim=-1, keepdim=True)  # (B, 1)
    logits = torch.where(overflowed, _limit_logits(scores.float()), logits)
    vocab = logits.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p >= 1.0:  # every token with a finite logit, in vocabulary order
        probs = torch.softmax(logits, dim=-1)  # (B, V)
        order = None
    else:
        lse = torch.logsumexp(logits, dim=-1, keepdim=True)  # (B, 1)
        best, order = torch.topk(logits, min(candidates, vocab), dim=-1)  # (B, C) best first
        probs = torch.exp(best - lse)
        if not bool((probs.sum(-1) > top_p).all()):  # a nucleus wider than the candidates: sort it all
            best, order = torch.sort(logits, dim=-1, descending=True)  # (B, V)
            probs = torch.exp(best - lse)
        mass_before = torch.cumsum(probs, dim=-1) - probs  # (B, C) mass of strictly better tokens
        probs = probs.masked_fill(mass_before > top_p, 0.0)  # the top token stays (its mass_before is 0)
    cdf = torch.cumsum(probs, dim=-1)  # (B, C or V)
    target = uniforms.to(cdf.device, cdf.dtype).unsqueeze(-1) * cdf[:, -1:]  # (B, 1)
    pick = torch.searchsorted(cdf, target, right=True)  # the first column whose cdf passes the target
    # u * total can round up to the total: stay on the last kept column (argmax: the first at the maximum)
    pick = torch.minimum(pick, cdf.argmax(-1, keepdim=True))  # (B, 1)
    return (pick if order is None else order.gather(-1, pick)).squeeze(-1)


def _limit_logits(rows: torch.Tensor) -> torch.Tensor:
    """Logits of rows where `scores / temperature` reached +inf (or NaN): a temperature or a `repetition_penalty` (which
    divides a positive score by it) so small that a logit passes float32's range. softmax made such a row NaN
    and it drew token 0 whatever the scores (`!` for Qwen's tokenizer, every token of the answer). The row
    tends to its best tokens (the temperature is then far below any gap between scores): they stay at 0, the
    others go to -inf, so it draws its greedy token (ties shared evenly)."""
    best = rows.max(dim=-1, keepdim=True).values  # (R, 1)
    return torch.where(rows == best, 0.0, float("-inf"))


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
        uniforms = torch.cat([torch.rand(1, generator=gen) for gen in self.generators])  # (B,)
        chosen = sample_tokens(scores, uniforms, self.temperature, self.top_p, self.top_k)  # (B,)
        forced = torch.full_like(scores, float("-inf"))
        forced.scatter_(-1, chosen.unsqueeze(-1), 0.0)
        return forced  # type: ignore[return-value]
