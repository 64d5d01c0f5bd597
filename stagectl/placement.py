"""Applying a placement (`stagectl.config.placement`) to a process: `CUDA_VISIBLE_DEVICES` for the learner
ranks and the rollout server, and a CPU set (`sched_setaffinity`) with a matching torch thread count.

Devices: a launcher that starts a child (the embedded server, torchrun's ranks) puts the child's
`CUDA_VISIBLE_DEVICES` in the child's environment and marks it placed (`PLACED_ENV`), so the child does
not map its ids a second time; a process started directly (`stagectl rollout-server`, a one-rank learner)
sets its own before CUDA starts. CPUs: every process pins itself at start, before its worker threads
exist (threads inherit the mask of the thread that creates them).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

from stagectl.config.placement import CpuSides, rank_cpus
from stagectl.config.rollout import RolloutServerConfig
from stagectl.config.training import LaunchConfig
from stagectl.console import say

CUDA_ENV = "CUDA_VISIBLE_DEVICES"
PLACED_ENV = "STAGECTL_CUDA_PLACED"  # "1": the launcher already set this process's CUDA_VISIBLE_DEVICES
NVIDIA_GPUS_DIR = Path("/proc/driver/nvidia/gpus")


def visible_devices(key: str, ids: Sequence[int], parent: str | None, num_devices: int | None) -> str:
    """The `CUDA_VISIBLE_DEVICES` value that gives a child devices `ids` as this process sees them: under
    an existing value (`parent`), id k is its k-th entry; else the ids themselves. `num_devices`: how many
    devices this host has (None: unknown, no check). ValueError (naming `key`) for an id that is not there."""
    if parent is not None:
        entries = [e.strip() for e in parent.split(",") if e.strip()]
        missing = [i for i in ids if i >= len(entries)]
        if missing:
            raise ValueError(
                f"{key}: device(s) {missing} are not visible: {CUDA_ENV}={parent!r} shows {len(entries)} "
                f"device(s), numbered 0 .. {len(entries) - 1} in {key}"
            )
        return ",".join(entries[i] for i in ids)
    if num_devices is not None and num_devices > 0:
        missing = [i for i in ids if i >= num_devices]
        if missing:
            raise ValueError(
                f"{key}: device(s) {missing} do not exist; this host has {num_devices} CUDA device(s), "
                f"0 .. {num_devices - 1}"
            )
    return ",".join(str(i) for i in ids)


def host_num_devices() -> int | None:
    """NVIDIA GPUs the driver lists (torch-free); None when no NVIDIA driver is loaded."""
    if not NVIDIA_GPUS_DIR.is_dir():
        return None
    return len(list(NVIDIA_GPUS_DIR.iterdir()))


def cuda_env(key: str, ids: Sequence[int] | None) -> dict[str, str]:
    """Environment entries that place a child on `ids` (empty when `ids` is None)."""
    if ids is None:
        return {}
    value = visible_devices(key, ids, os.environ.get(CUDA_ENV), host_num_devices())
    if host_num_devices() is None and CUDA_ENV not in os.environ:
        say(
            "placement",
            f"{key} {list(ids)}: this host has no NVIDIA driver; {CUDA_ENV}={value} is set anyway",
        )
    return {CUDA_ENV: value, PLACED_ENV: "1"}


def check_devices(launch: LaunchConfig, rollout_server: RolloutServerConfig) -> None:
    """Fail before anything starts when a configured CUDA id does not exist here (ValueError)."""
    for key, ids in (
        ("launch.devices", launch.devices),
        ("rollout_server.devices", rollout_server.devices),
    ):
        if ids is not None:
            visible_devices(key, ids, os.environ.get(CUDA_ENV), host_num_devices())


def place_devices_here(key: str, ids: Sequence[int] | None) -> None:
    """Set this process's `CUDA_VISIBLE_DEVICES` to `ids` unless its launcher already did; CUDA must not have
    started yet (it reads the variable once)."""
    if ids is None or os.environ.get(PLACED_ENV) == "1":
        return
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        raise RuntimeError(f"{key}: CUDA already started in this process, {CUDA_ENV} can no longer change")
    os.environ.update(cuda_env(key, ids))


def pin_cpus(cpus: Sequence[int]) -> None:
    """Pin this process (its calling thread and every thread it starts later) to `cpus`, with one torch
    intra-op thread per CPU (`OMP_NUM_THREADS` for libraries that read it at start, `torch.set_num_threads`
    for torch, which may already have read it)."""
    import torch

    os.sched_setaffinity(0, cpus)
    os.environ["OMP_NUM_THREADS"] = str(len(cpus))
    torch.set_num_threads(len(cpus))


def place_learner_rank(launch: LaunchConfig, sides: CpuSides, local_rank: int) -> tuple[int, ...] | None:
    """At the start of a learner rank: its devices (a one-rank learner sets its own) and its CPU slice.
    Returns the CPUs its async prefetcher thread goes to (`launch.prefetcher_cpus`; None: stay)."""
    place_devices_here("launch.devices", launch.devices)
    plan = sides.resolve(os.sched_getaffinity(0))
    if plan.learner is None:
        return None
    cpus = rank_cpus(plan.learner, launch.nproc_per_node, local_rank)
    pin_cpus(cpus)
    say(
        "placement",
        f"learner rank {local_rank} on CPU(s) {list(cpus)}, {len(cpus)} torch thread(s)",
        every_rank=True,
    )
    if launch.prefetcher_cpus == "server" and plan.server is not None and sides.same_node:
        return plan.server
    return None


def place_server(rollout_server: RolloutServerConfig, sides: CpuSides) -> None:
    """At the start of `stagectl rollout-server`: its devices and CPUs."""
    place_devices_here("rollout_server.devices", rollout_server.devices)
    plan = sides.resolve(os.sched_getaffinity(0))
    if plan.server is not None:
        pin_cpus(plan.server)
        say("placement", f"rollout server on CPU(s) {list(plan.server)}, {len(plan.server)} torch thread(s)")
    if os.environ.get(CUDA_ENV) is not None and rollout_server.devices is not None:
        say("placement", f"rollout server {CUDA_ENV}={os.environ[CUDA_ENV]}")
