"""`learner.channel_b.build.build_channel_b`: an A-only run (`b_ratio: 0`, an ablation's baseline on the AB
config) on a config with rollout servers builds no client, weight sync or prefetcher: no server is waited
for and no weights are pushed (it pushed every `sync_every_steps` and waited for /health/)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any, NoReturn

import pytest

import stagectl.learner.channel_b.build as build
from stagectl.config import load_config
from stagectl.config.plan_train import train_plan

ASYNC = Path(__file__).resolve().parents[4] / "examples/tiny/train_ab_async.yaml"


@pytest.mark.parametrize(("ratio", "servers"), [("0", False), ("0.5", True)])
def test_an_a_only_run_builds_no_server_side(
    monkeypatch: pytest.MonkeyPatch, ratio: str, servers: bool
) -> None:
    sets = [f"stage2_ab.schedule.b_ratio={ratio}", "rollout_server.embedded=false"]
    sets.append("custom.extra.rollout_matching.vllm.server.servers=[{base_url: 'http://127.0.0.1:9'}]")
    plan = train_plan(load_config(ASYNC, sets, world_size=2), world_size=2)
    assert plan.channel_b.rollouts is not None  # the config names servers either way

    def server_side(*args: Any, **kwargs: Any) -> NoReturn:
        raise LookupError("the server side was built")

    built: list[str] = []
    monkeypatch.setattr(build, "make_client", server_side)
    monkeypatch.setattr(build, "HFRollouts", lambda *args: "in-process source")
    monkeypatch.setattr(
        build, "StepChannelB", lambda plan, st, runner, source: built.append(source) or "step"
    )
    st = SimpleNamespace(plan=plan, bundle=SimpleNamespace(model=None), encoder=None, resumed_from=None)
    if servers:
        with pytest.raises(LookupError):
            build.build_channel_b(plan.channel_b, st, None, num_updates=0, prefetcher_cpus=None)  # type: ignore[arg-type]
    else:
        got = build.build_channel_b(plan.channel_b, st, None, num_updates=0, prefetcher_cpus=None)  # type: ignore[arg-type]
        assert got == "step" and built == ["in-process source"]


def test_a_resumed_step_mode_run_counts_its_weight_syncs_from_the_checkpoints_totals(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Step mode with rollout servers: the checkpoint's rank state holds the weight-sync totals and the
    resumed run goes on from them (they restarted at 0 at a resume, so the report counted only the syncs
    since)."""
    from stagectl.learner.channel_b.publisher import WeightPublisher
    from stagectl.learner.channel_b.step_mode import StepChannelB

    sets = ["stage2_ab.channel_b.mode=step", "rollout_server.embedded=false", "launch.nproc_per_node=1"]
    sets.append("custom.extra.rollout_matching.vllm.server.servers=[{base_url: 'http://127.0.0.1:9'}]")
    plan = train_plan(load_config(ASYNC, sets, world_size=1), world_size=1)

    class Publisher(WeightPublisher):
        def __init__(self, *args: Any, **kwargs: Any) -> None:  # no server to ask for its version
            self.num_syncs, self.num_failures, self.bytes_total, self.seconds_total = 1, 0, 10, 0.25
            self.clock = None  # type: ignore[assignment]

    monkeypatch.setattr(build, "make_client", lambda servers: "client")
    monkeypatch.setattr(build, "make_weight_sync", lambda rollouts: "weight sync")
    monkeypatch.setattr(build, "WeightPublisher", Publisher)
    monkeypatch.setattr(build, "ServerRollouts", lambda *args: "server source")
    monkeypatch.setattr(build, "ServerHealth", lambda *args, **kwargs: "health")
    made: list[StepChannelB] = []

    def step_channel(plan: Any, st: Any, runner: Any, source: Any, **parts: Any) -> StepChannelB:
        channel: StepChannelB = object.__new__(StepChannelB)
        channel.publisher = parts["publisher"]
        made.append(channel)
        return channel

    monkeypatch.setattr(build, "StepChannelB", step_channel)
    saved = {"num_syncs": 4, "num_failures": 1, "bytes_total": 1000, "seconds_total": 0.5}
    st = SimpleNamespace(
        plan=plan,
        bundle=SimpleNamespace(model=None),
        encoder=None,
        world=None,
        precision=SimpleNamespace(storage_dtype=None),
        resumed_from=None,
        extra_state={"rank_state": {"weight_syncs": saved}},
    )
    build.build_channel_b(plan.channel_b, st, None, num_updates=3, prefetcher_cpus=None)  # type: ignore[arg-type]
    assert made[0].rank_state() == {
        "weight_syncs": {"num_syncs": 5, "num_failures": 1, "bytes_total": 1010, "seconds_total": 0.75}
    }
