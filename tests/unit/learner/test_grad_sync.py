"""Gradient accumulation under FSDP2 reduce-scatters after every micro-step (gradients stay sharded between
micro-steps; docs/precision_and_sharding.md has the measurement behind the choice)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as torch_dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from transformers.modeling_outputs import CausalLMOutput

from stagectl.collate import PackedBatch
from stagectl.config.plan_train import LossWeights
from stagectl.learner import sharding
from stagectl.learner.packs import PackRunner, StepAccumulator


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(1000, 1000)

    def forward(self, input_ids: torch.Tensor, **_: Any) -> CausalLMOutput:
        # a ModelOutput as transformers returns (FSDP2 hooks the backward through the output's tensors)
        return CausalLMOutput(logits=self.embed(input_ids))  # (1, L, V)


def _pack() -> PackedBatch:
    ids = torch.tensor([[1, 2, 3, 4]])
    return PackedBatch(
        input_ids=ids,
        position_ids=torch.arange(4).view(1, 4),
        attention_mask=None,
        mm_token_type_ids=torch.zeros_like(ids),
        pixel_values=None,
        image_grid_thw=None,
        ce_weights=torch.ones(1, 4),
        coord_positions=torch.zeros(0, 4, dtype=torch.long),
        coord_targets=torch.zeros(0, 4, dtype=torch.long),
        segment_starts=[0],
        segment_lengths=[4],
    )


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    torch_dist.init_process_group("gloo", rank=0, world_size=1, store=torch_dist.HashStore())
    yield
    torch_dist.destroy_process_group()


def test_fsdp_reduce_scatters_after_every_micro_step(one_rank_group: None) -> None:
    """The sharded gradient exists after the first micro-step already (kept whole instead, FSDP2 would
    hold it unsharded and leave `.grad` empty until the step's last micro-step)."""
    model = TinyLM()
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    assert sharding.is_sharded(model)
    runner = PackRunner(
        ddp_model=model,
        base_model=model,
        loss_weights=LossWeights(),
        coord_token_ids=torch.arange(1000),
        packing_length=4,
        device=torch.device("cpu"),
    )
    acc = StepAccumulator()
    runner.run_batch(_pack(), scale=0.5, sync=False, acc=acc)
    first = model.embed.weight.grad
    assert isinstance(first, DTensor)
    first = first.full_tensor().clone()
    runner.run_batch(_pack(), scale=0.5, sync=True, acc=acc)
    assert torch.allclose(model.embed.weight.grad.full_tensor(), 2 * first)  # accumulated on the shards
