"""Precision of the learner: which dtype parameters are kept in, which dtype computes, and the lost-update
probe that makes a silent precision failure visible.

- Master weights and AdamW state are float32 (`param_dtype`), unless the user opted into training the
  stored dtype directly (`training.allow_low_precision_params`).
- Compute follows `training.mixed_precision`: under ddp an autocast region around forward (backward
  follows it), so gradients land in float32 on float32 parameters and are all-reduced in float32; under
  fsdp FSDP2's `MixedPrecisionPolicy` casts the gathered parameters instead (see `learner.sharding`).
- fp16 adds torch's dynamic loss scaler (bf16 has float32's exponent range and needs none).
- `model.torch_dtype` is the storage dtype: what checkpoints' `model/` and weight syncs carry.

`UpdateProbe` answers "did the optimizer step actually move the weights?": the share of trainable elements
whose value changed. AdamW on bf16 parameters at lr 1e-5 leaves most elements bit-identical (the update is
below bf16's spacing); float32 masters move nearly every element that got a gradient.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal, cast

import torch
from torch.distributed.tensor import DTensor

from stagectl.config.model_data import ModelConfig
from stagectl.config.training import TrainingConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Precision:
    param_dtype: torch.dtype  # the trainable (master) parameters and the optimizer state
    compute_dtype: torch.dtype | None  # forward/backward; None: the parameters' own dtype
    storage_dtype: torch.dtype  # checkpoints' model/ and weight syncs
    loss_scaling: bool  # fp16 compute: dynamic loss scaler

    @classmethod
    def from_config(cls, model: ModelConfig, training: TrainingConfig) -> Precision:
        """`model.torch_dtype` (storage), `training.mixed_precision` and `training.allow_low_precision_params`."""
        storage = DTYPES[model.torch_dtype]
        mixed = training.mixed_precision
        low = training.allow_low_precision_params
        return cls(
            param_dtype=storage if low else torch.float32,
            compute_dtype=COMPUTE_DTYPES.get(mixed),
            storage_dtype=storage,
            loss_scaling=mixed == "fp16",
        )

    @property
    def param_dtype_name(self) -> Literal["float32", "bfloat16", "float16"]:
        for name, dtype in DTYPES.items():
            if dtype == self.param_dtype:
                return cast(Literal["float32", "bfloat16", "float16"], name)
        raise AssertionError(f"no storage name for {self.param_dtype}")

    @contextlib.contextmanager
    def autocast(self, device: torch.device, enabled: bool = True) -> Iterator[None]:
        """Autocast to the compute dtype (ddp); a no-op without mixed precision or when `enabled` is
        False (fsdp casts through its policy)."""
        if self.compute_dtype is None or not enabled:
            yield
            return
        with torch.autocast(device_type=device.type, dtype=self.compute_dtype):
            yield

    def grad_scaler(self, device: torch.device) -> torch.amp.GradScaler | None:
        return torch.amp.GradScaler(device.type) if self.loss_scaling else None


class UpdateProbe:
    """Share of trainable elements changed by one optimizer step, on a fixed strided sample of each
    tensor (at most `sample_per_tensor` elements; the whole tensor when it is smaller). Under FSDP each
    rank probes its own shard; the loop sums the counts over ranks.

    Cost: one copy of the sample before the step and one comparison after (measured in BENCHMARKS.md)."""

    def __init__(self, params: list[torch.nn.Parameter], sample_per_tensor: int = 1 << 16) -> None:
        self.params = params
        self.sample_per_tensor = sample_per_tensor
        self._before: list[torch.Tensor] = []

    def _views(self) -> list[torch.Tensor]:
        """Every `stride`-th element of each tensor by its *global* flat index, so ddp and fsdp (whose
        ranks each hold a dim-0 shard) probe the same elements."""
        views = []
        for param in self.params:
            stride = max(1, param.numel() // self.sample_per_tensor)  # numel() is global for a DTensor
            local, offset = _local_and_offset(param.detach())
            flat = local.reshape(-1)
            views.append(flat[(-offset) % stride :: stride])
        return views

    def before_step(self) -> None:
        self._before = [view.clone() for view in self._views()]

    def after_step(self) -> tuple[int, int]:
        """(changed elements, sampled elements) of this rank since `before_step`."""
        changed = sampled = 0
        for before, after in zip(self._before, self._views(), strict=True):
            changed += int((before != after).sum())
            sampled += before.numel()
        self._before = []
        return changed, sampled


def _local_and_offset(tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
    """This rank's part of `tensor` and the global flat index of its first element (FSDP2 shards a
    DTensor on dim 0; any other tensor is whole: offset 0)."""
    if not isinstance(tensor, DTensor):
        return tensor, 0
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, global_offset = compute_local_shape_and_global_offset(
        tensor.shape, tensor.device_mesh, tensor.placements
    )
    row_numel = 1
    for dim in tensor.shape[1:]:
        row_numel *= dim
    return tensor.to_local(), int(global_offset[0]) * row_numel if global_offset else 0
