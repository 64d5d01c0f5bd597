"""What `runner.engine` chooses: the backend the loop asks for answers (`Backend`: `judge` and `reflect`),
plus its plain data. Implementations: `engine_model.ModelBackend` (each rank's own copy of the model,
generating through the one inference engine, `engines.interface.Engine`), `engine_server.ServerBackend`
(rollouts from `stagectl rollout-server`s: it only sends the requests' `messages`) and
`engine_rules.RulesBackend` (a deterministic rule engine without a model, for dry runs and tests).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from stagectl.config.sampling import SamplingSpec
from stagectl.seeds import derive_seed
from stagectl.stage_b.guidance import Guidance
from stagectl.stage_b.prompts import Message, ReflectionRecord
from stagectl.stage_b.tickets import Ticket

if TYPE_CHECKING:
    from stagectl.dist import World  # dist imports torch; this module stays import-light


@dataclass(frozen=True)
class JudgeRequest:
    ticket: Ticket
    guidance: Guidance  # the snapshot rank 0 broadcast for this global batch
    messages: list[Message]  # the rendered rollout prompt (guidance + summaries, no label)
    batch_index: int  # global batch index over the whole run (for logs and fault injection)


@dataclass(frozen=True)
class ReflectRequest:
    guidance: Guidance
    records: list[ReflectionRecord]
    messages: list[Message]  # the rendered reflection prompt


class Backend(Protocol):
    """Where the loop's answers come from; the `model` backend runs an inference engine, the others do not."""

    def judge(self, requests: Sequence[JudgeRequest], spec: SamplingSpec, seed: int) -> list[str]:
        """One answer text per request, in request order."""
        ...

    def reflect(self, request: ReflectRequest, spec: SamplingSpec, seed: int) -> str:
        """The model's answer to the reflection prompt (expected: strict JSON operations)."""
        ...

    def close(self) -> None:
        """Release the engine's threads and connections (after its last call)."""
        ...


def rank_device(world: World, cuda_available: bool) -> str:
    """Every rank holds the whole model on its own device: `cuda:{local_rank}`, or the CPU."""
    return f"cuda:{world.local_rank}" if cuda_available else "cpu"


def candidate_seed(run_seed: int, entry_seed: int, sample_index: int, epoch: int, batch_index: int) -> int:
    """Seed of one decode: a stable function of its coordinates, independent of rank and world size."""
    return derive_seed(run_seed, entry_seed, sample_index, epoch, batch_index)
