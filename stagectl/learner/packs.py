"""Forward/backward over packed micro-batches with gradient accumulation.

Each pack's loss is a mean over its own tokens/boxes; it is scaled by the pack's share of the step's
segments, so the step's gradient is a segment-weighted mean however the segments were packed. DDP
gradient all-reduce happens only on the last backward of the optimizer step (`no_sync` elsewhere).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch

from stagectl import dist
from stagectl.collate import PackedBatch
from stagectl.learner import sharding
from stagectl.learner.loss import LossWeights, compute_loss
from stagectl.learner.precision import Precision
from stagectl.timing import PhaseTimer


@dataclass
class StepAccumulator:
    """Loss terms and packing counters summed over the packs of one optimizer step (this rank)."""

    terms: dict[str, float] = field(default_factory=dict)
    num_packs: int = 0
    num_segments: int = 0
    num_tokens: int = 0
    segment_lengths: list[int] = field(default_factory=list)
    capacity_tokens: int = 0
    num_backward: int = 0
    min_fill: float = 1.0  # the emptiest micro-batch of the step (tokens / its capacity)

    def add_terms(self, values: dict[str, float], scale: float) -> None:
        for key, value in values.items():
            self.terms[key] = self.terms.get(key, 0.0) + value * scale


@dataclass
class PackRunner:
    ddp_model: Any  # DistributedDataParallel or the bare model
    base_model: Any
    loss_weights: LossWeights
    coord_token_ids: torch.Tensor  # (1000,)
    packing_length: int
    device: torch.device
    precision: Precision = field(default_factory=lambda: Precision(torch.float32, None, torch.float32, False))
    grad_scaler: torch.amp.GradScaler | None = None
    timer: PhaseTimer = field(default_factory=PhaseTimer)  # the step's phase seconds (forward_backward here)

    def run_batch(self, batch: PackedBatch, *, scale: float, sync: bool, acc: StepAccumulator) -> None:
        """One forward/backward of an already collated pack, loss scaled by `scale`."""
        with self.timer.time("forward_backward"):
            self._run_batch(batch, scale=scale, sync=sync, acc=acc)

    def _run_batch(self, batch: PackedBatch, *, scale: float, sync: bool, acc: StepAccumulator) -> None:
        batch = batch.to(self.device)
        sharded = sharding.is_sharded(self.ddp_model)
        no_sync = getattr(self.ddp_model, "no_sync", None)
        context = contextlib.nullcontext() if sync or no_sync is None else no_sync()
        allreduce: contextlib.AbstractContextManager[Any]
        if sharded:
            # FSDP2 all-gathers in every forward; gradients reduce-scatter on the last micro-step only
            sharding.set_gradient_sync(self.ddp_model, sync)
            allreduce = dist.collective("FSDP2 all-gather / reduce-scatter")
        else:
            allreduce = dist.collective("DDP gradient all-reduce") if sync else contextlib.nullcontext()
        autocast = self.precision.autocast(self.device, enabled=not sharded)  # fsdp casts by its policy
        with dist.phase("forward/backward", "step_s"), allreduce, context:
            with autocast:
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
            loss = terms.total * scale
            (self.grad_scaler.scale(loss) if self.grad_scaler is not None else loss).backward()
        # a pack's capacity is packing_length; a padded batch's is its padded size
        capacity = self.packing_length if batch.attention_mask is None else int(batch.input_ids.numel())
        acc.add_terms(terms.as_floats(), scale)
        acc.num_backward += 1
        acc.num_packs += 1
        acc.num_segments += len(batch.segment_lengths)
        acc.segment_lengths += batch.segment_lengths
        acc.num_tokens += batch.num_tokens
        acc.capacity_tokens += capacity
        acc.min_fill = min(acc.min_fill, batch.num_tokens / capacity)
