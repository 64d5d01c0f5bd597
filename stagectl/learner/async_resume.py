"""Resuming an async run from a checkpoint: the version its weights are pushed as, and putting each
rank's saved async state back (docs/async_and_checkpoints.md)."""

from __future__ import annotations

from typing import Any

from stagectl import dist
from stagectl.console import say
from stagectl.learner import checkpoint as ckpt
from stagectl.learner.channel_b_async import AsyncChannelB
from stagectl.learner.setup import LearnerState


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
    say(
        "train-ab",
        f"resumed the async state of {name}: {len(saved['packs'])} queued pack(s) on rank 0 (version "
        f"{async_b.ver}), B stream from position {saved['stream_pos']}",
    )


def warn_unused_async_state(state: LearnerState) -> None:
    """A checkpoint with async state resumed by a run that is not async: its packs are not trained."""
    if state.resumed_from is not None and (state.resumed_from / ckpt.ASYNC_STATE).is_file():
        say(
            "train-ab",
            f"warning: {state.resumed_from.name} was written by an async run; channel_b.mode is not async "
            "now, so its queued packs are not trained",
        )
