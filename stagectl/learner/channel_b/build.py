"""Which Channel-B a `train-ab` run trains with, built once when the trainer starts:

- in-process rollouts (no rollout servers), or an A-only run (`b_ratio: 0`) whatever its rollout config:
  step mode on the learner's own model (`HFRollouts`; the A-only run never calls it);
- rollout servers, `channel_b.mode: step`: step mode over the servers (`ServerRollouts`), with the weight
  publisher that pushes after each update;
- rollout servers, `channel_b.mode: async`: the prefetcher-fed `AsyncChannelB`, its weights pushed first
  when the servers do not hold the base weights, and its saved state restored on resume.

The rollout client and the weight sync it opens belong to the Channel-B built: it reports their counters
in its metrics and closes them in its `close`.

Resuming an async run from a checkpoint: the version its weights are pushed as, and putting each
rank's saved async state back (docs/async_and_checkpoints.md).
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any

from stagectl import dist
from stagectl.config.plan import AsyncServers, ChannelBPlan, ServerList
from stagectl.config.plan import ServerRollouts as ServerRolloutsPlan
from stagectl.console import say
from stagectl.inference.client import RolloutClient
from stagectl.learner import checkpoint as ckpt
from stagectl.learner.channel_b.async_mode import AsyncChannelB
from stagectl.learner.channel_b.clock import VersionClock
from stagectl.learner.channel_b.health import ServerHealth
from stagectl.learner.channel_b.protocol import ChannelB
from stagectl.learner.channel_b.publisher import WeightPublisher
from stagectl.learner.channel_b.rollouts import HFRollouts, ServerRollouts
from stagectl.learner.channel_b.step_mode import StepChannelB
from stagectl.learner.packs import PackRunner
from stagectl.learner.setup import LearnerState
from stagectl.weightsync.client import WeightSyncClient


def make_client(servers: ServerList) -> RolloutClient:
    """The rollout client for server-mode rollouts, once every server answers /health/."""
    client = RolloutClient.for_servers(servers)
    client.wait_healthy(on_wait=lambda line: say("train-ab", line), wait_key=servers.wait_healthy_key)
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
    if rollouts is None or Fraction(st.plan.b_ratio) == 0:
        # in-process rollouts; or an A-only run (b_ratio 0: an ablation's baseline on the AB config), which
        # never rolls out: no server waited for, no weights pushed, no prefetcher, whatever the config says
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
    publisher.carry_totals(st.extra_state.get("rank_state", {}).get("weight_syncs", {}))
    return step_b


def resume_version(extra_state: dict[str, Any], server_ver: int) -> int:
    """The version a resumed async run pushes its weights as: the checkpoint's own version `ver` when they
    are exactly its weights (`ver_is_weights`: saved right after a successful sync) and no server is past
    it, so the saved packs keep their age; else the next version above both (they age by one). A checkpoint
    without a version (step mode, or written before): the next version above the servers'."""
    saved = extra_state.get("ver")
    if saved is None:
        return server_ver + 1
    if extra_state.get("ver_is_weights", False) and int(saved) > server_ver:
        return int(saved)
    return max(int(saved), server_ver) + 1


def resume_sync(async_b: AsyncChannelB, state: LearnerState) -> None:
    """Push the resumed weights (every rank) and set the queue's current version from the outcome."""
    with dist.phase("weight sync", "weight_sync_s"):
        target = resume_version(state.extra_state, async_b.publisher.ver) if state.resumed_from else None
        outcome = async_b.publisher.sync(async_b.fence_timeout_s, target=target, then=async_b.after_sync)
    async_b.weights_are_ver = outcome.status == "ok"


def restore_async(async_b: AsyncChannelB, state: LearnerState) -> None:
    """Put this rank's saved async state back (after `resume_sync`), or warn that the checkpoint has none."""
    assert state.resumed_from is not None
    with ckpt.reading(state.resumed_from, ckpt.ASYNC_STATE):
        saved = ckpt.load_async_state(state.resumed_from, state.world.rank)
    name = state.resumed_from.name
    if saved is None:
        say(
            "train-ab",
            f"warning: {name} holds no async state (written before stagectl saved it): its queued packs "
            "and the rollouts in flight were not saved; the B stream continues after every sample the "
            "prefetcher had taken, trained or not",
        )
        return
    async_b.restore(saved)
    versions = sorted({int(pack["ver"]) for pack in saved["packs"]})
    of_versions = f" of version {', '.join(map(str, versions))}" if versions else ""
    say(
        "train-ab",
        f"resumed the async state of {name}: {len(saved['packs'])} queued pack(s){of_versions} on rank 0, "
        f"policy version {async_b.ver} now, B stream from position {saved['stream_pos']}",
    )


def warn_unused_async_state(state: LearnerState) -> None:
    """A checkpoint with async state resumed by a run that is not async: its packs are not trained."""
    if state.resumed_from is not None and (state.resumed_from / ckpt.ASYNC_STATE).is_file():
        say(
            "train-ab",
            f"warning: {state.resumed_from.name} was written by an async run; channel_b.mode is not async "
            "now, so its queued packs are not trained",
        )
