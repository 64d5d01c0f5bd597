"""Placement of the learner and the rollout server: the config rules (no sharing without
`allow_shared_devices`, CPUs this host has, one device per rank), each side's CPU set, the rank slices,
and the `CUDA_VISIBLE_DEVICES` value a child gets."""

from __future__ import annotations

import os
from typing import Any

import pytest

from stagectl.config import StagectlConfig
from stagectl.config.engines import ENGINES, EngineCapabilities
from stagectl.config.placement import rank_cpus, resolve_cpus, server_on_learner_node, validate_placement
from stagectl.placement import visible_devices

HOST_CPUS = sorted(os.sched_getaffinity(0))
LAYOUT = {"embedded": True, "devices": [6, 7], "engine": "vllm", "vllm": {"tensor_parallel_size": 2}}


def config(embedded: bool = True, **sections: Any) -> StagectlConfig:
    rm: dict[str, Any] = {"rollout_backend": "vllm"}
    if not embedded:
        rm["vllm"] = {"server": {"servers": [{"base_url": "http://10.0.0.7:8000"}]}}
    raw: dict[str, Any] = {
        "data": {"synthetic": {"num_samples": 8}},
        "custom": {"extra": {"rollout_matching": rm}},
        "stage2_ab": {"schedule": {"b_ratio": 0.5}, "channel_b": {"mode": "async"}},
        "rollout_server": {"embedded": embedded},
    }
    for key, value in sections.items():
        raw[key] = {**raw.get(key, {}), **value}
    return StagectlConfig.model_validate(raw)


def problems(cfg: StagectlConfig) -> dict[str, str]:
    return {p.path: p.message for p in validate_placement(cfg, cfg.launch.nproc_per_node)}


def test_no_placement_no_problem() -> None:
    assert problems(config()) == {}


def test_server_devices_overlapping_the_learner_are_refused_with_the_cost() -> None:
    # 8 learner ranks take devices 0..7 by default: the server's 6 and 7 are theirs
    msg = problems(config(launch={"nproc_per_node": 8}, rollout_server=LAYOUT))
    assert "[6, 7]" in msg["rollout_server.devices"]
    assert "allow_shared_devices" in msg["rollout_server.devices"]
    assert "slows the other down" in msg["rollout_server.devices"]


def test_six_learner_two_rollout_layout_is_accepted() -> None:
    assert problems(config(launch={"nproc_per_node": 6}, rollout_server=LAYOUT)) == {}
    explicit = config(
        launch={"nproc_per_node": 2, "devices": [0, 3]}, rollout_server={**LAYOUT, "devices": [1, 2]}
    )
    assert problems(explicit) == {}


def test_sharing_is_accepted_when_allowed() -> None:
    shared = {"embedded": True, "devices": [0], "allow_shared_devices": True}
    assert problems(config(rollout_server=shared)) == {}
    cpus = {"embedded": True, "cpus": HOST_CPUS[:1], "allow_shared_devices": True}
    assert problems(config(launch={"cpus": HOST_CPUS[:1]}, rollout_server=cpus)) == {}


def test_a_remote_server_is_not_checked_against_the_learner() -> None:
    cfg = config(embedded=False, rollout_server={"devices": [0], "cpus": [100_000]})
    assert not server_on_learner_node(cfg)
    assert problems(cfg) == {}


def test_shared_cpus_are_refused() -> None:
    msg = problems(
        config(launch={"cpus": HOST_CPUS[:1]}, rollout_server={"embedded": True, "cpus": HOST_CPUS[:1]})
    )
    assert f"{HOST_CPUS[:1]}" in msg["rollout_server.cpus"]
    assert "allow_shared_devices" in msg["rollout_server.cpus"]


@pytest.mark.parametrize("key", ["launch", "rollout_server"])
def test_cpus_this_host_lacks_are_refused(key: str) -> None:
    msg = problems(config(**{key: {"cpus": [100_000]}}))
    assert "[100000]" in msg[f"{key}.cpus"] and "not available" in msg[f"{key}.cpus"]


def test_the_learner_cannot_take_every_cpu_of_the_server_node() -> None:
    msg = problems(config(launch={"cpus": HOST_CPUS}))
    assert "no CPU of this host for the rollout server" in msg["launch.cpus"]


def test_repeated_ids_and_device_count_per_rank() -> None:
    assert (
        "distinct"
        in problems(config(rollout_server={"embedded": True, "devices": [1, 1]}))["rollout_server.devices"]
    )
    msg = problems(config(launch={"nproc_per_node": 2, "devices": [0]}))
    assert "one device per learner rank" in msg["launch.devices"]


def test_devices_match_the_engine() -> None:
    two = {"embedded": True, "devices": [6, 7]}
    assert "hf engine runs on one device" in problems(config(rollout_server=two))["rollout_server.devices"]
    vllm = {**two, "engine": "vllm", "vllm": {"tensor_parallel_size": 1}}
    assert "tensor_parallel_size" in problems(config(rollout_server=vllm))["rollout_server.devices"]
    assert problems(config(rollout_server={**vllm, "vllm": {"tensor_parallel_size": 2}})) == {}


def test_the_device_rule_follows_the_engines_capability_not_its_name(monkeypatch: pytest.MonkeyPatch) -> None:
    two = {"embedded": True, "devices": [6, 7], "vllm": {"tensor_parallel_size": 2}}
    assert "hf engine runs on one device" in problems(config(rollout_server=two))["rollout_server.devices"]
    tensor_parallel = EngineCapabilities(
        merges_adapter=True, devices="tensor_parallel", adds_coord_tokens=True
    )
    monkeypatch.setitem(ENGINES, "hf", tensor_parallel)
    assert problems(config(rollout_server=two)) == {}


def test_every_rank_needs_a_cpu() -> None:
    msg = problems(config(embedded=False, launch={"nproc_per_node": len(HOST_CPUS) + 1, "cpus": HOST_CPUS}))
    assert "at least one CPU each" in msg["launch.cpus"]


def test_the_server_side_alone_leaves_the_rest_to_the_learner() -> None:
    cfg = config(rollout_server={"embedded": True, "cpus": [3]})
    assert resolve_cpus(cfg, {0, 1, 2, 3}).learner == (0, 1, 2)
    cfg = config(launch={"cpus": [0, 1]})
    plan = resolve_cpus(cfg, {0, 1, 2, 3})
    assert plan == type(plan)((0, 1), (2, 3))
    assert resolve_cpus(config(), {0, 1}) == type(plan)(None, None)
    remote = config(embedded=False, rollout_server={"cpus": [3]})
    assert resolve_cpus(remote, {0, 1, 2, 3}).learner is None  # another node's server takes nothing here


@pytest.mark.parametrize("num_cpus", range(1, 10))
@pytest.mark.parametrize("nproc", range(1, 5))
def test_rank_slices_cover_the_learner_cpus_evenly(num_cpus: int, nproc: int) -> None:
    if nproc > num_cpus:
        return
    cpus = list(range(10, 10 + num_cpus))
    slices = [rank_cpus(cpus, nproc, k) for k in range(nproc)]
    assert [c for s in slices for c in s] == cpus  # contiguous, in order, every CPU once
    assert max(map(len, slices)) - min(map(len, slices)) <= 1


def test_visible_devices_maps_through_an_existing_value() -> None:
    assert visible_devices("rollout_server.devices", [6, 7], None, 8) == "6,7"
    assert visible_devices("rollout_server.devices", [1, 3], "GPU-a,GPU-b,GPU-c,GPU-d", None) == "GPU-b,GPU-d"
    assert visible_devices("launch.devices", [5], None, None) == "5"  # no driver: no check
    with pytest.raises(ValueError, match=r"rollout_server.devices: device\(s\) \[8\] do not exist"):
        visible_devices("rollout_server.devices", [8], None, 8)
    with pytest.raises(ValueError, match=r"launch.devices: device\(s\) \[2\] are not visible"):
        visible_devices("launch.devices", [2], "4,5", None)
