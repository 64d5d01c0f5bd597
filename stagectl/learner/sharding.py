"""How the trainable model is spread over the learner ranks: DDP (replicated) or FSDP2 (sharded).

FSDP2 (`torch.distributed.fsdp.fully_shard`) is applied as torchtitan does: one `fully_shard` per
transformer block (decoder layers and vision blocks, `learner.parts.transformer_blocks`), then one on the
root for what is left (embeddings, lm_head, norms, the patch embedding and merger). Parameters become
DTensors sharded on dim 0 over the ranks; the optimizer is built after sharding, so AdamW state is
sharded too. Mixed precision is FSDP2's `MixedPrecisionPolicy`: gathered parameters are cast to the
compute dtype, gradients reduce-scattered in float32 onto float32 shards.

Every rank must run the same number of forward/backward passes (each forward all-gathers): Channel-A
runs `gas` micro-batches per rank and async Channel-B exactly `gas` packs per rank, so they do.

Whole tensors leave the shards four ways, each a collective every rank joins:
- `full_tensors`: one full tensor at a time (the final weight digest);
- `GatheredStream`: the same as a `TensorStream` a weight sync sends as it arrives (rank 0's extra memory
  during a sync is a tensor or a chunk, not the model);
- `full_state_dict`: everything on the CPU of the rank that keeps it (checkpoints' `model/`, a delta sync);
- `gathered`: every parameter unsharded in place until the block ends (rank 0 can then generate on its
  own, e.g. the held-out eval, without a collective per forward).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from stagectl.learner.parts import transformer_blocks
from stagectl.learner.precision import Precision
from stagectl.weightsync.wire import TensorStream
from stagectl.wire.protocol import TensorSpec, dtype_name


def shard(model: nn.Module, precision: Precision, device: torch.device, world_size: int) -> None:
    """`fully_shard` each transformer block, then the root, in place."""
    mesh = init_device_mesh(device.type, (world_size,))
    policy = MixedPrecisionPolicy(
        param_dtype=precision.compute_dtype,
        reduce_dtype=torch.float32 if precision.compute_dtype is not None else None,
    )
    for block in transformer_blocks(model):
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)


def shard_from_rank0(
    model: nn.Module, precision: Precision, device: torch.device, world_size: int, *, is_main: bool
) -> None:
    """`shard` a model that only rank 0 loaded: the other ranks built it on the meta device
    (`load_bundle(on_meta=True)`), so a rank's peak while loading is its shards, not the whole model.
    Rank 0 keeps its whole state dict until every rank has its shards from it (one broadcast per
    tensor); buffers (rotary frequencies, which meta ranks never computed) are broadcast as they are."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    whole = model.state_dict() if is_main else {}
    shard(model, precision, device, world_size)
    if not is_main:
        model.to_empty(device=device)  # storage for this rank's shards and the buffers, values next
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, whole, options=options)
    del whole
    for buffer in model.buffers():
        torch.distributed.broadcast(buffer, src=0)


def is_sharded(model: nn.Module) -> bool:
    return isinstance(model, FSDPModule)


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor (a collective: every rank calls it); any other tensor as it is."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def full_tensors(model: nn.Module, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, whole CPU tensor) for every entry of the model's state dict, in order, converted to `dtype`
    when given. Every rank must iterate to the end (each tensor is an all-gather); one tensor is held
    whole at a time unless the caller keeps it."""
    for name, tensor in model.state_dict().items():
        whole = full_tensor(tensor.detach())
        yield name, whole.to("cpu", dtype=dtype) if dtype is not None else whole.to("cpu")


def full_state_dict(
    model: nn.Module, dtype: torch.dtype | None = None, *, keep: bool = True
) -> dict[str, torch.Tensor]:
    """Every tensor whole on the CPU (a collective). Ranks that pass `keep=False` join the gathers and
    drop each tensor at once (they get `{}`), so only the rank that uses it holds the model."""
    out: dict[str, torch.Tensor] = {}
    for name, whole in full_tensors(model, dtype):
        if keep:
            out[name] = whole
    return out


class GatheredStream:
    """The model's state dict whole, one tensor at a time, each an all-gather of its shards: every rank
    must take every tensor, in order, exactly once per stream. Rank 0 hands `stream()` to a push (which
    may stop early on a failure, and may take tensors on a read-ahead thread); every rank then calls
    `drain()`, which takes what is left (waiting for a take in flight on another thread), so the ranks'
    all-gathers always pair up. Ranks that do not keep the tensors (`keep=False`) drop each at once."""

    def __init__(self, model: nn.Module, dtype: torch.dtype | None = None, *, keep: bool = True) -> None:
        self.dtype = dtype
        self.keep = keep
        state = model.state_dict()
        self.specs = {
            name: TensorSpec(tuple(t.shape), dtype_name(dtype if dtype is not None else t.dtype))
            for name, t in state.items()
        }
        self._items = iter(state.items())
        self._lock = threading.Lock()  # one take at a time, whichever thread takes

    def _take(self) -> tuple[str, torch.Tensor] | None:
        with self._lock:
            item = next(self._items, None)
            if item is None:
                return None
            name, tensor = item
            local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
            # a read-ahead thread starts on cuda:0 whatever this rank's device: gather on the shard's own
            on_device = torch.cuda.device(local.device) if local.is_cuda else contextlib.nullcontext()
            with on_device:
                whole = full_tensor(tensor.detach())
            if not self.keep:
                return name, whole
            return name, whole.to("cpu", dtype=self.dtype) if self.dtype is not None else whole.to("cpu")

    def _tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        while (item := self._take()) is not None:
            yield item

    def stream(self) -> TensorStream:
        return TensorStream(dict(self.specs), self._tensors())

    def drain(self) -> None:
        while self._take() is not None:
            pass


@contextlib.contextmanager
def gathered(model: nn.Module) -> Iterator[None]:
    """Every FSDP module unsharded until the block ends and kept so across forwards (a collective on
    entry and exit); a no-op for an unsharded model."""
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not modules:
        yield
        return
    for module in modules:
        module.set_reshard_after_forward(False, recurse=False)
        module.unshard()
    try:
        yield
    finally:
        for module in modules:
            module.reshard()
            module.set_reshard_after_forward(True, recurse=False)


def sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """`{"model": ..., "optim": ...}` as sharded state dicts for torch.distributed.checkpoint."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optim": optim_state}


def load_sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer, path: str) -> None:
    """Load a `torch.distributed.checkpoint` directory written from `sharded_state` (every rank)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    state = sharded_state(model, optimizer)
    # A parameter that never had a gradient has no AdamW state in the checkpoint, while the fresh
    # optimizer's template has one for every trainable parameter: those entries are left as they are.
    dcp.load(state, checkpoint_id=path, planner=DefaultLoadPlanner(allow_partial_load=True))
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
        options=StateDictOptions(strict=False),
    )
