"""train-ab's plan: `TrainPlan` (what the launcher resolves once and every torchrun rank reads from
`--plan FILE`; rank 0 keeps it as `plan.json` in the run directory), the loss weights, and Channel-B's part
(`channel_b_plan`: the source union, the target shape, the match costs, the sampling) resolved from a
validated config. The parts themselves live in `stagectl.config.plan`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from stagectl.config.fractions import as_fraction
from stagectl.config.loader import to_plain
from stagectl.config.model_data import DataConfig, ModelConfig
from stagectl.config.placement import CpuSides
from stagectl.config.plan import (
    AsyncQueue,
    AsyncServers,
    ChannelBPlan,
    CleanPrefix,
    EvalPlan,
    InProcessStep,
    PlainConfig,
    RawPrefix,
    ReorderedGT,
    ServerStep,
    TargetPlan,
    eval_plan,
    match_costs,
    plan_file_model,
    read_plan,
    server_rollouts,
    write_plan,
)
from stagectl.config.root import Resolved, StagectlConfig, resolve_config, uses_server_rollouts
from stagectl.config.sampling import SamplingSpec
from stagectl.config.training import LaunchConfig, TrainingConfig, WatchdogConfig


@dataclass(frozen=True)
class LossWeights:
    """`stage2_ab`'s geometry and coordinate loss weights, both channels (`learner.loss.compute_loss`); the
    desc CE weights are the target's (`TargetPlan`)."""

    bbox_smoothl1: float = 1.0
    bbox_ciou: float = 1.0
    coord_ce: float = 0.0
    coord_gate: float = 1.0
    smoothl1_beta: float = 0.05  # in box units of [0, 1]
    coord_ce_vocab: Literal["full", "coord"] = "full"


@dataclass(frozen=True)
class TrainPlan:
    """What `train-ab` runs: resolved once by the launcher, read by every rank."""

    model: ModelConfig
    data: DataConfig
    training: TrainingConfig
    launch: LaunchConfig
    resolved: Resolved
    packing_length: int
    b_ratio: str  # the schedule's exact fraction, e.g. "1/4"
    loss: LossWeights
    channel_b: ChannelBPlan
    cpus: CpuSides  # what a rank pins itself to (`stagectl.placement.place_learner_rank`)
    # the validated config as plain data (aliases as in YAML), for rank 0's `config.yaml` and W&B's run config
    run_config: PlainConfig
    eval: EvalPlan | None = None

    @property
    def output_dir(self) -> Path:
        return self.training.output_dir

    @property
    def watchdog(self) -> WatchdogConfig:
        return self.launch.watchdog


# ---------------------------------------------------------------- resolving


def channel_b_plan(cfg: StagectlConfig, resolved: Resolved) -> ChannelBPlan:
    """Channel-B's part (call on a validated train-ab config)."""
    assert cfg.stage2_ab is not None
    cb = cfg.stage2_ab.channel_b
    rm = cfg.custom.extra.rollout_matching
    source: InProcessStep | ServerStep | AsyncServers
    if not uses_server_rollouts(cfg):
        source = InProcessStep()
    elif cb.mode == "async":
        a = cb.async_
        source = AsyncServers(
            server_rollouts(cfg),
            AsyncQueue(
                queue_limit=a.queue_limit,
                version_window=a.version_window,
                prefetch_target_packs=a.prefetch_target_packs,
                sync_every_steps=a.sync_every_steps,
                max_consecutive_failures=a.max_consecutive_failures,
                in_flight_sync=a.in_flight_sync,
            ),
        )
    else:
        source = ServerStep(server_rollouts(cfg), pipeline=cb.enable_pipeline)
    shape: RawPrefix | CleanPrefix | ReorderedGT
    if cb.target == "clean_prefix":
        shape = CleanPrefix(insertion_order=cb.insertion_order)
    elif cb.target == "reordered_gt":
        shape = ReorderedGT()
    else:
        shape = RawPrefix()
    return ChannelBPlan(
        source=source,
        target=TargetPlan(
            shape=shape,
            desc_ce_weight_missed=cfg.stage2_ab.desc_ce_weight,
            desc_ce_weight_matched=cb.desc_ce_weight_matched,
            mask_correct_matched_desc=cb.mask_correct_matched_desc,
            duplicate_iou_threshold=cb.duplicate_iou_threshold,
        ),
        match=match_costs(cfg),
        sampling=SamplingSpec.for_channel_b(rm),
        rollouts_per_step=resolved.rollouts_per_step,
        decode_batch_size=resolved.rollout_decode_batch_size,
        gallery_steps=cb.gallery_steps,
        b_ratio_tolerance=cb.b_ratio_tolerance,
    )


def train_plan(cfg: StagectlConfig, world_size: int) -> TrainPlan:
    """Resolve a validated train-ab config for `world_size` learner ranks."""
    ratio = cfg.stage2_ab.schedule.b_ratio if cfg.stage2_ab is not None else None
    if cfg.stage2_ab is None or ratio is None:
        raise ValueError("train-ab needs a stage2_ab section (stage2_ab.schedule.b_ratio)")
    if cfg.data is None:
        raise ValueError("data: required for train-ab; set data.synthetic or data.train_jsonl")
    resolved = resolve_config(cfg, world_size)
    ab = cfg.stage2_ab
    return TrainPlan(
        model=cfg.model,
        data=cfg.data,
        training=cfg.training,
        launch=cfg.launch,
        resolved=resolved,
        packing_length=cfg.packing_length,
        b_ratio=str(as_fraction(ratio)),
        loss=LossWeights(
            bbox_smoothl1=ab.bbox_smoothl1_weight,
            bbox_ciou=ab.bbox_ciou_weight,
            coord_ce=ab.coord_ce_weight,
            coord_gate=ab.coord_gate_weight,
            smoothl1_beta=ab.bbox_smoothl1_beta,
            coord_ce_vocab=ab.coord_ce_vocab,
        ),
        channel_b=channel_b_plan(cfg, resolved),
        cpus=CpuSides.of(cfg),
        run_config=dict(to_plain(cfg)),
        eval=eval_plan(cfg),
    )


_TRAIN_PLAN_FILE = plan_file_model(TrainPlan)


def write_train_plan(path: Path, plan: TrainPlan) -> Path:
    return write_plan(path, _TRAIN_PLAN_FILE, plan)


def read_train_plan(path: Path) -> TrainPlan:
    plan: TrainPlan = read_plan(path, _TRAIN_PLAN_FILE, "train-ab")
    return plan
