"""The weight group of `transport: collective`: the learner (rank 0, the store's host) and every rollout
server (ranks 1..n) in one torch.distributed process group of their own, outside the learner's training
group; a sync is one broadcast per tensor from rank 0, in the order the learner announced.

Backend `gloo` (implemented): TCP, host memory; any engine, the bytes land in the server's host staging as
with `http`. Backend `nccl` is the GPU path (docs/weight_sync.md): the same control flow, but the engine's
workers must join through vLLM's weight-transfer API; it is refused by the config until that is built.
Both sides build the group with the same `GroupInfo` (the learner sends it to each server in
`POST /update_weights/group/init/`), and the group's timeout bounds every collective, so a peer that dies
mid-broadcast ends the others' wait with an error instead of a hang.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist


class GroupError(RuntimeError):
    """The weight group could not form, or a collective in it failed or timed out."""


@dataclass(frozen=True)
class GroupInfo:
    master_address: str
    master_port: int
    rank: int
    world_size: int
    timeout_s: float


class WeightGroup:
    """One member of the weight group; `broadcast` from rank 0 into `tensor` (in place on the others)."""

    def __init__(self, info: GroupInfo, store: dist.TCPStore | None = None) -> None:
        """Join (blocks until every member joined or the timeout passed). Rank 0 passes the store it
        hosts (`host_store`), so its port can be sent to the others before they join."""
        timeout = datetime.timedelta(seconds=info.timeout_s)
        self.info = info
        try:
            self._store = store or dist.TCPStore(
                info.master_address, info.master_port, info.world_size, is_master=False, timeout=timeout
            )
            self._group = dist.ProcessGroupGloo(self._store, info.rank, info.world_size, timeout)
        except (RuntimeError, ValueError) as exc:
            raise GroupError(
                f"weight group at {info.master_address}:{info.master_port} (rank {info.rank} of "
                f"{info.world_size}) did not form within {info.timeout_s:g} s: {_first_line(exc)}"
            ) from None

    def broadcast(self, tensor: torch.Tensor) -> None:
        """`tensor` (contiguous) goes out as its bytes, so any dtype travels (gloo has no bool or float8
        kernels); an empty tensor is skipped on every member alike (each knows the shapes)."""
        if tensor.numel() == 0:
            return
        data = tensor.reshape(-1).view(torch.uint8)  # a view: received bytes land in `tensor`
        options = dist.BroadcastOptions()
        options.rootRank = 0
        with _collective(f"broadcast of {tuple(tensor.shape)} {tensor.dtype}", self.info):
            self._group.broadcast([data], options).wait()  # type: ignore[attr-defined]


def host_store(address: str, world_size: int, timeout_s: float) -> dist.TCPStore:
    """Rank 0's store on a free port of `address` (its `.port` goes to the other members)."""
    try:
        return dist.TCPStore(
            address,
            0,
            world_size,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    except (RuntimeError, ValueError) as exc:
        raise GroupError(f"cannot host the weight group's store on {address}: {_first_line(exc)}") from None


@contextmanager
def _collective(what: str, info: GroupInfo) -> Iterator[None]:
    try:
        yield
    except RuntimeError as exc:
        raise GroupError(
            f"weight group rank {info.rank}: {what} failed (a peer died or it passed {info.timeout_s:g} s): "
            f"{_first_line(exc)}"
        ) from None


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
