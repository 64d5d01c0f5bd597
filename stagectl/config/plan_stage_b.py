"""Stage-B's part of a config (`StageBPlan`), resolved once by `stagectl stage-b`'s launcher: the mission
and its inputs, where the run directory is, how candidates and reflections are sampled, the loop's sizes
and deadlines, and the backend that answers. torchrun's ranks get it as a file (`--plan`, written
by `write_stage_b_plan`, read by `read_stage_b_plan`) and never parse the YAML; rank 0 also writes it to the
run directory as `plan.json`.

`runner.engine` and its settings become one union, so a backend without its settings cannot be built:

    StageBPlan.backend:  ModelBackendPlan(model, max_batch_size) | ServerBackendPlan(servers) | RulesBackendPlan

The YAML stays the contract (`stagectl.config.stage_b`); the validators keep reporting a bad combination
with its key path, and the builder here refuses what they refuse.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field

from stagectl.config.loader import to_plain
from stagectl.config.model_data import ModelConfig
from stagectl.config.plan import PlainConfig, ServerList, plan_file_model, read_plan, write_plan
from stagectl.config.root import StagectlConfig
from stagectl.config.sampling import SamplingSpec
from stagectl.config.stage_b import GuidanceConfig, OutputConfig, SelectionConfig
from stagectl.config.training import WatchdogConfig

NO_SERVER = "runner.engine: server needs at least one rollout server URL, e.g. [http://127.0.0.1:8000]"


@dataclass(frozen=True)
class ModelBackendPlan:
    """`runner.engine: model`: every rank loads `model` on its own device; a judge call is at most
    `max_batch_size` requests (`runner.per_rank_rollout_batch_size`)."""

    model: ModelConfig
    max_batch_size: int
    kind: Literal["model"] = "model"


@dataclass(frozen=True)
class ServerBackendPlan:
    """`runner.engine: server`: rollouts from the rollout servers of `runner.server`."""

    servers: ServerList
    kind: Literal["server"] = "server"

    def __post_init__(self) -> None:
        if not self.servers.base_urls:
            raise ValueError(f"{self.servers.key}.base_urls: {NO_SERVER}")


@dataclass(frozen=True)
class RulesBackendPlan:
    """`runner.engine: rules`: the deterministic rule engine, no model."""

    kind: Literal["rules"] = "rules"


BackendPlan = Annotated[ModelBackendPlan | ServerBackendPlan | RulesBackendPlan, Field(discriminator="kind")]


@dataclass(frozen=True)
class GridEntry:
    """One `sampler.grid` entry: how its candidates are sampled and the base seed of their decodes."""

    spec: SamplingSpec
    seed: int


@dataclass(frozen=True)
class SamplerPlan:
    """`sampler`: every grid entry yields `samples_per_decode` candidates per ticket."""

    grid: tuple[GridEntry, ...]
    samples_per_decode: int = 1


@dataclass(frozen=True)
class RunnerPlan:
    """`runner`'s loop sizes and seed (the engine is `StageBPlan.backend`)."""

    epochs: int = 1
    per_rank_rollout_batch_size: int = 4
    logging_steps: int = 1
    seed: int = 0
    bad_ticket_lines: Literal["error", "skip"] = "error"


@dataclass(frozen=True)
class ReflectionPlan:
    """`reflection`: when rank 0 reflects, how many operations it accepts, and how the answer is sampled."""

    batch_size: int
    max_operations: int
    sampling: SamplingSpec


@dataclass(frozen=True)
class StageBPlan:
    """What `stagectl stage-b` runs."""

    mission: str
    tickets: tuple[Path, ...]
    guidance: GuidanceConfig
    output: OutputConfig
    sampler: SamplerPlan
    runner: RunnerPlan
    reflection: ReflectionPlan
    selection: SelectionConfig
    min_vote_strength: float  # `manual_review.min_vote_strength`
    watchdog: WatchdogConfig  # `launch.watchdog`: the deadlines of every collective phase
    backend: BackendPlan
    resolved_config: PlainConfig  # the whole config as plain data, written to `config.yaml`

    @property
    def run_dir(self) -> Path:
        """`{output.root}/{output.run_name}/{mission}`: every artifact of the run (rank 0 writes)."""
        return self.output.root / self.output.run_name / self.mission


def backend_plan(cfg: StagectlConfig) -> ModelBackendPlan | ServerBackendPlan | RulesBackendPlan:
    """`runner.engine` with its settings."""
    runner = cfg.runner
    if runner.engine == "rules":
        return RulesBackendPlan()
    if runner.engine == "server":
        return ServerBackendPlan(ServerList.of_stage_b(runner.server))
    return ModelBackendPlan(cfg.model, max_batch_size=runner.per_rank_rollout_batch_size)


def stage_b_plan(cfg: StagectlConfig) -> StageBPlan:
    """Resolve a validated Stage-B config (`ValueError` for one that is not a Stage-B config)."""
    if cfg.mission is None or cfg.guidance is None:
        raise ValueError("not a Stage-B config; set mission, tickets and guidance.path")
    runner, reflection = cfg.runner, cfg.reflection
    return StageBPlan(
        mission=cfg.mission,
        tickets=tuple(cfg.tickets),
        guidance=cfg.guidance,
        output=cfg.output,
        sampler=SamplerPlan(
            grid=tuple(GridEntry(SamplingSpec.for_stage_b(e), e.seed) for e in cfg.sampler.grid),
            samples_per_decode=cfg.sampler.samples_per_decode,
        ),
        runner=RunnerPlan(
            epochs=runner.epochs,
            per_rank_rollout_batch_size=runner.per_rank_rollout_batch_size,
            logging_steps=runner.logging_steps,
            seed=runner.seed,
            bad_ticket_lines=runner.bad_ticket_lines,
        ),
        reflection=ReflectionPlan(
            batch_size=reflection.batch_size,
            max_operations=reflection.max_operations,
            sampling=SamplingSpec.for_stage_b(reflection),
        ),
        selection=cfg.selection,
        min_vote_strength=cfg.manual_review.min_vote_strength,
        watchdog=cfg.launch.watchdog,
        backend=backend_plan(cfg),
        resolved_config=dict(to_plain(cfg)),
    )


_STAGE_B_PLAN_FILE = plan_file_model(StageBPlan)


def write_stage_b_plan(path: Path, plan: StageBPlan) -> Path:
    """`plan` as JSON at `path`, written atomically."""
    return write_plan(path, _STAGE_B_PLAN_FILE, plan)


def read_stage_b_plan(path: Path) -> StageBPlan:
    """The plan at `path`; `ValueError` naming the file when it is missing or not a Stage-B plan."""
    plan: StageBPlan = read_plan(path, _STAGE_B_PLAN_FILE, "stage-b")
    return plan
