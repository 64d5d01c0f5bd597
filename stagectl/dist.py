"""The process group: `World` (rank, local rank, world size read once), init/teardown, and the few
collectives stagectl uses (rank-0 broadcast, gather, all-reduce MIN/SUM, barrier).

Fail-fast: every collective runs under `launch.dist_timeout_s`, and torchrun ends every rank as soon as
one rank exits non-zero, so an error on one rank can never leave the others waiting forever.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


@dataclass(frozen=True)
class World:
    rank: int
    local_rank: int
    world_size: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def read_world() -> World:
    """Read torchrun's environment once (a single process when it is absent)."""
    return World(
        rank=int(os.environ.get("RANK", "0")),
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        world_size=int(os.environ.get("WORLD_SIZE", "1")),
    )


def device_for(world: World) -> torch.device:
    if torch.cuda.is_available():
        torch.cuda.set_device(world.local_rank)
        return torch.device("cuda", world.local_rank)
    return torch.device("cpu")


def init_distributed(world: World, timeout_s: float) -> None:
    """Start the process group (gloo on CPU, nccl on GPU) when running under torchrun."""
    if not world.distributed or dist.is_initialized():
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))


def teardown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def broadcast_object(obj: T, src: int = 0) -> T:
    """Rank `src`'s `obj` on every rank (plain picklable data only, never tensors)."""
    if not _active():
        return obj
    box: list[Any] = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def gather_objects(obj: T) -> list[T] | None:
    """Every rank's `obj` on rank 0 (in rank order); None on other ranks."""
    if not _active():
        return [obj]
    rank = dist.get_rank()
    out: list[Any] | None = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def all_gather_objects(obj: T) -> list[T]:
    """Every rank's `obj` on every rank (in rank order)."""
    if not _active():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def all_reduce_ints(values: list[int], op: str) -> list[int]:
    """Element-wise `min`, `max` or `sum` of an integer vector over all ranks."""
    if not _active():
        return list(values)
    ops = {"min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX, "sum": dist.ReduceOp.SUM}
    tensor = torch.tensor(values, dtype=torch.int64, device=_collective_device())
    dist.all_reduce(tensor, op=ops[op])
    return [int(v) for v in tensor.tolist()]


def all_reduce_int(value: int, op: str) -> int:
    """`min`, `max` or `sum` of an integer over all ranks."""
    if not _active():
        return value
    ops = {"min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX, "sum": dist.ReduceOp.SUM}
    tensor = torch.tensor([value], dtype=torch.int64, device=_collective_device())
    dist.all_reduce(tensor, op=ops[op])
    return int(tensor.item())


def all_reduce_floats(values: list[float]) -> list[float]:
    """Element-wise sum of a float vector over all ranks."""
    if not _active():
        return values
    tensor = torch.tensor(values, dtype=torch.float64, device=_collective_device())
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return [float(v) for v in tensor.tolist()]


def barrier() -> None:
    if _active():
        dist.barrier()


def _collective_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
