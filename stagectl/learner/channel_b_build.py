"""Which Channel-B a `train-ab` run trains with, built once when the trainer starts:

- in-process rollouts (no rollout servers): step mode on the learner's own model (`HFRollouts`);
- rollout servers, `channel_b.mode: step`: step mode over the servers (`ServerRollouts`), with the weight
  publisher that pushes after each update;
- rollout servers, `channel_b.mode: async`: the prefetcher-fed `AsyncChannelB`, its weights pushed first
  when the servers do not hold the base weights, and its saved state restored on resume.

The rollout client and the weight sync it opens belong to the Channel-B built: it reports their counters
in its metrics and closes them in its `close`.
"""

from __future__ import annotations

from stagectl.config.plan import AsyncServers, ChannelBPlan, ServerList
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
from stagectl.prefetch.fence import VersionClock
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
    plan: ChannelBPlan,
    st: LearnerState,
    runner: PackRunner,
    *,
    num_updates: int,
    prefetcher_cpus: tuple[int, ...] | None,
) -> ChannelB:
    """The run's Channel-B for `plan.source`. `num_updates`: optimizer updates so far (a resumed run's);
    `prefetcher_cpus`: the CPUs the async prefetcher thread runs on (None: the rank's own)."""
    rollouts = plan.rollouts
    if rollouts is None:
        warn_unused_async_state(st)
        source = HFRollouts(st.bundle.model, st.encoder, plan.sampling, plan.decode_batch_size)
        return StepChannelB(plan, st, runner, source)
    client = make_client(rollouts.servers)
    publisher = WeightPublisher(
        make_weight_sync(rollouts),
        st.bundle.model,
        st.world,
        num_updates=num_updates,
        clock=VersionClock(),
        storage_dtype=st.precision.storage_dtype,
        adapter_sync=rollouts.adapter_sync,
    )
    if isinstance(plan.source, AsyncServers):
        async_b = AsyncChannelB(plan, st, runner, client, publisher, prefetcher_cpus)
        if not publisher.fresh:  # not a fresh server on the base weights: push before any rollout
            resume_sync(async_b, st)
        if st.resumed_from is not None:
            restore_async(async_b, st)
        return async_b
    warn_unused_async_state(st)
    server_source = ServerRollouts(client, st.encoder, plan.sampling, plan.decode_batch_size, publisher.clock)
    health = ServerHealth(rollouts, st.world, publisher, client, after_sync=lambda outcome: None)
    step_b = StepChannelB(plan, st, runner, server_source, client=client, publisher=publisher, health=health)
    step_b.num_updates = num_updates
    return step_b
