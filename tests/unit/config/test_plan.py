"""The resolved plan (`config.plan`): what each shipped train-ab example resolves to, its JSON round trip
(the file torchrun ranks read), and the one union for where Channel-B's rollouts come from."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stagectl.config import StagectlConfig
from stagectl.config.loader import load_config
from stagectl.config.plan import (
    AsyncServers,
    CleanPrefix,
    InProcessStep,
    MatchCosts,
    RawPrefix,
    ReorderedGT,
    ServerStep,
)
from stagectl.config.plan_train import channel_b_plan, read_train_plan, train_plan, write_train_plan
from stagectl.config.rollout import DiskSync, HttpSync
from stagectl.config.root import resolve_config

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
TRAIN_AB_EXAMPLES = sorted(p for p in EXAMPLES.rglob("*.yaml") if "\nstage2_ab:" in p.read_text())
ASYNC = EXAMPLES / "tiny" / "train_ab_async.yaml"
SERVERS = 'custom.extra.rollout_matching.vllm.server.servers=[{base_url: "http://10.0.0.1:8000/"}, {base_url: "http://10.0.0.2:8000"}]'
EXTERNAL = [SERVERS, "rollout_server.embedded=false"]


def world_size(cfg: StagectlConfig) -> int:
    return cfg.launch.nproc_per_node * cfg.launch.nnodes


def test_the_examples_with_a_stage2_ab_section_are_found() -> None:
    names = {p.relative_to(EXAMPLES).as_posix() for p in TRAIN_AB_EXAMPLES}
    assert {"tiny/train_ab.yaml", "tiny/train_ab_async.yaml", "coco/train_ab.yaml"} <= names


@pytest.mark.parametrize("example", TRAIN_AB_EXAMPLES, ids=lambda p: p.relative_to(EXAMPLES).as_posix())
def test_every_train_ab_example_plan_round_trips_through_json(example: Path, tmp_path: Path) -> None:
    cfg = load_config(example)
    plan = train_plan(cfg, world_size(cfg))
    path = write_train_plan(tmp_path / "run" / "plan.json", plan)
    assert read_train_plan(path) == plan
    assert json.loads(path.read_text())["plan"]["channel_b"]["source"]["kind"] == plan.channel_b.source.kind


def test_a_timeout_set_to_inf_reads_back_as_inf_in_the_plan_and_its_config(tmp_path: Path) -> None:
    """JSON has no infinity: the plan file writes it as a string, and the config.yaml it carries as YAML's
    `.inf`, so a rank reads back exactly what the launcher resolved (not null)."""
    inf = float("inf")
    cfg = load_config(
        ASYNC,
        [
            "stage2_ab.channel_b.rollout_loss_timeout_s=.inf",
            "launch.watchdog.step_s=.inf",
            "training.max_grad_norm=.inf",
            "custom.extra.rollout_matching.vllm.server.infer_timeout_s=.inf",
        ],
    )
    plan = train_plan(cfg, 2)
    back = read_train_plan(write_train_plan(tmp_path / "plan.json", plan))
    assert back == plan
    rollouts = back.channel_b.rollouts
    assert rollouts is not None and rollouts.rollout_loss_timeout_s == inf
    assert back.watchdog.step_s == inf and back.training.max_grad_norm == inf
    assert back.run_config["training"]["max_grad_norm"] == inf
    assert back.run_config["stage2_ab"]["channel_b"]["rollout_loss_timeout_s"] == inf


def test_in_process_rollouts_plan_an_in_process_step() -> None:
    cfg = load_config(EXAMPLES / "tiny" / "train_ab.yaml")
    assert cfg.custom.extra.rollout_matching.rollout_backend == "hf"
    plan = channel_b_plan(cfg, resolve_config(cfg, 1))
    assert plan.source == InProcessStep() and plan.rollouts is None


def test_async_plans_async_servers_with_the_servers_urls_and_the_resolved_disk_dir(tmp_path: Path) -> None:
    overrides = [
        *EXTERNAL,
        "custom.extra.rollout_matching.vllm.sync={transport: disk}",
        f"training.output_dir={tmp_path / 'run'}",
        "stage2_ab.channel_b.on_rollout_loss=continue_a_only",
    ]
    cfg = load_config(ASYNC, overrides)
    plan = channel_b_plan(cfg, resolve_config(cfg, 2))
    assert isinstance(plan.source, AsyncServers)
    assert plan.source.queue.sync_every_steps == 2 and plan.source.queue.queue_limit == 8
    rollouts = plan.source.rollouts
    assert rollouts is plan.rollouts
    assert rollouts.servers.base_urls == ("http://10.0.0.1:8000", "http://10.0.0.2:8000")
    assert rollouts.sync == DiskSync(transport="disk", disk_dir=tmp_path / "run" / "weight_sync")
    assert rollouts.on_rollout_loss == "continue_a_only" and not rollouts.adapter_sync
    # a configured disk_dir is kept as it is
    cfg = load_config(
        ASYNC,
        [
            *EXTERNAL,
            f"custom.extra.rollout_matching.vllm.sync={{transport: disk, disk_dir: {tmp_path}}}",
        ],
    )
    source = channel_b_plan(cfg, resolve_config(cfg, 2)).source
    assert isinstance(source, AsyncServers) and source.rollouts.sync == DiskSync(
        transport="disk", disk_dir=tmp_path
    )


@pytest.mark.parametrize("pipeline", [False, True])
def test_step_mode_over_servers_plans_a_server_step(pipeline: bool) -> None:
    overrides = [
        *EXTERNAL,
        "stage2_ab.channel_b.mode=step",
        f"stage2_ab.channel_b.enable_pipeline={pipeline}",
        "launch.nproc_per_node=1",
    ]
    cfg = load_config(ASYNC, overrides)
    plan = channel_b_plan(cfg, resolve_config(cfg, 1))
    assert isinstance(plan.source, ServerStep) and plan.source.pipeline is pipeline
    assert plan.source.rollouts.sync == HttpSync(transport="http")


def test_a_plan_file_cannot_hold_async_without_servers(tmp_path: Path) -> None:
    cfg = load_config(ASYNC, EXTERNAL)
    path = write_train_plan(tmp_path / "plan.json", train_plan(cfg, 2))
    data = json.loads(path.read_text())
    assert data["plan"]["channel_b"]["source"]["kind"] == "async"
    del data["plan"]["channel_b"]["source"]["rollouts"]
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"channel_b\.source\.async\.rollouts: Field required"):
        read_train_plan(path)


@pytest.mark.parametrize(
    ("overrides", "shape"),
    [
        (["stage2_ab.channel_b.target=raw_prefix"], RawPrefix()),
        (["stage2_ab.channel_b.target=clean_prefix"], CleanPrefix(insertion_order="tail_append")),
        (
            ["stage2_ab.channel_b.target=clean_prefix", "stage2_ab.channel_b.insertion_order=sorted"],
            CleanPrefix(insertion_order="sorted"),
        ),
        (["stage2_ab.channel_b.target=reordered_gt"], ReorderedGT()),
    ],
)
def test_the_target_plan_carries_the_target_form_and_its_weights(overrides: list[str], shape: object) -> None:
    weights = [
        "stage2_ab.desc_ce_weight=0.4",
        "stage2_ab.channel_b.desc_ce_weight_matched=0.3",
        "stage2_ab.channel_b.mask_correct_matched_desc=false",
        "stage2_ab.channel_b.duplicate_iou_threshold=0.6",
    ]
    cfg = load_config(EXAMPLES / "tiny" / "train_ab.yaml", [*overrides, *weights])
    target = channel_b_plan(cfg, resolve_config(cfg, 1)).target
    assert target.shape == shape and target.kind == cfg.stage2_ab.channel_b.target  # type: ignore[union-attr]
    assert target.insertion_order == cfg.stage2_ab.channel_b.insertion_order  # type: ignore[union-attr]
    assert (target.desc_ce_weight_missed, target.desc_ce_weight_matched) == (0.4, 0.3)
    assert not target.mask_correct_matched_desc and target.duplicate_iou_threshold == 0.6


def test_the_match_costs_come_from_the_gate_costs_and_the_match_section() -> None:
    overrides = [
        "custom.extra.rollout_matching.iou_gate=0.4",
        "custom.extra.rollout_matching.fp_cost=2.0",
        "custom.extra.rollout_matching.fn_cost=3.0",
        "stage2_ab.channel_b.match.assignment=greedy_iou",
        "stage2_ab.channel_b.match.desc_gated=true",
    ]
    cfg = load_config(EXAMPLES / "tiny" / "train_ab.yaml", overrides)
    assert channel_b_plan(cfg, resolve_config(cfg, 1)).match == MatchCosts(
        iou_gate=0.4, fp_cost=2.0, fn_cost=3.0, assignment="greedy_iou", desc_gated=True
    )
    default = load_config(EXAMPLES / "tiny" / "train_ab.yaml")
    assert channel_b_plan(default, resolve_config(default, 1)).match == MatchCosts()
