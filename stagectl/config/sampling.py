"""`SamplingSpec`: how to sample, and how each config shape turns into one (no torch here: the wire format
imports it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stagectl.config.rollout import DecodingConfig, RolloutMatchingConfig
    from stagectl.config.stage_b import ReflectionConfig, SamplerEntry


@dataclass(frozen=True)
class SamplingSpec:
    """How to sample, the one type every generator takes (the in-process learner and Stage-B engines, the
    rollout server's engines); the wire's `RequestConfig` converts to and from it at the edge. The seed
    is not part of it: requests that differ only in their seed share one generate call. Built from a config
    in one place per config shape: `for_channel_b`, `for_eval`, `for_stage_b`."""

    max_new_tokens: int
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()  # stop strings (the server's engines; the in-process path stops on token ids)
    logprobs: bool = False  # also return each generated token's log-probability (raw model distribution)

    @classmethod
    def for_channel_b(cls, rm: RolloutMatchingConfig, *, logprobs: bool = False) -> SamplingSpec:
        """Channel-B rollouts, in process and from a server alike: `rollout_matching.decoding`, its rollout
        length and repetition penalty; `logprobs`: also each generated token's log-probability."""
        return cls._decoding(rm.decoding, rm, logprobs=logprobs)

    @classmethod
    def for_eval(cls, rm: RolloutMatchingConfig, decoding: DecodingConfig | None) -> SamplingSpec:
        """Eval rollouts: `data.eval.decoding` (None, without `data.eval`: greedy), with Channel-B's rollout
        length and repetition penalty; always with logprobs (the objects' scores)."""
        if decoding is None:
            from stagectl.config.rollout import DecodingConfig

            decoding = DecodingConfig(temperature=0.0)
        return cls._decoding(decoding, rm, logprobs=True)

    @classmethod
    def for_stage_b(cls, cfg: SamplerEntry | ReflectionConfig) -> SamplingSpec:
        """Stage-B: a judge candidate (`sampler.grid` entry: temperature, nucleus mass, length) or the
        reflection (`reflection`: temperature and length, no nucleus cut)."""
        from stagectl.config.stage_b import SamplerEntry

        top_p = cfg.top_p if isinstance(cfg, SamplerEntry) else 1.0
        return cls(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=top_p)

    @classmethod
    def _decoding(
        cls, decoding: DecodingConfig, rm: RolloutMatchingConfig, *, logprobs: bool
    ) -> SamplingSpec:
        return cls(
            max_new_tokens=rm.max_new_tokens,
            temperature=decoding.temperature,
            top_p=decoding.top_p,
            top_k=decoding.top_k,
            repetition_penalty=rm.repetition_penalty,
            logprobs=logprobs,
        )
