"""Forward/backward over packed micro-batches with gradient accumulation.

Each pack's loss is a mean over its own tokens/boxes; it is scaled by the pack's share of the step's
segments, so the step's gradient is a segment-weighted mean however the segments were packed. DDP
gradient all-reduce happens only on the last backward of the optimizer step (`no_sync` elsewhere); FSDP2
reduce-scatters after every backward, so gradients stay sharded between micro-steps.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass, field
from typing import Any

import torch

from stagectl import dist
from stagectl.collate import PackedBatch
from stagectl.config.plan_train import LossWeights
from stagectl.learner import sharding
from stagectl.learner.fused_loss import compute_loss_from_hidden
from stagectl.learner.loss import LossTerms, compute_loss, loss_rows
from stagectl.learner.precision import Precision
from stagectl.learner.samples import SampleRecord
from stagectl.timing import PhaseTimer


def takes_logits_to_keep(model: Any) -> bool:
    """Whether `model.forward` can compute logits for chosen positions (transformers' causal LMs can; a
    model wrapped by peft forwards the keyword to its base)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return _forward_takes(type(base), "logits_to_keep")


_TAKES: dict[tuple[type, str], bool] = {}


def _forward_takes(cls: type, name: str) -> bool:
    if (cls, name) not in _TAKES:
        _TAKES[cls, name] = name in inspect.signature(cls.forward).parameters  # type: ignore[attr-defined]
    return _TAKES[cls, name]


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
    samples: list[SampleRecord] = field(default_factory=list)  # what was trained: `samples.jsonl`

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
    fused_linear_cross_entropy: bool = False  # training.kernels: the LM head applied inside the loss

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
            # FSDP2 all-gathers in every forward and reduce-scatters after every backward: gradients stay
            # sharded between micro-steps (kept whole instead, every rank would hold the whole model's
            # float32 gradients; measured: docs/precision_and_sharding.md)
            allreduce = dist.collective("FSDP2 all-gather / reduce-scatter")
        else:
            allreduce = dist.collective("DDP gradient all-reduce") if sync else contextlib.nullcontext()
        autocast = self.precision.autocast(self.device, enabled=not sharded)  # fsdp casts by its policy
        with dist.phase("forward/backward", "step_s"), allreduce, context:
            if self.fused_linear_cross_entropy:
                with autocast:
                    terms = self._fused_loss(batch)
            else:
                terms = self._loss(batch, autocast)
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

    def _loss(self, batch: PackedBatch, autocast: contextlib.AbstractContextManager[Any]) -> LossTerms:
        inputs = batch.model_inputs()
        rows = None
        if batch.input_ids.shape[0] == 1 and takes_logits_to_keep(self.base_model):
            # the LM head on the supervised rows only: (L, V) float32 logits would be GBs at 4096 x 152k
            rows = loss_rows(batch.ce_weights, batch.coord_positions)
            inputs["logits_to_keep"] = rows
        with autocast:
            logits = self.ddp_model(**inputs).logits  # (1, K, V), or (B, L, V)
        return compute_loss(
            logits.reshape(-1, logits.shape[-1]),
            batch.input_ids.reshape(-1),
            batch.ce_weights.reshape(-1),
            batch.coord_positions,
            batch.coord_targets,
            self.coord_token_ids,
            self.loss_weights,
            rows=rows,
        )

    def _fused_loss(self, batch: PackedBatch) -> LossTerms:
        """The model's final hidden states, the LM head applied inside the loss (`fused_loss`)."""
        if not takes_logits_to_keep(self.base_model):
            raise ValueError(
                "training.kernels.fused_linear_cross_entropy: this model's forward cannot skip its LM head "
                "(no logits_to_keep); turn the key off"
            )
        base = (
            self.base_model.get_base_model()
            if hasattr(self.base_model, "get_base_model")
            else self.base_model
        )
        head = base.get_output_embeddings()
        if getattr(head, "bias", None) is not None:
            raise ValueError(
                "training.kernels.fused_linear_cross_entropy: the LM head has a bias; turn the key off"
            )
        inputs = batch.model_inputs()
        # the head on no row inside the forward; the last hidden state is the final norm's output
        inputs["logits_to_keep"] = torch.empty(0, dtype=torch.long, device=self.device)
        inputs["output_hidden_states"] = True
        hidden = self.ddp_model(**inputs).hidden_states[-1]  # (B, L, H)
        return compute_loss_from_hidden(
            hidden.reshape(-1, hidden.shape[-1]),
            head.weight,
            batch.input_ids.reshape(-1),
            batch.ce_weights.reshape(-1),
            batch.coord_positions,
            batch.coord_targets,
            self.coord_token_ids,
            self.loss_weights,
        )
