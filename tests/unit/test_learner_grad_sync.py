"""`training.fsdp_gradient_sync` reaches FSDP2: with `micro_step` every backward of a step reduce-scatters,
with `step` only the last one does (the gradients stay whole in between)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from stagectl.collate import PackedBatch
from stagectl.learner import sharding
from stagectl.learner.loss import LossWeights
from stagectl.learner.packs import PackRunner, StepAccumulator


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(1000, 1000)

    def forward(self, input_ids: torch.Tensor, **_: Any) -> SimpleNamespace:
        return SimpleNamespace(logits=self.embed(input_ids))  # (1, L, V)


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


@pytest.mark.parametrize(("every", "expected"), [(True, [True, True, True]), (False, [False, False, True])])
def test_the_gradient_sync_choice_reaches_every_micro_step(
    monkeypatch: pytest.MonkeyPatch, every: bool, expected: list[bool]
) -> None:
    calls: list[bool] = []
    monkeypatch.setattr(sharding, "is_sharded", lambda model: True)
    monkeypatch.setattr(sharding, "set_gradient_sync", lambda model, sync: calls.append(sync))
    model = TinyLM()
    runner = PackRunner(
        ddp_model=model,
        base_model=model,
        loss_weights=LossWeights(),
        coord_token_ids=torch.arange(1000),
        packing_length=4,
        device=torch.device("cpu"),
        reduce_every_micro_step=every,
    )
    acc = StepAccumulator()
    for k in range(3):
        runner.run_batch(_pack(), scale=1 / 3, sync=k == 2, acc=acc)
    assert calls == expected and acc.num_backward == 3
    assert model.embed.weight.grad is not None
