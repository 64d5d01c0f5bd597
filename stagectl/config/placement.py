"""Placement of the learner ranks and the rollout server on one node: which CUDA devices and CPUs each side
gets (`launch.devices` / `launch.cpus`, `rollout_server.devices` / `rollout_server.cpus`), derived from the
config and the host's CPU set, and the rule that the two sides do not share hardware unless the user says
they may (`rollout_server.allow_shared_devices`).

Pure functions over plain data; `stagectl.placement` applies the result to a process.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

from stagectl.config.engines import ENGINES
from stagectl.config.root import LOOPBACK_HOSTS, Problem, StagectlConfig

SHARING_COST = (
    "sharing costs the overlap async Channel-B exists for: rollouts then run on the learner's hardware and "
    "each side slows the other down"
)


@dataclass(frozen=True)
class CpuPlan:
    """CPU ids of each side on this node; None: that side is not pinned."""

    learner: tuple[int, ...] | None
    server: tuple[int, ...] | None


@dataclass(frozen=True)
class CpuSides:
    """The placement part a process applies at its start (`stagectl.placement`): each side's configured
    CPUs (`launch.cpus`, `rollout_server.cpus`; None: not set) and whether the rollout server runs on the
    learner's node (`server_on_learner_node`), which decides whether a side left null gets the rest."""

    learner: tuple[int, ...] | None = None
    server: tuple[int, ...] | None = None
    same_node: bool = False

    @classmethod
    def of(cls, cfg: StagectlConfig) -> CpuSides:
        return cls(
            learner=tuple(cfg.launch.cpus) if cfg.launch.cpus is not None else None,
            server=tuple(cfg.rollout_server.cpus) if cfg.rollout_server.cpus is not None else None,
            same_node=server_on_learner_node(cfg),
        )

    def resolve(self, host_cpus: Collection[int]) -> CpuPlan:
        """Each side's CPUs. On the learner's node a side left null gets the host CPUs the other side does
        not use (sorted); otherwise each side is what its key says."""
        learner, server = self.learner, self.server
        if self.same_node:
            if learner is None and server is not None:
                learner = tuple(sorted(set(host_cpus) - set(server)))
            elif server is None and learner is not None:
                server = tuple(sorted(set(host_cpus) - set(learner)))
        return CpuPlan(learner, server)


def server_on_learner_node(cfg: StagectlConfig) -> bool:
    """The rollout server runs on the learner's node: embedded, or every configured server is loopback."""
    if cfg.rollout_server.embedded:
        return True
    urls = [s.base_url for s in cfg.custom.extra.rollout_matching.vllm.server.servers]
    return bool(urls) and all(urlsplit(url).hostname in LOOPBACK_HOSTS for url in urls)


def resolve_cpus(cfg: StagectlConfig, host_cpus: Collection[int]) -> CpuPlan:
    """Each side's CPUs on this host (`CpuSides.resolve`)."""
    return CpuSides.of(cfg).resolve(host_cpus)


def rank_cpus(learner_cpus: Sequence[int], nproc_per_node: int, local_rank: int) -> tuple[int, ...]:
    """Local rank `local_rank`'s contiguous slice of the learner's CPUs (slices differ by at most one CPU;
    the first `len % nproc` ranks get the larger ones)."""
    assert 0 <= local_rank < nproc_per_node <= len(learner_cpus)
    base, extra = divmod(len(learner_cpus), nproc_per_node)
    start = local_rank * base + min(local_rank, extra)
    return tuple(learner_cpus[start : start + base + (local_rank < extra)])


def learner_devices(cfg: StagectlConfig) -> tuple[int, ...]:
    """The learner ranks' CUDA ids on this node (`launch.devices`, default 0 .. nproc_per_node-1)."""
    if cfg.launch.devices is not None:
        return tuple(cfg.launch.devices)
    return tuple(range(cfg.launch.nproc_per_node))


def validate_placement(cfg: StagectlConfig, world_size: int) -> list[Problem]:
    """Device and CPU lists: no repeats; `launch.devices` one per rank; CPU ids this host has; enough CPUs
    for every rank; and on the learner's node no sharing without `allow_shared_devices`."""
    problems: list[Problem] = []
    rs, launch = cfg.rollout_server, cfg.launch
    for key, ids in (
        ("launch.devices", launch.devices),
        ("launch.cpus", launch.cpus),
        ("rollout_server.devices", rs.devices),
        ("rollout_server.cpus", rs.cpus),
    ):
        if ids is not None and (len(set(ids)) != len(ids) or min(ids) < 0):
            problems.append(Problem(key, f"ids must be distinct and >= 0, got {ids}"))
    if launch.devices is not None and len(launch.devices) != launch.nproc_per_node:
        problems.append(
            Problem(
                "launch.devices",
                f"one device per learner rank: {len(launch.devices)} given for nproc_per_node "
                f"{launch.nproc_per_node}; list {launch.nproc_per_node} ids or set nproc_per_node to match",
            )
        )
    if problems:  # the rules below count the ids
        return problems
    devices = ENGINES[rs.engine].devices  # how many devices the engine runs on
    if rs.devices is not None and devices == "one" and len(rs.devices) > 1:
        problems.append(
            Problem(
                "rollout_server.devices",
                f"the {rs.engine} engine runs on one device, {len(rs.devices)} given; list one, or use engine: vllm "
                "with vllm.tensor_parallel_size equal to the number of devices",
            )
        )
    if (
        rs.devices is not None
        and devices == "tensor_parallel"
        and rs.vllm.tensor_parallel_size != len(rs.devices)
    ):
        problems.append(
            Problem(
                "rollout_server.devices",
                f"{len(rs.devices)} device(s) for a vLLM engine of tensor_parallel_size "
                f"{rs.vllm.tensor_parallel_size}: list as many devices as rollout_server.vllm.tensor_parallel_size",
            )
        )
    if problems:
        return problems
    host = os.sched_getaffinity(0)
    same_node = server_on_learner_node(cfg)
    for key, ids in (("launch.cpus", launch.cpus), ("rollout_server.cpus", rs.cpus if same_node else None)):
        missing = sorted(set(ids or ()) - host)
        if missing:
            problems.append(
                Problem(
                    key, f"CPU(s) {missing} are not available to this process (it may use {sorted(host)})"
                )
            )
    if problems:
        return problems
    plan = resolve_cpus(cfg, host)
    if plan.learner is not None and len(plan.learner) < launch.nproc_per_node:
        key = "launch.cpus" if launch.cpus is not None else "rollout_server.cpus"
        problems.append(
            Problem(
                key,
                f"the learner's {launch.nproc_per_node} rank(s) need at least one CPU each, but get "
                f"{list(plan.learner)}; give launch.cpus more CPUs (or the server fewer)",
            )
        )
    if same_node and plan.server is not None and not plan.server:
        problems.append(Problem("launch.cpus", "leaves no CPU of this host for the rollout server"))
    if not same_node or rs.allow_shared_devices:
        return problems
    if rs.devices is not None:
        shared = sorted(set(rs.devices) & set(learner_devices(cfg)))
        if shared:
            problems.append(
                Problem(
                    "rollout_server.devices",
                    f"CUDA device(s) {shared} are also the learner's (launch.devices, default 0 .. "
                    f"nproc_per_node-1); {SHARING_COST}. Give the server other devices (e.g. 6 learner + 2 "
                    "rollout on 8 GPUs), or set rollout_server.allow_shared_devices: true to accept it",
                )
            )
    if plan.learner is not None and plan.server is not None:
        shared = sorted(set(plan.learner) & set(plan.server))
        if shared:
            problems.append(
                Problem(
                    "rollout_server.cpus",
                    f"CPU(s) {shared} are also the learner's (launch.cpus); {SHARING_COST}. Give the two "
                    "sides disjoint CPUs, or set rollout_server.allow_shared_devices: true to accept it",
                )
            )
    return problems
