"""`StagectlConfig`: the one config model, the `Problem` a validator reports, and the values derived from
a valid config (`resolve_*`: GAS, the rollout budget, the decode chunk size). The cross-section rules
themselves are the `validate_*` functions of `stagectl.config.validators`."""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import Field

from stagectl.config.base import StrictModel
from stagectl.config.fractions import as_fraction
from stagectl.config.model_data import DataConfig, ModelConfig
from stagectl.config.rollout import CustomConfig, RolloutServerConfig
from stagectl.config.stage2_ab import Stage2ABConfig
from stagectl.config.stage_b import (
    GuidanceConfig,
    ManualReviewConfig,
    OutputConfig,
    ReflectionConfig,
    RunnerConfig,
    SamplerConfig,
    SelectionConfig,
)
from stagectl.config.training import LaunchConfig, TrainingConfig
from stagectl.config.user_path import UserPath

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})


class StagectlConfig(StrictModel):
    model: ModelConfig = Field(default_factory=ModelConfig)
    """The policy model."""
    data: DataConfig | None = None
    """Training data (train-ab)."""
    global_max_length: int = Field(2048, ge=64)
    """Longest packed sequence in tokens (`packing_length`)."""
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    """Optimizer loop."""
    launch: LaunchConfig = Field(default_factory=LaunchConfig)
    """Process launch."""
    custom: CustomConfig = Field(default_factory=CustomConfig)
    """Trainer variant and rollout matching."""
    stage2_ab: Stage2ABConfig | None = None
    """Stage-2 AB schedule and Channel-B mode (train-ab)."""
    rollout_server: RolloutServerConfig = Field(default_factory=RolloutServerConfig)
    """The rollout server (`stagectl rollout-server`, or embedded in train-ab)."""
    mission: str | None = None
    """Stage-B mission name (selects tickets and guidance). It names the run directory, so a plain name: letters
    of any script, digits, `_ . -`, first a letter or digit (`shapes_qc`, `挡风板安装检查`)."""
    tickets: list[UserPath] = Field(default_factory=list)
    """Stage-B tickets JSONL files."""
    guidance: GuidanceConfig | None = None
    """Stage-B mission guidance."""
    output: OutputConfig = Field(default_factory=OutputConfig)
    """Stage-B artifacts."""
    sampler: SamplerConfig = Field(default_factory=SamplerConfig)
    """Stage-B candidate sampling."""
    runner: RunnerConfig = Field(default_factory=RunnerConfig)
    """Stage-B epochs and batching."""
    reflection: ReflectionConfig = Field(default_factory=ReflectionConfig)
    """Stage-B guidance reflection."""
    selection: SelectionConfig = Field(default_factory=SelectionConfig)
    """Stage-B verdict selection."""
    manual_review: ManualReviewConfig = Field(default_factory=ManualReviewConfig)
    """Stage-B manual review queue."""

    # Values derived by `resolve_config` (not keys of the YAML file).
    @property
    def packing_length(self) -> int:
        return self.global_max_length


@dataclass(frozen=True)
class Problem:
    """One config problem: the dotted key path and what is wrong plus what to do."""

    path: str
    message: str
    # other keys a cross-section rule judged by: when one of them was itself invalid (dropped, read as its
    # default), the problem is about a value the user did not write, and is not reported
    about: tuple[str, ...] = ()

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


@dataclass(frozen=True)
class Resolved:
    """Values derived from the config and the world size."""

    world_size: int
    gradient_accumulation_steps: int
    rollouts_per_step: int
    rollout_decode_batch_size: int


def is_train_ab(cfg: StagectlConfig) -> bool:
    return cfg.stage2_ab is not None or cfg.data is not None


def uses_server_rollouts(cfg: StagectlConfig) -> bool:
    rm = cfg.custom.extra.rollout_matching
    return rm.rollout_backend == "vllm" and rm.vllm.mode == "server"


# ---------------------------------------------------------------- resolvers


def resolve_config(cfg: StagectlConfig, world_size: int) -> Resolved:
    """Derive GAS, the rollout budget and the decode chunk size (call after validation passed)."""
    gas = resolve_gas(cfg, world_size) or 1
    pdbs = cfg.training.per_device_train_batch_size
    cb = cfg.stage2_ab.channel_b if cfg.stage2_ab else None
    rollouts = (cb.rollouts_per_step if cb else None) or pdbs * world_size * gas
    decode_bs = (cb.rollout_decode_batch_size if cb else None) or (
        cfg.custom.extra.rollout_matching.decode_batch_size
    )
    return Resolved(
        world_size=world_size,
        gradient_accumulation_steps=gas,
        rollouts_per_step=rollouts,
        rollout_decode_batch_size=decode_bs,
    )


def resolve_gas(cfg: StagectlConfig, world_size: int) -> int | None:
    t = cfg.training
    if t.gradient_accumulation_steps is not None:
        return t.gradient_accumulation_steps
    if t.effective_batch_size is None:
        return 1
    per_step = t.per_device_train_batch_size * world_size
    if t.effective_batch_size % per_step:
        return None
    return t.effective_batch_size // per_step


def is_zero_ratio(ratio: float | str) -> bool:
    return as_fraction(ratio) == 0
