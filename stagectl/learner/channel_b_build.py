"""Which Channel-B a `train-ab` run trains with, built once when the trainer starts:

- in-process rollouts (no rollout servers): step mode on the learner's own model (`HFRollouts`);
- rollout servers, `channel_b.mode: step`: step mode over the servers (`ServerRollouts`), with the weight
  publisher that pushes after each update;
- rollout servers, `channel_b.mode: async`: the prefetcher-fed `AsyncChannelB`, its weights pushed first
  when the servers do not hold the base weights, and its saved state restored on resume.

The rollout client and the weight sync it opens are handed back to the trainer, which closes them.
"""

from __future__ import annotations

from stagectl.config import StagectlConfig
from stagectl.config.plan import ServerList
from stagectl.config.plan import ServerRollouts as ServerRolloutsPlan
from stagectl.inference.client import RolloutClient
from stagectl.learner.async_resume import restore_async, resume_sync, warn_unused_async_state
from stagectl.learner.channel_b import ChannelB
from stagectl.learner.channel_b_async import AsyncChannelB
from stagectl.learner.channel_b_step import StepChannelB
from stagectl.learner.packs import PackRunner
from stagectl.learner.publisher import WeightPublisher
from stagectl.learner.rollouts import HFRollouts, ServerRollouts
from stagectl.learner.server_health import ServerHealth
from stagectl.learner.setup import LearnerState
from stagectl.prefetch.fence import SyncFence
from stagectl.weightsync.client import WeightSyncClient


def make_client(servers: ServerList) -> RolloutClient:
    """The rollout client for server-mode rollouts, once every server answers /health/."""
    client = RolloutClient.for_servers(servers)
    client.wait_healthy()
    return client


def make_weight_sync(rollouts: ServerRolloutsPlan) -> WeightSyncClient:
    """The weight sync to the rollout servers (rank 0 pushes; `vllm.sync` picks the transport)."""
    return WeightSyncClient.for_rollouts(rollouts)


def build_channel_b(
    cfg: StagectlConfig,
    st: LearnerState,
    runner: PackRunner,
    *,
    num_updates: int,
    prefetcher_cpus: tuple[int, ...] | None,
) -> tuple[ChannelB, RolloutClient | None, WeightSyncClient | None]:
    """(the run's Channel-B, the rollout client, the weight sync); the last two are None without rollout
    servers. `num_updates`: optimizer updates so far (a resumed run's); `prefetcher_cpus`: the CPUs the
    async prefetcher thread runs on (None: the rank's own)."""
    assert cfg.stage2_ab is not None
    plan = st.plan.channel_b
    chunk = st.resolved.rollout_decode_batch_size
    rollouts = plan.rollouts
    if rollouts is None:
        warn_unused_async_state(st)
        source = HFRollouts(st.bundle.model, st.encoder, plan.sampling, chunk)
        return StepChannelB(cfg, st, runner, source), None, None
    client = make_client(rollouts.servers)
    weight_sync = make_weight_sync(rollouts)
    publisher = WeightPublisher(
        weight_sync,
        st.bundle.model,
        st.world,
        num_updates=num_updates,
        storage_dtype=st.precision.storage_dtype,
        adapter_sync=rollouts.adapter_sync,
    )
    if cfg.stage2_ab.channel_b.mode == "async":
        async_b = AsyncChannelB(cfg, st, runner, client, publisher, prefetcher_cpus)
        if not publisher.fresh:  # not a fresh server on the base weights: push before any rollout
            resume_sync(async_b, st)
        if st.resumed_from is not None:
            restore_async(async_b, st)
        return async_b, client, weight_sync
    warn_unused_async_state(st)
    fence = SyncFence()
    server_source = ServerRollouts(client, st.encoder, plan.sampling, chunk, fence, lambda: publisher.ver)
    infer_timeout = rollouts.servers.infer_timeout_s
    health = ServerHealth(
        cfg.stage2_ab.channel_b,
        st.world,
        publisher,
        client,
        fence,
        infer_timeout,
        after_sync=lambda outcome: None,
    )
    step_b = StepChannelB(
        cfg,
        st,
        runner,
        server_source,
        publisher=publisher,
        pipeline=cfg.stage2_ab.channel_b.enable_pipeline,
        health=health,
    )
    step_b.num_updates = num_updates
    return step_b, client, weight_sync
