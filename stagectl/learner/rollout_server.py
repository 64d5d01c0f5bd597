"""Server-mode rollouts (`rollout_backend: vllm`, `vllm.mode: server`): the learner asks rollout
servers over the section-6 protocol. Every HTTP call is made inside the sync fence, so a weight sync
never overlaps a rollout call from this process; each chunk is tagged with the weight version the
server reports having used (the oldest one in the chunk)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from stagectl.config.rollout import RolloutMatchingConfig
from stagectl.learner.segments import SampleEncoder
from stagectl.models.corpus import DETECTION_INSTRUCTION
from stagectl.models.generate import Generation
from stagectl.prefetch.fence import SyncFence
from stagectl.rollout.client import RolloutClient, to_generation
from stagectl.rollout.protocol import ContentItem, InferRequest, Message, RequestConfig


@dataclass(frozen=True)
class VersionedRollouts:
    generations: list[Generation]
    ver: int  # the oldest weight version that produced any of them (-1 if the server did not say)


class ServerRollouts:
    def __init__(
        self,
        client: RolloutClient,
        encoder: SampleEncoder,
        rm: RolloutMatchingConfig,
        chunk_size: int,
        fence: SyncFence,
    ) -> None:
        self.client = client
        self.encoder = encoder
        self.chunk_size = chunk_size
        self.fence = fence
        top_k = rm.decoding.top_k or None
        self.base_config = RequestConfig(
            max_tokens=rm.max_new_tokens,
            temperature=rm.decoding.temperature,
            top_p=rm.decoding.top_p,
            top_k=top_k,
            repetition_penalty=rm.repetition_penalty,
            return_details=True,
        )
        self.num_calls = 0

    def request_for(self, index: int) -> InferRequest:
        sample = self.encoder.samples[index]
        content = [ContentItem(type="image") for _ in sample.images]
        content.append(ContentItem(type="text", text=DETECTION_INSTRUCTION))
        return InferRequest(messages=[Message(role="user", content=content)], images=list(sample.images))

    def rollout_versioned(self, indices: Sequence[int], seed: int) -> VersionedRollouts:
        generations: list[Generation] = []
        versions: list[int] = []
        for start in range(0, len(indices), self.chunk_size):
            chunk = indices[start : start + self.chunk_size]
            config = self.base_config.model_copy(update={"seed": (seed + start) % 2**31})
            with self.fence.call():
                responses = self.client.infer([self.request_for(i) for i in chunk], config)
            self.num_calls += 1
            for response in responses:
                generations.append(to_generation(response))
                versions.append(-1 if response.version is None else response.version)
        return VersionedRollouts(generations, min(versions) if versions else -1)

    def rollout(self, indices: Sequence[int], seed: int) -> list[Generation]:
        return self.rollout_versioned(indices, seed).generations
