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

from stagectl import dist
from stagectl.learner.loss import LossWeights, compute_loss
from stagectl.packing import PackedBatch, Segment, collate_pack, pack_segments, packing_lower_bound


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


@dataclass
class PackRunner:
    ddp_model: Any  # DistributedDataParallel or the bare model
    base_model: Any
    loss_weights: LossWeights
    coord_token_ids: torch.Tensor  # (1000,)
    packing_length: int
    device: torch.device

    def run_packs(
        self,
        packs: Sequence[Sequence[Segment]],
        *,
        segments_in_step: int,
        acc: StepAccumulator,
        sync_last: bool,
    ) -> None:
        """Collate and run each pack (one forward/backward per pack); `sync_last`: the last backward
        all-reduces gradients."""
        for k, pack in enumerate(packs):
            batch = collate_pack(pack, self.base_model)
            self.run_batch(
                batch, scale=len(pack) / segments_in_step, sync=sync_last and k == len(packs) - 1, acc=acc
            )
        lengths = [len(s) for pack in packs for s in pack]
        acc.lower_bound += packing_lower_bound(lengths, self.packing_length) if lengths else 0

    def run_batch(self, batch: PackedBatch, *, scale: float, sync: bool, acc: StepAccumulator) -> None:
        """One forward/backward of an already collated pack, loss scaled by `scale`."""
        batch = batch.to(self.device)
        no_sync = getattr(self.ddp_model, "no_sync", None)
        context = contextlib.nullcontext() if sync or no_sync is None else no_sync()
        allreduce = dist.collective("DDP gradient all-reduce") if sync else contextlib.nullcontext()
        with dist.phase("forward/backward", "step_s"), allreduce, context:
            logits = self.ddp_model(**batch.model_inputs()).logits  # (1, L, V)
            terms = compute_loss(
                logits.reshape(-1, logits.shape[-1]),
                batch.input_ids.reshape(-1),
                batch.ce_weights.reshape(-1),
                batch.coord_positions,
                batch.coord_targets,
                self.coord_token_ids,
                self.loss_weights,
            )
            (terms.total * scale).backward()
        acc.add_terms(terms.as_floats(), scale)
        acc.num_backward += 1
        acc.num_packs += 1
        acc.num_segments += len(batch.segment_lengths)
        acc.num_tokens += batch.num_tokens
        acc.capacity_tokens += self.packing_length
