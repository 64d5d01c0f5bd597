"""The every-rank half of a global batch: judge this rank's shard of tickets under one guidance snapshot."""

from __future__ import annotations

from collections.abc import Sequence

from stagectl.config.plan_stage_b import SamplerPlan
from stagectl.stage_b.engine import Backend, JudgeRequest, candidate_seed
from stagectl.stage_b.guidance import Guidance
from stagectl.stage_b.prompts import rollout_messages
from stagectl.stage_b.rows import Candidate
from stagectl.stage_b.tickets import Ticket


def judge_shard(
    engine: Backend,
    tickets: Sequence[Ticket],
    first: int,
    guidance: Guidance,
    *,
    mission: str,
    sampler: SamplerPlan,
    run_seed: int,
    rank: int,
    epoch: int,
    batch_index: int,
) -> list[Candidate]:
    """Every candidate of this rank's shard (`tickets`, at `first` inside the global batch):
    `sampler.grid` x `samples_per_decode` per ticket, seeded by `candidate_seed`."""
    requests = [
        JudgeRequest(ticket, guidance, rollout_messages(guidance, ticket, mission), batch_index)
        for ticket in tickets
    ]
    out: list[Candidate] = []
    if not requests:
        return out
    for grid_index, entry in enumerate(sampler.grid):
        for sample_index in range(sampler.samples_per_decode):
            seed = candidate_seed(run_seed, entry.seed, sample_index, epoch, batch_index)
            texts = engine.judge(requests, entry.spec, seed)
            if len(texts) != len(requests):
                raise RuntimeError(f"the engine answered {len(texts)} of {len(requests)} requests")
            out += [
                Candidate(first + k, grid_index, sample_index, seed, rank, text)
                for k, text in enumerate(texts)
            ]
    return out
