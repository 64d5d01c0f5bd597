"""The rollout server's part of a config (`ServerPlan`), resolved once by `stagectl rollout-server`: the
`rollout_server` section, the model it loads and how, the weight-sync routes it mounts and the bounds of
one `/infer/` call. The server never looks at which other sections a config has: what the config's own
caller (a train-ab learner, a Stage-B runner) asks of it is resolved here.

`LearnerServers` is the other side, as the doctor probes it: the rollout servers a train-ab learner will
use and what they must run."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from stagectl.config.engines import ENGINES
from stagectl.config.model_data import AdapterConfig
from stagectl.config.plan import ServerRollouts, server_rollouts
from stagectl.config.rollout import (
    DEFAULT_MAX_NEW_TOKENS_CAP,
    DEFAULT_MAX_REQUESTS_PER_CALL,
    TRANSPORTS,
    RolloutServerConfig,
)
from stagectl.config.root import StagectlConfig, is_train_ab, uses_server_rollouts


@dataclass(frozen=True)
class ServedModel:
    """The checkpoint a rollout server loads and how it serves it."""

    name_or_path: str
    torch_dtype: Literal["float32", "bfloat16", "float16"]
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] | None = None
    adapter: AdapterConfig | None = None
    """Set when adapter syncs arrive (`vllm.sync.mode: adapter`): an engine that merges adapters loads the
    float32 base, merges each synced adapter onto it and serves `torch_dtype`."""
    coord_tokens: bool = False
    """A train-ab config: serve the model as the learner loads it, with the coordinate tokens; otherwise
    the checkpoint as it is."""

    @property
    def adapter_sync(self) -> bool:
        return self.adapter is not None


@dataclass(frozen=True)
class ServerPlan:
    """What `stagectl rollout-server` runs."""

    server: RolloutServerConfig
    model: ServedModel
    weight_transports: frozenset[str]
    """The weight-sync routes it mounts: an embedded server (started by train-ab with its learner's config)
    its learner's `vllm.sync.transport` only; a standalone server every transport."""
    max_new_tokens_cap: int
    """Most `max_tokens` one `/infer/` call may ask for."""
    max_requests_per_call: int
    """Most requests in one `/infer/` call."""


def call_limits(cfg: StagectlConfig) -> tuple[int, int]:
    """The bounds of one `/infer/` call, (max_new_tokens_cap, max_requests_per_call):
    `rollout_server.max_new_tokens_cap` / `max_requests_per_call` when set, else the defaults raised to what
    this config's own learner (train-ab: `max_new_tokens`, the decode chunk) or Stage-B runner (sampler and
    reflection `max_new_tokens`, the per-rank batch) asks for, so an embedded server, or one started from
    the training YAML, never refuses its own learner."""
    rs = cfg.rollout_server
    tokens, requests = [DEFAULT_MAX_NEW_TOKENS_CAP], [DEFAULT_MAX_REQUESTS_PER_CALL]
    if is_train_ab(cfg):
        rm = cfg.custom.extra.rollout_matching
        cb = cfg.stage2_ab.channel_b if cfg.stage2_ab else None
        tokens.append(rm.max_new_tokens)
        requests.append((cb.rollout_decode_batch_size if cb else None) or rm.decode_batch_size)
    if cfg.mission is not None:
        tokens += [entry.max_new_tokens for entry in cfg.sampler.grid] + [cfg.reflection.max_new_tokens]
        requests.append(cfg.runner.per_rank_rollout_batch_size)
    return rs.max_new_tokens_cap or max(tokens), rs.max_requests_per_call or max(requests)


def adapter_sync(cfg: StagectlConfig) -> bool:
    """Adapter syncs arrive: the learner trains `model.adapter` and sends it alone (`vllm.sync.mode`)."""
    return cfg.model.adapter is not None and cfg.custom.extra.rollout_matching.vllm.sync.mode == "adapter"


def served_model(cfg: StagectlConfig) -> ServedModel:
    model = cfg.model
    return ServedModel(
        name_or_path=model.name_or_path,
        torch_dtype=model.torch_dtype,
        attn_implementation=model.attn_implementation,
        adapter=model.adapter if adapter_sync(cfg) else None,
        coord_tokens=is_train_ab(cfg),
    )


def server_plan(cfg: StagectlConfig) -> ServerPlan:
    """The rollout server of a validated config (any command's: train-ab, Stage-B or a plain serving one)."""
    transports: frozenset[str]
    if cfg.rollout_server.embedded:
        transports = frozenset({cfg.custom.extra.rollout_matching.vllm.sync.transport})
    else:
        transports = frozenset(TRANSPORTS)  # its learners' configs are not its own
    max_new_tokens_cap, max_requests_per_call = call_limits(cfg)
    return ServerPlan(
        server=cfg.rollout_server,
        model=served_model(cfg),
        weight_transports=transports,
        max_new_tokens_cap=max_new_tokens_cap,
        max_requests_per_call=max_requests_per_call,
    )


@dataclass(frozen=True)
class LearnerServers:
    """The rollout servers a train-ab learner uses, as the doctor probes them."""

    rollouts: ServerRollouts | None
    """None: rollouts run in the learner (`rollout_backend: hf`)."""
    embedded: bool
    """`rollout_server.embedded`: train-ab starts its own server on loopback."""
    engine: Literal["hf", "vllm"]
    """`rollout_server.engine`: what the servers must run."""
    sync_dtype: Literal["float32", "bfloat16", "float16"]
    """The dtype the learner's weight syncs carry."""
    adapter_sync: bool = False
    """The learner sends its adapter alone (`vllm.sync.mode: adapter` with `model.adapter`)."""

    @property
    def rollout_engine(self) -> Literal["hf", "vllm"] | None:
        """The engine Channel-B's rollouts run on; None when they run in the learner."""
        return self.engine if self.rollouts is not None else None


def learner_servers(cfg: StagectlConfig) -> LearnerServers:
    """The rollout servers of a validated train-ab config."""
    engine = cfg.rollout_server.engine
    adapter = adapter_sync(cfg)
    return LearnerServers(
        rollouts=server_rollouts(cfg) if uses_server_rollouts(cfg) else None,
        embedded=cfg.rollout_server.embedded,
        engine=engine,
        # peft's adapter tensors, merged by the server onto its float32 base
        sync_dtype="float32" if adapter and ENGINES[engine].merges_adapter else cfg.model.torch_dtype,
        adapter_sync=adapter,
    )
