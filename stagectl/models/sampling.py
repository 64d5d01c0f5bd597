"""`SamplingSpec`: how to sample (no torch here: the wire format and the config import it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingSpec:
    """How to sample, the one type every generator takes (the in-process learner and Stage-B engines, the
    rollout server's engines); the wire's `RequestConfig` converts to and from it at the edge. The seed
    is not part of it: requests that differ only in their seed share one generate call."""

    max_new_tokens: int
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()  # stop strings (the server's engines; the in-process path stops on token ids)
    logprobs: bool = False  # also return each generated token's log-probability (raw model distribution)
