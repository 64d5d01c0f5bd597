"""`StagectlConfig`: the one config model, and its named cross-section validators.

Each `validate_*` function checks one rule across sections and returns `Problem`s (never raises), so
`load_config` can report every problem at once. `resolve_*` functions derive values.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pydantic import Field

from stagectl.config.base import StrictModel
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
    """Stage-B mission name (selects tickets and guidance)."""
    tickets: list[Path] = Field(default_factory=list)
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


# ---------------------------------------------------------------- validators (one rule each)


def validate_b_ratio_present(cfg: StagectlConfig, world_size: int) -> list[Problem]:
    if not is_train_ab(cfg):
        return []
    if cfg.stage2_ab is None or cfg.stage2_ab.schedule.b_ratio is None:
        return [
            Problem(
                "stage2_ab.schedule.b_ratio",
                "required for custom.trainer_variant: stage2_ab_training; set it to the fraction of "
                "Channel-B optimizer steps (0.0 = A only, 1.0 = B only, e.g. 0.25)",
            )
        ]
    return []


def validate_channel_b_mode_world_size(cfg: StagectlConfig, world_size: int) -> list[Problem]:
    if cfg.stage2_ab is None or cfg.stage2_ab.channel_b.mode != "step" or world_size <= 1:
        return []
    ratio = cfg.stage2_ab.schedule.b_ratio
    if ratio is not None and _is_zero(ratio):
        return []  # A-only runs never enter Channel-B, so step mode is harmless on many ranks
    return [
        Problem(
            "stage2_ab.channel_b.mode",
            f"'step' runs Channel-B on one learner rank only, but the world size is {world_size}; "
            "use stage2_ab.channel_b.mode: async (with server rollouts) for multi-rank Channel-B, "
            "or run with one process",
        )
    ]


def validate_async_needs_server_rollouts(cfg: StagectlConfig, world_size: int) -> list[Problem]:
    if cfg.stage2_ab is None or cfg.stage2_ab.channel_b.mode != "async":
        return []
    rm = cfg.custom.extra.rollout_matching
    problems = []
    if rm.rollout_backend != "vllm":
        problems.append(
            Problem(
                "custom.extra.rollout_matching.rollout_backend",
                "stage2_ab.channel_b.mode: async needs server rollouts; set rollout_backend: vllm "
                "with vllm.mode: server (a stagectl rollout-server, engine hf or vllm)",
            )
        )
    if rm.vllm.mode != "server":
        problems.append(
            Problem(
                "custom.extra.rollout_matching.vllm.mode",
                "stage2_ab.channel_b.mode: async needs vllm.mode: server",
            )
        )
    if rm.vllm.sync.mode != "full":
        problems.append(
            Problem(
                "custom.extra.rollout_matching.vllm.sync.mode",
                "stage2_ab.channel_b.mode: async needs vllm.sync.mode: full (versioned full weight sync)",
            )
        )
    return problems


def validate_sync_mode_supported(cfg: StagectlConfig, world_size: int) -> list[Problem]:
    rm = cfg.custom.extra.rollout_matching
    if rm.vllm.sync.mode == "adapter" and not (cfg.stage2_ab and cfg.stage2_ab.channel_b.mode == "async"):
        return [
            Problem(
                "custom.extra.rollout_matching.vllm.sync.mode",
                "stagectl syncs full weights only; set vllm.sync.mode: full",
            )
        ]
    return []


def validate_colocate_unsupported(cfg: StagectlConfig, world_size: int) -> list[Problem]:
    rm = cfg.custom.extra.rollout_matching
    if rm.rollout_backend == "vllm" and rm.vllm.mode == "colocate":
        return [
            Problem(
                "custom.extra.rollout_matching.vllm.mode",
                "colocate is not supported; use vllm.mode: server (a rollout server) or "
                "rollout_backend: hf (the learner generates in-process)",
            )
        ]
    return []


def validate_pipeline_needs_server(cfg: StagectlConfig, world_size: int) -> list[Problem]:
    if cfg.stage2_ab is None or not cfg.stage2_ab.channel_b.enable_pipeline:
        return []
    problems = []
    if not uses_server_rollouts(cfg):
        problems.append(
            Problem(
                "stage2_ab.channel_b.enable_pipeline",
                "the in-step pipeline overlaps server rollouts with learning; it needs "
                "custom.extra.rollout_matching.rollout_backend: vllm with vllm.mode: server, "
                "or set enable_pipeline: false",
            )
        )
    if cfg.stage2_ab.channel_b.mode != "step":
        problems.append(
            Problem(
                "stage2_ab.channel_b.enable_pipeline",
                "applies to step mode only (async mode always overlaps); set enable_pipeline: false",
            )
        )
    return problems


def validate_async_queue_limits(cfg: StagectlConfig, world_size: int) -> list[Problem]:
    if cfg.stage2_ab is None or cfg.stage2_ab.channel_b.mode != "async":
        return []
    acfg = cfg.stage2_ab.channel_b.async_
    gas = _gas(cfg, world_size)
    problems = []
    if gas is not None and acfg.queue_limit < gas:
        problems.append(
            Problem(
                "stage2_ab.channel_b.async.queue_limit",
                f"{acfg.queue_limit} is smaller than gradient_accumulation_steps ({gas}): a B step needs GAS "
                f"packs of one version on every rank, so the feasibility gate could never pass; "
                f"set queue_limit >= {gas}",
            )
        )
    if acfg.prefetch_target_packs > acfg.queue_limit:
        problems.append(
            Problem(
                "stage2_ab.channel_b.async.prefetch_target_packs",
                f"{acfg.prefetch_target_packs} is larger than queue_limit ({acfg.queue_limit}): the "
                "prefetcher would produce packs only to drop them; set prefetch_target_packs <= queue_limit",
            )
        )
    if gas is not None and acfg.prefetch_target_packs < gas:
        problems.append(
            Problem(
                "stage2_ab.channel_b.async.prefetch_target_packs",
                f"{acfg.prefetch_target_packs} is smaller than gradient_accumulation_steps ({gas}): a B "
                f"step needs GAS packs queued; set prefetch_target_packs >= {gas}",
            )
        )
    return problems


def validate_batch_sizes(cfg: StagectlConfig, world_size: int) -> list[Problem]:
    t = cfg.training
    if t.effective_batch_size is None:
        return []
    per_step = t.per_device_train_batch_size * world_size
    if t.gradient_accumulation_steps is None:
        if t.effective_batch_size % per_step:
            return [
                Problem(
                    "training.effective_batch_size",
                    f"{t.effective_batch_size} is not a multiple of per_device_train_batch_size x world_size "
                    f"({t.per_device_train_batch_size} x {world_size} = {per_step}); pick a multiple of "
                    f"{per_step} or set gradient_accumulation_steps instead",
                )
            ]
        return []
    if per_step * t.gradient_accumulation_steps != t.effective_batch_size:
        return [
            Problem(
                "training.effective_batch_size",
                f"{t.effective_batch_size} != per_device_train_batch_size x world_size x "
                f"gradient_accumulation_steps ({t.per_device_train_batch_size} x {world_size} x "
                f"{t.gradient_accumulation_steps}); remove one of effective_batch_size / gradient_accumulation_steps",
            )
        ]
    return []


def validate_server_security(cfg: StagectlConfig, world_size: int) -> list[Problem]:
    rs = cfg.rollout_server
    if rs.host not in LOOPBACK_HOSTS and not rs.auth_token_env:
        return [
            Problem(
                "rollout_server.auth_token_env",
                f"the server binds {rs.host!r} (beyond loopback), so weight/admin endpoints need a bearer "
                "token; set auth_token_env to the name of an environment variable holding it, or bind 127.0.0.1",
            )
        ]
    return []


def validate_embedded_server(cfg: StagectlConfig, world_size: int) -> list[Problem]:
    if not cfg.rollout_server.embedded:
        return []
    problems = []
    if not uses_server_rollouts(cfg):
        problems.append(
            Problem(
                "rollout_server.embedded",
                "an embedded server feeds server-mode rollouts; set custom.extra.rollout_matching."
                "rollout_backend: vllm (vllm.mode: server) or embedded: false",
            )
        )
    if cfg.custom.extra.rollout_matching.vllm.server.servers:
        problems.append(
            Problem(
                "custom.extra.rollout_matching.vllm.server.servers",
                "rollout_server.embedded: true starts its own server on a free loopback port; "
                "remove servers or set embedded: false",
            )
        )
    return problems


def validate_server_list(cfg: StagectlConfig, world_size: int) -> list[Problem]:
    if not is_train_ab(cfg) or not uses_server_rollouts(cfg) or cfg.rollout_server.embedded:
        return []
    if cfg.custom.extra.rollout_matching.vllm.server.servers:
        return []
    return [
        Problem(
            "custom.extra.rollout_matching.vllm.server.servers",
            "server-mode rollouts need at least one server: add `- base_url: http://127.0.0.1:8000` "
            "or set rollout_server.embedded: true",
        )
    ]


def validate_stage_b(cfg: StagectlConfig, world_size: int) -> list[Problem]:
    if cfg.mission is None and not cfg.tickets and cfg.guidance is None:
        return []
    problems = []
    if cfg.mission is None:
        problems.append(Problem("mission", "required for Stage-B; set the mission name"))
    if not cfg.tickets:
        problems.append(Problem("tickets", "required for Stage-B; list the tickets JSONL files"))
    if cfg.guidance is None:
        problems.append(
            Problem("guidance.path", "required for Stage-B; point it at the mission guidance JSON")
        )
    return problems


VALIDATORS = (
    validate_b_ratio_present,
    validate_channel_b_mode_world_size,
    validate_async_needs_server_rollouts,
    validate_sync_mode_supported,
    validate_colocate_unsupported,
    validate_pipeline_needs_server,
    validate_async_queue_limits,
    validate_batch_sizes,
    validate_server_security,
    validate_embedded_server,
    validate_server_list,
    validate_stage_b,
)


def run_validators(cfg: StagectlConfig, world_size: int) -> list[Problem]:
    problems: list[Problem] = []
    for check in VALIDATORS:
        problems.extend(check(cfg, world_size))
    return problems


# ---------------------------------------------------------------- resolvers


def resolve_config(cfg: StagectlConfig, world_size: int) -> Resolved:
    """Derive GAS, the rollout budget and the decode chunk size (call after validation passed)."""
    gas = _gas(cfg, world_size) or 1
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


def _gas(cfg: StagectlConfig, world_size: int) -> int | None:
    t = cfg.training
    if t.gradient_accumulation_steps is not None:
        return t.gradient_accumulation_steps
    if t.effective_batch_size is None:
        return 1
    per_step = t.per_device_train_batch_size * world_size
    if t.effective_batch_size % per_step:
        return None
    return t.effective_batch_size // per_step


def _is_zero(ratio: float | str) -> bool:
    from stagectl.schedule import as_fraction

    return as_fraction(ratio) == 0
