"""Stage-B sections (top-level keys `mission`, `tickets`, `guidance`, `output`, `sampler`, `runner`,
`reflection`, `selection`, `manual_review`): the training-free guidance loop."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from stagectl.config.base import StrictModel
from stagectl.config.rollout import check_server_url
from stagectl.config.user_path import UserPath

# a mission becomes a directory under output.root/output.run_name: a plain name, no separators or `..`.
# Letters and digits of any script: upstream's missions are its data directories' names (`挡风板安装检查`).
MISSION_NAME = re.compile(r"[^\W_][\w.-]*")  # whole name: `fullmatch`


class GuidanceConfig(StrictModel):
    path: UserPath
    """Starting guidance JSON of the mission (copied into the run directory, never edited in place)."""
    retention: int = Field(10, ge=1)
    """Timestamped snapshots kept per mission."""


class OutputConfig(StrictModel):
    root: UserPath = Path("runs/stage_b")
    """Artifacts go to `{root}/{run_name}/{mission}/` (rank 0 only)."""
    run_name: str = "default"
    """Run name under `root`."""


class SamplerEntry(StrictModel):
    temperature: float = Field(0.7, ge=0)
    """Sampling temperature (0 = greedy)."""
    top_p: float = Field(0.9, gt=0, le=1)
    """Nucleus mass."""
    max_new_tokens: int = Field(128, ge=1)
    """Longest candidate."""
    seed: int = 0
    """Base seed of this grid entry."""


class SamplerConfig(StrictModel):
    grid: list[SamplerEntry] = Field(default_factory=lambda: [SamplerEntry()], min_length=1)
    """Decoding settings; every entry yields `samples_per_decode` candidates per ticket."""
    samples_per_decode: int = Field(1, ge=1)
    """Candidates per grid entry."""


class StageBServerConfig(StrictModel):
    base_urls: list[str] = Field(default_factory=list)
    """Rollout servers (`stagectl rollout-server`) for `runner.engine: server`, e.g. `http://127.0.0.1:8000`;
    every rank spreads its requests over all of them."""
    auth_token_env: str | None = None
    """Environment variable holding the servers' bearer token (null: no token)."""
    tls_ca_file: UserPath | None = None
    """CA certificate(s) that `https://` servers are verified against; null: the system's trust store."""
    tls_skip_verify: bool = False
    """Talk TLS to `https://` servers without verifying their certificate. Excludes `tls_ca_file`."""
    infer_timeout_s: float = Field(600.0, gt=0)
    """Longest wait for one `/infer/` call, from the connection to the last byte of the answer (a server that
    trickles its answer cannot hold it)."""
    wait_healthy_s: float = Field(120.0, gt=0)
    """How long to wait at start for every server to answer `/health/`."""

    @field_validator("base_urls")
    @classmethod
    def validate_base_urls(cls, value: list[str]) -> list[str]:
        return [check_server_url(url) for url in value]


class RunnerConfig(StrictModel):
    epochs: int = Field(1, ge=1)
    """Passes over the tickets."""
    per_rank_rollout_batch_size: int = Field(4, ge=1)
    """Tickets per rank per global batch (global batch = this x world size)."""
    logging_steps: int = Field(1, ge=1)
    """Global batches per metrics row."""
    seed: int = 0
    """Seed of the per-epoch ticket shuffle (rank 0) and of the rollout seeds."""
    bad_ticket_lines: Literal["error", "skip"] = "error"
    """A ticket line that is not JSON, not a ticket or a duplicate: `error` stops the run before it starts,
    naming the lines; `skip` runs without them (the log names them, `progress.json`, the end line and the
    report count them). A group_id labelled pass on one line and fail on another is two tickets
    (`group_id::label`, as upstream keys them), not a bad line."""
    engine: Literal["model", "server", "rules"] = "model"
    """`model`: each rank loads `model` on its own device; `server`: rollouts from the rollout servers of
    `runner.server` (no model in the Stage-B processes); `rules`: a deterministic rule engine without a
    model, for dry runs of a mission (see `stagectl.stage_b.engine_rules`)."""
    server: StageBServerConfig = Field(default_factory=StageBServerConfig)
    """Where `engine: server` sends its requests (ignored by the other engines)."""

    @field_validator("engine", mode="before")
    @classmethod
    def _renamed_engine(cls, value: object) -> object:
        if value == "test":
            raise ValueError("`test` was renamed to `rules` (the deterministic rule engine, no model)")
        return value


class ReflectionConfig(StrictModel):
    batch_size: int = Field(4, ge=1)
    """Reflect once this many disagreeing tickets have accumulated globally (rank 0)."""
    max_operations: int = Field(3, ge=1)
    """Most guidance operations accepted from one reflection."""
    max_new_tokens: int = Field(256, ge=1)
    """Longest reflection answer."""
    temperature: float = Field(0.0, ge=0)
    """Reflection sampling temperature (0 = greedy)."""


class SelectionConfig(StrictModel):
    tie_break: Literal["fail"] = "fail"
    """Ties between pass and fail votes go to fail."""


class ManualReviewConfig(StrictModel):
    min_vote_strength: float = Field(0.0, ge=0, le=1)
    """Tickets whose winning vote share is below this go to need_review_queue.jsonl."""
