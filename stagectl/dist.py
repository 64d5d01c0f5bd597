"""The process group: `World` (rank, local rank, world size read once), init/teardown, and the few
collectives stagectl uses (rank-0 broadcast, gather, all-reduce MIN/SUM, barrier).

Never hangs: in a multi-rank run every collective runs inside a named phase of the rank's
`Watchdog` (`with dist.phase("feasibility gate", "step_s")`), which ends the rank with the phase and
collective named when a deadline of `launch.watchdog` passes; the process group's own timeout sits
above the longest deadline. A collective that fails (a peer rank died) raises `CollectiveError`
naming the phase. `teardown()` is the orderly end: the caller has joined its threads and released
its DDP wrapper; every rank meets at one final barrier, then the process group is destroyed.
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from stagectl.config.training import WatchdogConfig
from stagectl.metric_keys import Number, reduce_ranks
from stagectl.watchdog import Budget, Watchdog

T = TypeVar("T")

_watchdog: Watchdog | None = None


class CollectiveError(RuntimeError):
    """A collective failed (a peer rank died or the network broke): names the rank and the phase."""


class SharedError(ValueError):
    """An error decided on rank 0 and raised on every rank (only rank 0 needs to report it)."""


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


def start_watchdog(world: World, cfg: WatchdogConfig) -> None:
    """Start this rank's watchdog (multi-rank runs only; call before the first collective phase)."""
    global _watchdog
    if not world.distributed or _watchdog is not None:
        return
    _watchdog = Watchdog(cfg, rank=world.rank, world_size=world.world_size)
    _watchdog.start()


def init_distributed(world: World, cfg: WatchdogConfig) -> None:
    """Start the process group (gloo on CPU, nccl on GPU) when running under torchrun. Its own
    timeout sits above every watchdog deadline, so the watchdog (which names the phase) fires first."""
    if not world.distributed or dist.is_initialized():
        return
    start_watchdog(world, cfg)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    with phase("process-group rendezvous", "startup_s"), collective("init_process_group"):
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=cfg.longest_s + 60.0))


@contextlib.contextmanager
def phase(name: str, budget: Budget) -> Iterator[None]:
    """Run the body as a watched phase (a no-op in single-process runs); a failed collective inside
    becomes a `CollectiveError` naming the phase."""
    if _watchdog is None:
        yield
        return
    with _watchdog.phase(name, budget):
        try:
            yield
        except RuntimeError as exc:
            if not _is_transport_error(exc):
                raise
            raise CollectiveError(
                f"rank {dist.get_rank() if dist.is_initialized() else '?'}: {_watchdog.describe()} failed "
                f"(a peer rank is gone or the network broke): {_first_line(exc)}"
            ) from exc


@contextlib.contextmanager
def collective(name: str) -> Iterator[None]:
    """Name the collective the current phase is about to block in."""
    if _watchdog is None:
        yield
        return
    with _watchdog.collective(name):
        yield


def teardown(*, final_barrier: bool = True) -> None:
    """The orderly end of a multi-rank run: every rank meets at one final barrier (skipped on the
    error path, where peers may be gone), then the process group is destroyed and the watchdog stops.

    The caller must have released its DDP wrapper first: DDP's reducer holds a reference to the
    process group, and when the reducer drops the last one, gloo's destructor joins its worker
    threads while holding the GIL; a worker finishing a collective needs the GIL to free that
    collective's tensors, so the two wait on each other forever (the rare hang after "done").
    Destroyed here, the group's last reference is the Python handle, whose destructor releases the GIL.
    """
    global _watchdog
    try:
        if dist.is_available() and dist.is_initialized():
            with phase("shutdown", "shutdown_s"):
                if final_barrier:
                    barrier()
                gc.collect()  # drop reducers of released DDP wrappers before the group goes
                dist.destroy_process_group()
    finally:
        if _watchdog is not None:
            _watchdog.stop()
            _watchdog = None


def _is_transport_error(exc: RuntimeError) -> bool:
    """A failure of the process group's transport (a peer died, the network broke) rather than of the
    code inside the phase: c10d's own error types, or gloo / NCCL errors that DDP's backward re-raises
    as a plain RuntimeError."""
    if isinstance(exc, dist.DistError):
        return True
    first = _first_line(exc)
    return "/gloo/" in first or "NCCL" in first or "Connection reset by peer" in first


def describe_phase() -> str:
    return _watchdog.describe() if _watchdog is not None else "no phase"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def broadcast_object(obj: T, src: int = 0) -> T:
    """Rank `src`'s `obj` on every rank (plain picklable data only, never tensors)."""
    if not _active():
        return obj
    box: list[Any] = [obj]
    with collective(f"broadcast_object(src={src})"):
        dist.broadcast_object_list(box, src=src)
    return box[0]


def gather_objects(obj: T) -> list[T] | None:
    """Every rank's `obj` on rank 0 (in rank order); None on other ranks."""
    if not _active():
        return [obj]
    rank = dist.get_rank()
    out: list[Any] | None = [None] * dist.get_world_size() if rank == 0 else None
    with collective("gather_object(dst=0)"):
        dist.gather_object(obj, out, dst=0)
    return out


def all_gather_objects(obj: T) -> list[T]:
    """Every rank's `obj` on every rank (in rank order)."""
    if not _active():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    with collective("all_gather_object"):
        dist.all_gather_object(out, obj)
    return out


def reduce_metrics(local: Mapping[str, Number]) -> dict[str, Number]:
    """This rank's metric values reduced over all ranks, each key by the reduction `stagectl.metric_keys`
    declares for it (one collective; every rank gets the result)."""
    return reduce_ranks(all_gather_objects(dict(local)))


def all_reduce_ints(values: list[int], op: str) -> list[int]:
    """Element-wise `min`, `max` or `sum` of an integer vector over all ranks."""
    if not _active():
        return list(values)
    ops = {"min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX, "sum": dist.ReduceOp.SUM}
    tensor = torch.tensor(values, dtype=torch.int64, device=_collective_device())
    with collective(f"all_reduce({op})"):
        dist.all_reduce(tensor, op=ops[op])
    return [int(v) for v in tensor.tolist()]


def all_reduce_int(value: int, op: str) -> int:
    """`min`, `max` or `sum` of an integer over all ranks."""
    if not _active():
        return value
    ops = {"min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX, "sum": dist.ReduceOp.SUM}
    tensor = torch.tensor([value], dtype=torch.int64, device=_collective_device())
    with collective(f"all_reduce({op})"):
        dist.all_reduce(tensor, op=ops[op])
    return int(tensor.item())


def all_reduce_floats(values: list[float], op: str = "sum") -> list[float]:
    """Element-wise `sum`, `min` or `max` of a float vector over all ranks."""
    if not _active():
        return list(values)
    ops = {"min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX, "sum": dist.ReduceOp.SUM}
    tensor = torch.tensor(values, dtype=torch.float64, device=_collective_device())
    with collective(f"all_reduce({op})"):
        dist.all_reduce(tensor, op=ops[op])
    return [float(v) for v in tensor.tolist()]


def barrier() -> None:
    if _active():
        with collective("barrier"):
            dist.barrier()


def _collective_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
