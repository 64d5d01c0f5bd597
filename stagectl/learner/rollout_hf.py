"""In-process rollouts (`rollout_backend: hf`): the learner's own model generates in chunks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from stagectl.config.rollout import RolloutMatchingConfig
from stagectl.learner.segments import SampleEncoder
from stagectl.models.generate import Generation, SamplingSpec, generate_batch


class HFRollouts:
    """Generates with the (unwrapped) policy in eval mode, `chunk_size` samples per `generate` call."""

    def __init__(
        self, model: Any, encoder: SampleEncoder, rm: RolloutMatchingConfig, chunk_size: int
    ) -> None:
        self.model = model
        self.encoder = encoder
        self.chunk_size = chunk_size
        self.spec = SamplingSpec(
            max_new_tokens=rm.max_new_tokens,
            temperature=rm.decoding.temperature,
            top_p=rm.decoding.top_p,
            top_k=rm.decoding.top_k,
            repetition_penalty=rm.repetition_penalty,
        )
        self.num_calls = 0
        tokenizer = encoder.bundle.tokenizer
        self.pad_token_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)

    def rollout(self, indices: Sequence[int], seed: int) -> list[Generation]:
        was_training = self.model.training
        self.model.eval()
        try:
            out: list[Generation] = []
            for chunk_index, start in enumerate(range(0, len(indices), self.chunk_size)):
                chunk = indices[start : start + self.chunk_size]
                prompts = [self.encoder.prompt_inputs(i) for i in chunk]
                out += generate_batch(
                    self.model,
                    prompts,
                    self.spec,
                    stop_token_ids=sorted(self.encoder.vocab.stop_ids),
                    pad_token_id=self.pad_token_id,
                    seed=seed + chunk_index,
                )
                self.num_calls += 1
            return out
        finally:
            self.model.train(was_training)
