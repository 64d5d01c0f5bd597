"""Forward/backward over packed micro-batches with gradient accumulation.

Each pack's loss is a mean over its own tokens/boxes; it is scaled by the pack's share of the step's
segments, so the step's gradient is a segment-weighted mean however the segments were packed. DDP
gradient all-reduce happens only on the last backward of the optimizer step (`no_sync` elsewhere).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from stagectl.learner.loss import LossWeights, compute_loss
from stagectl.packing import PackedBatch, Segment, collate_pack, pack_segments, packing_stats


@dataclass
class StepAccumulator:
    """Loss terms and packing counters summed over the packs of one optimizer step (this rank)."""

    terms: dict[str, float] = field(default_factory=dict)
    num_packs: int = 0
    num_segments: int = 0
    num_tokens: int = 0
    lower_bound: int = 0
    capacity_tokens: int = 0
    num_backward: int = 0

    def add_terms(self, values: dict[str, float], scale: float) -> None:
        for key, value in values.items():
            self.terms[key] = self.terms.get(key, 0.0) + value * scale


def make_packs(segments: Sequence[Segment], packing_length: int) -> list[list[Segment]]:
    """Best-fit-decreasing packs of `segments` (each pack at most `packing_length` tokens)."""
    groups = pack_segments([len(s) for s in segments], packing_length)
    return [[segments[i] for i in group] for group in groups]


def run_packs(
    ddp_model: Any,
    packs: Sequence[Sequence[Segment]],
    *,
    base_model: Any,
    segments_in_step: int,
    loss_weights: LossWeights,
    coord_token_ids: torch.Tensor,
    packing_length: int,
    acc: StepAccumulator,
    sync_last: bool,
    device: torch.device,
) -> None:
    """One forward/backward per pack. `sync_last`: the final backward all-reduces gradients."""
    lengths = [len(s) for pack in packs for s in pack]
    stats = packing_stats(lengths, _index_groups([len(p) for p in packs]), packing_length) if packs else None
    for k, pack in enumerate(packs):
        batch: PackedBatch = collate_pack(pack, base_model).to(device)
        sync = sync_last and k == len(packs) - 1
        context = (
            contextlib.nullcontext() if sync or not hasattr(ddp_model, "no_sync") else ddp_model.no_sync()
        )
        with context:
            logits = ddp_model(**batch.model_inputs()).logits  # (1, L, V)
            terms = compute_loss(
                logits.reshape(-1, logits.shape[-1]),
                batch.input_ids.reshape(-1),
                batch.ce_weights.reshape(-1),
                batch.coord_positions,
                batch.coord_targets,
                coord_token_ids,
                loss_weights,
            )
            scale = len(pack) / segments_in_step
            (terms.total * scale).backward()
        acc.add_terms(terms.as_floats(), scale)
        acc.num_backward += 1
    if stats is not None:
        acc.num_packs += stats.num_packs
        acc.num_segments += stats.num_segments
        acc.num_tokens += stats.num_tokens
        acc.lower_bound += stats.lower_bound
        acc.capacity_tokens += stats.num_packs * packing_length


def _index_groups(sizes: Sequence[int]) -> list[list[int]]:
    """[2, 3] -> [[0, 1], [2, 3, 4]]: pack membership over the flattened segment list."""
    groups, start = [], 0
    for size in sizes:
        groups.append(list(range(start, start + size)))
        start += size
    return groups
