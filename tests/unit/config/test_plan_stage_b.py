"""Stage-B's plan: the backend is one union that matches `runner.engine` and carries that engine's settings
(a server backend its `ServerList` of `runner.server`); the sampler holds one spec per grid entry; the run
directory and the deadlines come from `output` and `launch.watchdog`."""

from __future__ import annotations

from pathlib import Path

import pytest

from stagectl.config import load_config
from stagectl.config.plan import ServerList
from stagectl.config.plan_stage_b import (
    ModelBackendPlan,
    RulesBackendPlan,
    ServerBackendPlan,
    read_stage_b_plan,
    stage_b_plan,
    write_stage_b_plan,
)
from stagectl.config.sampling import SamplingSpec

STAGE_B = ["mission=m", "tickets=[t.jsonl]", "guidance.path=g.json"]
SERVER = [
    "runner.engine=server",
    "runner.server.base_urls=[http://127.0.0.1:8000/, https://10.0.0.2:8001]",
    "runner.server.auth_token_env=STAGE_B_TOKEN",
    "runner.server.infer_timeout_s=30",
    "runner.server.wait_healthy_s=5",
]


@pytest.mark.parametrize(
    ("overrides", "kind", "part"),
    [
        ([], "model", ModelBackendPlan),
        (["runner.engine=model"], "model", ModelBackendPlan),
        (SERVER, "server", ServerBackendPlan),
        (["runner.engine=rules"], "rules", RulesBackendPlan),
    ],
)
def test_the_backend_is_the_engine_runner_engine_names(overrides: list[str], kind: str, part: type) -> None:
    cfg = load_config(None, [*STAGE_B, *overrides])
    plan = stage_b_plan(cfg)
    assert cfg.runner.engine == kind
    assert plan.backend.kind == kind and isinstance(plan.backend, part)


@pytest.mark.parametrize(
    ("overrides", "part"),
    [
        (["model.name_or_path=/m", "runner.per_rank_rollout_batch_size=3"], ModelBackendPlan),
        ([*SERVER, "runner.server.tls_skip_verify=true"], ServerBackendPlan),
        (
            ["runner.engine=rules", "sampler.grid=[{temperature: 0.5, seed: 7}, {top_p: 0.8}]"],
            RulesBackendPlan,
        ),
    ],
)
def test_the_plan_of_each_backend_round_trips_through_its_file(
    overrides: list[str], part: type, tmp_path: Path
) -> None:
    plan = stage_b_plan(load_config(None, [*STAGE_B, *overrides]))
    path = write_stage_b_plan(tmp_path / "plan.json", plan)
    back = read_stage_b_plan(path)
    assert isinstance(back.backend, part)
    assert back == plan  # every part, the resolved config (rank 0's config.yaml) included
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]  # no temporary file left


def test_a_watchdog_deadline_of_inf_reads_back_as_inf(tmp_path: Path) -> None:
    plan = stage_b_plan(load_config(None, [*STAGE_B, "launch.watchdog.step_s=.inf"]))
    back = read_stage_b_plan(write_stage_b_plan(tmp_path / "plan.json", plan))
    assert back == plan and back.watchdog.step_s == float("inf")
    assert back.resolved_config["launch"]["watchdog"]["step_s"] == float("inf")


def test_a_stage_b_plan_file_without_its_backend_settings_is_refused(tmp_path: Path) -> None:
    path = write_stage_b_plan(tmp_path / "plan.json", stage_b_plan(load_config(None, [*STAGE_B, *SERVER])))
    path.write_text(path.read_text().replace('"servers"', '"no_servers"'))
    with pytest.raises(ValueError, match=r"plan\.json: not a stage-b plan this stagectl can read: .*servers"):
        read_stage_b_plan(path)


def test_a_server_backend_carries_the_server_list_of_runner_server() -> None:
    backend = stage_b_plan(load_config(None, [*STAGE_B, *SERVER])).backend
    assert isinstance(backend, ServerBackendPlan)
    assert backend.servers == ServerList(
        base_urls=("http://127.0.0.1:8000", "https://10.0.0.2:8001"),
        key="runner.server",
        auth_token_env="STAGE_B_TOKEN",
        infer_timeout_s=30.0,
        wait_healthy_s=5.0,
        wait_healthy_key="runner.server.wait_healthy_s",
    )
    assert backend.servers.token_key == "runner.server.auth_token_env"  # messages name the YAML key


def test_a_server_backend_without_servers_cannot_be_built() -> None:
    with pytest.raises(ValueError, match=r"runner\.server\.base_urls: runner\.engine: server needs"):
        ServerBackendPlan(ServerList(base_urls=(), key="runner.server"))


def test_a_model_backend_carries_the_model_and_the_batch_cap() -> None:
    cfg = load_config(None, [*STAGE_B, "model.name_or_path=/m", "runner.per_rank_rollout_batch_size=3"])
    backend = stage_b_plan(cfg).backend
    assert backend == ModelBackendPlan(cfg.model, max_batch_size=3)


def test_the_parts_of_a_stage_b_config() -> None:
    cfg = load_config(
        None,
        [
            *STAGE_B,
            "output.root=/runs",
            "output.run_name=r1",
            "sampler.grid=[{temperature: 0.5, top_p: 0.8, max_new_tokens: 16, seed: 3}, {seed: 4}]",
            "sampler.samples_per_decode=2",
            "runner.seed=7",
            "runner.logging_steps=2",
            "reflection.batch_size=5",
            "reflection.max_operations=2",
            "reflection.max_new_tokens=64",
            "reflection.temperature=0.3",
            "manual_review.min_vote_strength=0.6",
            "launch.watchdog.step_s=99",
        ],
    )
    plan = stage_b_plan(cfg)
    assert plan.run_dir == Path("/runs/r1/m")
    assert plan.tickets == (Path("t.jsonl"),) and plan.guidance.path == Path("g.json")
    first, second = plan.sampler.grid
    assert first.spec == SamplingSpec(max_new_tokens=16, temperature=0.5, top_p=0.8) and first.seed == 3
    assert second.spec == SamplingSpec(max_new_tokens=128, temperature=0.7, top_p=0.9) and second.seed == 4
    assert plan.sampler.samples_per_decode == 2
    assert (plan.runner.seed, plan.runner.logging_steps, plan.runner.epochs) == (7, 2, 1)
    assert plan.reflection.batch_size == 5 and plan.reflection.max_operations == 2
    assert plan.reflection.sampling == SamplingSpec(max_new_tokens=64, temperature=0.3, top_p=1.0)
    assert plan.min_vote_strength == 0.6 and plan.watchdog.step_s == 99
    assert plan.resolved_config["mission"] == "m"  # the whole config, as config.yaml gets it


def test_a_config_without_a_mission_is_not_a_stage_b_plan() -> None:
    with pytest.raises(ValueError, match="not a Stage-B config"):
        stage_b_plan(load_config(None, []))
