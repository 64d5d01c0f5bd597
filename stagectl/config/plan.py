"""The resolved plan: the parts of a valid config each component receives (the YAML stays the contract;
every command resolves it once, here, and hands out parts; no component outside `config/` and `cli/`
reads the root `StagectlConfig`).

Parts are frozen and named for their purpose. Where the YAML spells one choice with several keys that
validators keep consistent (where Channel-B's rollouts come from: `rollout_backend`, `vllm.mode`,
`channel_b.mode`, `enable_pipeline`; the target with its `insertion_order`), the plan holds one union,
so a combination the validators refuse cannot be built:

    ChannelBPlan.source:  InProcessStep | ServerStep(servers, pipeline) | AsyncServers(servers, queue)
    TargetPlan.shape:     RawPrefix | CleanPrefix(insertion_order) | ReorderedGT

Each command's plan is built in its own module from these parts: `plan_train` (train-ab's `TrainPlan`),
`plan_server`, `plan_stage_b`, `plan_eval`. A plan that torchrun ranks read travels as a file written by
`write_plan` and read by `read_plan` (JSON; a `.inf` key survives it).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    ValidationError,
    create_model,
)

from stagectl.config.model_data import EvalDataConfig, ScoreKind
from stagectl.config.rollout import DiskSync, RolloutMatchingConfig, VllmSyncConfig
from stagectl.config.root import StagectlConfig
from stagectl.config.sampling import SamplingSpec
from stagectl.config.stage2_ab import ChannelBConfig
from stagectl.config.stage_b import StageBServerConfig

PLAN_FILE = "plan.json"
SERVERS_KEY = "custom.extra.rollout_matching.vllm.server"

PlainConfig = Annotated[
    dict[str, Any],
    PlainSerializer(lambda plain: yaml.safe_dump(plain, sort_keys=False), return_type=str, when_used="json"),
    BeforeValidator(lambda value: yaml.safe_load(value) if isinstance(value, str) else value),
]
"""The validated config as plain data (aliases as in YAML), kept for `config.yaml` and W&B's run config. In a
plan file it is the YAML text itself, so every value (`.inf` included) reads back exactly."""


# ---------------------------------------------------------------- parts shared by several commands


@dataclass(frozen=True)
class ServerList:
    """Rollout servers a client talks to: train-ab's Channel-B and eval, `stagectl eval --server`, and
    Stage-B's `runner.engine: server` alike. `key` is the config section it came from (for messages)."""

    base_urls: tuple[str, ...]
    key: str = SERVERS_KEY
    auth_token_env: str | None = None
    tls_ca_file: Path | None = None
    tls_skip_verify: bool = False
    infer_timeout_s: float | None = 600.0  # each call whole within it; None: no limit
    wait_healthy_s: float = 120.0
    wait_healthy_key: str = f"{SERVERS_KEY}.timeout_s"  # the config key of `wait_healthy_s` (for messages)

    @property
    def token_key(self) -> str:
        """The config key that names the token's environment variable."""
        return f"{self.key}.auth_token_env"

    @classmethod
    def of_rollout_matching(cls, rm: RolloutMatchingConfig) -> ServerList:
        server = rm.vllm.server
        timeout = server.infer_timeout_s
        return cls(
            base_urls=tuple(s.base_url.rstrip("/") for s in server.servers),
            key=SERVERS_KEY,
            auth_token_env=server.auth_token_env,
            tls_ca_file=server.tls_ca_file,
            tls_skip_verify=server.tls_skip_verify,
            infer_timeout_s=timeout if timeout is not None and timeout > 0 else None,
            wait_healthy_s=server.timeout_s,
        )

    @classmethod
    def of_stage_b(cls, server: StageBServerConfig) -> ServerList:
        return cls(
            base_urls=tuple(url.rstrip("/") for url in server.base_urls),
            key="runner.server",
            auth_token_env=server.auth_token_env,
            tls_ca_file=server.tls_ca_file,
            tls_skip_verify=server.tls_skip_verify,
            infer_timeout_s=server.infer_timeout_s,
            wait_healthy_s=server.wait_healthy_s,
            wait_healthy_key="runner.server.wait_healthy_s",
        )


@dataclass(frozen=True)
class MatchCosts:
    """How predictions are paired with ground truth: the IoU gate, the costs of an unmatched prediction
    or object, the assignment and whether only equal descs may match. The default is evaluation's:
    Hungarian on boxes alone."""

    iou_gate: float = 0.3
    fp_cost: float = 1.0
    fn_cost: float = 1.0
    assignment: Literal["hungarian", "greedy_iou"] = "hungarian"
    desc_gated: bool = False


# ---------------------------------------------------------------- Channel-B


@dataclass(frozen=True)
class RawPrefix:
    """The rollout's own token prefix, FP and invalid entries masked, missed GT appended."""

    kind: Literal["raw_prefix"] = "raw_prefix"


@dataclass(frozen=True)
class CleanPrefix:
    """The matched predictions re-serialised, FP / invalid / duplicates dropped, missed GT inserted."""

    kind: Literal["clean_prefix"] = "clean_prefix"
    insertion_order: Literal["tail_append", "sorted"] = "tail_append"


@dataclass(frozen=True)
class ReorderedGT:
    """The GT objects the rollout found in its order, then the missed ones, all teacher-forced."""

    kind: Literal["reordered_gt"] = "reordered_gt"


TargetShape = Annotated[RawPrefix | CleanPrefix | ReorderedGT, Field(discriminator="kind")]


@dataclass(frozen=True)
class TargetPlan:
    """How a judged rollout becomes the B target (docs/training.md, "Channel-B targets")."""

    shape: TargetShape = field(default_factory=RawPrefix)
    desc_ce_weight_missed: float = 1.0  # `stage2_ab.desc_ce_weight`
    desc_ce_weight_matched: float = 0.0
    mask_correct_matched_desc: bool = True
    duplicate_iou_threshold: float = 0.7

    @property
    def kind(self) -> Literal["raw_prefix", "clean_prefix", "reordered_gt"]:
        return self.shape.kind

    @property
    def insertion_order(self) -> Literal["tail_append", "sorted"]:
        return self.shape.insertion_order if isinstance(self.shape, CleanPrefix) else "tail_append"


@dataclass(frozen=True)
class ServerRollouts:
    """Where server rollouts come from and how the learner's weights reach them."""

    servers: ServerList
    sync: VllmSyncConfig  # a disk sync's `disk_dir` is resolved (default `{output_dir}/weight_sync`)
    on_rollout_loss: Literal["stop", "continue_a_only"] = "stop"
    rollout_loss_timeout_s: float = 300.0

    @property
    def adapter_sync(self) -> bool:
        return self.sync.mode == "adapter"


@dataclass(frozen=True)
class AsyncQueue:
    """`stage2_ab.channel_b.async`: the ready-pack queue, pacing and sync cadence."""

    queue_limit: int = 8
    version_window: int = 1
    prefetch_target_packs: int = 4
    sync_every_steps: int = 1
    max_consecutive_failures: int = 3
    in_flight_sync: bool = True


@dataclass(frozen=True)
class InProcessStep:
    """Step mode on the learner's own model (`rollout_backend: hf`)."""

    kind: Literal["in_process_step"] = "in_process_step"


@dataclass(frozen=True)
class ServerStep:
    """Step mode over rollout servers; `pipeline`: a producer thread overlaps rollout with learning."""

    rollouts: ServerRollouts
    pipeline: bool = False
    kind: Literal["server_step"] = "server_step"


@dataclass(frozen=True)
class AsyncServers:
    """Async mode: a per-rank prefetcher fed by rollout servers."""

    rollouts: ServerRollouts
    queue: AsyncQueue = field(default_factory=AsyncQueue)
    kind: Literal["async"] = "async"


ChannelBSource = Annotated[InProcessStep | ServerStep | AsyncServers, Field(discriminator="kind")]


@dataclass(frozen=True)
class ChannelBPlan:
    """Everything Channel-B needs: where rollouts come from, how they are sampled, judged and turned into
    targets, and how many a B step takes."""

    source: ChannelBSource
    target: TargetPlan
    match: MatchCosts
    sampling: SamplingSpec
    rollouts_per_step: int
    decode_batch_size: int
    gallery_steps: int = 4
    b_ratio_tolerance: float = 0.05

    @property
    def rollouts(self) -> ServerRollouts | None:
        """The server side of the source; None for in-process rollouts."""
        return None if isinstance(self.source, InProcessStep) else self.source.rollouts


# ---------------------------------------------------------------- the rest of train-ab


@dataclass(frozen=True)
class EvalPlan:
    """The held-out eval (train-ab's periodic eval and `stagectl eval`): the split, its rollouts' sampling
    and chunk size, and the score COCO AP ranks objects by. Matching is the evaluator's own, not a key:
    box-only Hungarian at IoU 0.5 (`evaluation.core.EVAL_MATCH`)."""

    data: EvalDataConfig
    box_format: Literal["norm1000", "pixel", "auto"]
    sampling: SamplingSpec
    chunk_size: int  # `rollout_matching.decode_batch_size`: images per generate call
    duplicate_iou_threshold: float = 0.7  # `stage2_ab.channel_b.duplicate_iou_threshold`

    @property
    def score(self) -> ScoreKind:
        """`data.eval.score`: the per-object score COCO AP ranks by."""
        return self.data.score


# ---------------------------------------------------------------- resolving


def match_costs(cfg: StagectlConfig) -> MatchCosts:
    rm = cfg.custom.extra.rollout_matching
    how = cfg.stage2_ab.channel_b.match if cfg.stage2_ab is not None else None
    return MatchCosts(
        iou_gate=rm.iou_gate,
        fp_cost=rm.fp_cost,
        fn_cost=rm.fn_cost,
        assignment=how.assignment if how is not None else "hungarian",
        desc_gated=how.desc_gated if how is not None else False,
    )


def server_rollouts(cfg: StagectlConfig) -> ServerRollouts:
    """The rollout servers of `custom.extra.rollout_matching` and the weight sync to them."""
    rm = cfg.custom.extra.rollout_matching
    sync = rm.vllm.sync
    if isinstance(sync, DiskSync) and sync.disk_dir is None:
        sync = sync.model_copy(update={"disk_dir": cfg.training.output_dir / "weight_sync"})
    cb = cfg.stage2_ab.channel_b if cfg.stage2_ab is not None else None
    return ServerRollouts(
        servers=ServerList.of_rollout_matching(rm),
        sync=sync,
        on_rollout_loss=cb.on_rollout_loss if cb is not None else "stop",
        rollout_loss_timeout_s=cb.rollout_loss_timeout_s if cb is not None else 300.0,
    )


def eval_plan(cfg: StagectlConfig) -> EvalPlan | None:
    """The held-out eval of `data.eval` (None without one)."""
    if cfg.data is None or cfg.data.eval is None:
        return None
    rm = cfg.custom.extra.rollout_matching
    cb = cfg.stage2_ab.channel_b if cfg.stage2_ab is not None else ChannelBConfig()
    return EvalPlan(
        data=cfg.data.eval,
        box_format=cfg.data.box_format,
        sampling=SamplingSpec.for_eval(rm, cfg.data.eval.decoding),
        chunk_size=rm.decode_batch_size,
        duplicate_iou_threshold=cb.duplicate_iou_threshold,
    )


P = TypeVar("P")
# plan files are JSON; a float key set to `.inf` (a timeout that never fires) must read back as inf, not null
_FILE_CONFIG = ConfigDict(ser_json_inf_nan="strings")


def plan_file_model(kind: type[P]) -> type[BaseModel]:
    """The model of a plan file: `{"plan": ...}` with non-finite floats written as JSON strings."""
    return create_model(f"{kind.__name__}File", __config__=_FILE_CONFIG, plan=(kind, ...))


def write_plan(path: Path, file_model: type[BaseModel], plan: object) -> Path:
    """Write `plan` as JSON to `path` atomically (a reader never sees half a plan)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(file_model(plan=plan).model_dump_json(indent=1, by_alias=True), encoding="utf-8")
    os.replace(tmp, path)
    return path


def read_plan(path: Path, file_model: type[BaseModel], command: str) -> Any:
    """The `command`'s plan in `path`; `ValueError` naming the file when it is missing or unreadable."""
    try:
        return file_model.model_validate_json(path.read_bytes()).plan  # type: ignore[attr-defined]
    except FileNotFoundError:
        raise ValueError(f"{path}: the resolved plan the launcher writes for the ranks is missing") from None
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc'][1:])) or '(the file)'}: {e['msg']}" for e in exc.errors()[:3]
        )
        more = f" (and {exc.error_count() - 3} more)" if exc.error_count() > 3 else ""
        raise ValueError(f"{path}: not a {command} plan this stagectl can read: {problems}{more}") from None
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not a {command} plan this stagectl can read: {exc}") from None
