"""Pacing arithmetic: rollouts are generated only for packs a coming B step will train in time."""

from __future__ import annotations

import functools
import itertools

import pytest

from stagectl.prefetch.pacing import (
    PacingRules,
    QueueView,
    b_steps_in,
    eligible_horizon,
    packs_wanted,
    request_multiples,
    request_size,
    rollouts_for_tokens,
)


def rules(**over: object) -> PacingRules:
    base = {
        "b_ratio": 1.0,
        "gas": 2,
        "sync_every_steps": 1,
        "version_window": 1,
        "target_packs": 4,
        "pack_tokens": 900,
    }
    base.update(over)
    return PacingRules(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("step", "every", "window"), list(itertools.product(range(7), range(1, 4), range(3)))
)
def test_the_horizon_ends_when_the_current_version_goes_stale(step: int, every: int, window: int) -> None:
    """Simulate the version counter: it moves after step s when (s + 1) % every == 0."""
    horizon = eligible_horizon(step, every, window)
    ver_at = {}
    ver = 0
    for s in range(40):
        ver_at[s] = ver
        if (s + 1) % every == 0:
            ver += 1
    current = ver_at[step]
    eligible = [s for s in range(step, 40) if ver_at[s] <= current + window]
    assert list(horizon) == eligible


def test_b_steps_in_follows_the_schedule() -> None:
    assert b_steps_in(range(0, 4), 0.5) == 2
    assert b_steps_in(range(0, 4), 0.25) == 1
    assert b_steps_in(range(0, 4), 0.0) == 0


def test_empty_queue_wants_gas_packs_per_b_step_up_to_the_target() -> None:
    empty = QueueView([4, 5], [0, 0], current_ver=5)
    assert packs_wanted(5, empty, rules()) == 4  # 2 B steps x gas 2, target 4
    assert packs_wanted(5, empty, rules(target_packs=3)) == 2  # rounded down to whole B steps
    assert packs_wanted(5, empty, rules(b_ratio=0.0)) == 0


def test_queued_packs_count_only_in_whole_groups_of_gas() -> None:
    # one pack of the old version can never make a B step of gas 2 alone; it does not reduce the demand
    one_old = QueueView([4, 5], [1, 0], current_ver=5)
    assert packs_wanted(5, one_old, rules()) == 2  # room is 4 - 1 = 3 -> 2 (whole groups)
    two_old = QueueView([4, 5], [2, 0], current_ver=5)
    assert packs_wanted(5, two_old, rules()) == 2  # one B step is served by the old ones
    current = QueueView([4, 5], [0, 2], current_ver=5)
    assert packs_wanted(5, current, rules()) == 2  # 2 of the 4 wanted are queued already
    full = QueueView([4, 5], [2, 2], current_ver=5)
    assert packs_wanted(5, full, rules()) == 0


def test_a_ratio_half_schedule_asks_only_for_the_b_steps_ahead() -> None:
    # b_ratio 0.5 gives A, B, A, B ...; sync every 2 steps, window 0: the horizon is the rest of the version
    r = rules(b_ratio=0.5, sync_every_steps=2, version_window=0, target_packs=8)
    view = QueueView([3], [0], current_ver=3)
    assert packs_wanted(6, view, r) == 2  # steps 6 (A), 7 (B)
    assert packs_wanted(7, view, r) == 2  # step 7 (B)


def test_rollouts_fill_the_tokens_at_the_estimate_rounding_down() -> None:
    assert rollouts_for_tokens(1800, 100.0) == 18
    assert rollouts_for_tokens(900, 130.0) == 6  # 6 x 130 = 780 (a short pack beats an extra one)
    assert rollouts_for_tokens(900, 5000.0) == 0
    assert rollouts_for_tokens(0, 100.0) == 0


def test_no_b_step_after_the_last_one() -> None:
    empty = QueueView([4, 5], [0, 0], current_ver=5)
    assert packs_wanted(5, empty, rules(max_steps=6)) == 2  # only step 5 is left
    assert packs_wanted(5, empty, rules(max_steps=5)) == 0


def test_a_sync_still_ahead_for_the_step_in_flight_shortens_the_horizon() -> None:
    """While step 1 trains (its post-update sync is still ahead), packs made now carry the version that
    sync retires one window later: with b_ratio 0.5, sync every 2, window 1 only B step 3 can train them,
    and the 2 packs queued cover it. Counting the horizon from step 2 alone wanted 2 more, which went
    stale (the drop the async bench measured: 2 packs of every 4 steps)."""
    r = rules(b_ratio=0.5, gas=2, sync_every_steps=2, version_window=1, target_packs=4)
    queued = QueueView([0], [2], current_ver=0)
    assert packs_wanted(2, queued, r, open_step=1) == 0
    assert packs_wanted(2, queued, r) == 2  # the horizon once step 1's sync has happened: B steps 3, 5
    assert packs_wanted(2, QueueView([0], [0], current_ver=0), r, open_step=1) == 2


def test_an_older_group_only_this_rank_holds_covers_no_b_step() -> None:
    """The cross-rank race (stop 23): this rank holds a group of version 4, the other rank a group of 5.
    Counted from this rank's own queue the group of 4 covers the next B step and nothing more is made, so
    the gate (gas packs of ONE version on every rank) finds none and the B step trains Channel-A. Counted
    from what every rank holds it covers nothing, and this rank makes a group of 5."""
    r = rules(version_window=2, target_packs=6, max_steps=7)  # steps 5 and 6 are B: 4 packs in demand
    own_view = QueueView([3, 4, 5], [0, 2, 0], current_ver=5)
    assert packs_wanted(5, own_view, r) == 2  # the group of 4 counted: one B step short
    shared_view = QueueView([3, 4, 5], [0, 2, 0], current_ver=5, shared=[0, 0, 0])
    assert packs_wanted(5, shared_view, r) == 4
    every_rank = QueueView([3, 4, 5], [0, 2, 0], current_ver=5, shared=[0, 2, 0])
    assert packs_wanted(5, every_rank, r) == 2


def test_request_multiples_are_the_servers_whole_batches_then_the_decode_batch() -> None:
    # one server decoding 8 at a time, decode batch 4: a request of 8 is one generate call
    assert request_multiples(4, [8]) == (8, 4)
    # two servers: a request is split in two contiguous parts, each must be whole batches
    assert request_multiples(4, [8, 8]) == (16, 4)
    assert request_multiples(8, [8]) == (8,)
    # servers that disagree, or one older than the field: the decode batch alone
    assert request_multiples(4, [8, 16]) == (4,)
    assert request_multiples(4, [8, None]) == (4,)
    assert request_multiples(4, []) == (4,)


def test_request_size_takes_the_servers_batch_first_then_the_decode_batch() -> None:
    size = functools.partial(request_size, multiples=(8, 4), first_share=0.8)
    # 10 needed: rounded down to one server batch (8), not to 3 decode batches (12 = 8 + 4 on the server)
    assert size(1300, 10_000, 100.0, first=False, whole_batches=False) == 8
    # rounded up to 2 server batches where they fit the room, else down to one (not up to 12 = 8 + 4)
    assert size(1000, 10_000, 100.0, first=False, whole_batches=True) == 16
    assert size(1000, 1_200, 100.0, first=False, whole_batches=True) == 8
    # fewer than a server batch: decode batches (6 -> 4); a server batch far above any request changes nothing
    assert size(600, 10_000, 100.0, first=False, whole_batches=False) == 4
    far = functools.partial(request_size, multiples=(256, 4), first_share=0.8)
    assert far(1000, 1_200, 100.0, first=False, whole_batches=True) == 12
    assert far(1000, 1_100, 100.0, first=False, whole_batches=True) == 8


def test_request_size_is_whole_decode_batches_up_into_room_or_down() -> None:
    size = functools.partial(request_size, multiples=(4,), first_share=0.8)
    # 1000 tokens missing at 100 per rollout: 10 needed; the first request 80% of them (8), a top-up all 10
    assert size(1000, 10_000, 100.0, first=True, whole_batches=False) == 8
    # rounded up to whole decode batches where they fit the packs' room at the estimate, else down
    assert size(1000, 10_000, 100.0, first=False, whole_batches=True) == 12
    assert size(1000, 1_100, 100.0, first=False, whole_batches=True) == 8
    assert size(1000, 10_000, 100.0, first=False, whole_batches=False) == 8
    # less than a batch: asked as it is, or nothing where the burst may skip the top-up
    assert size(300, 10_000, 100.0, first=False, whole_batches=False) == 3
    assert size(300, 10_000, 100.0, first=False, whole_batches=False, may_skip=True) == 0
    assert size(300, 10_000, 100.0, first=False, whole_batches=False, may_skip=False) == 3
    # an estimate below one token per rollout counts as one; at least one rollout is asked
    assert size(3, 10, 0.1, first=False, whole_batches=False) == 3
    assert size(0, 10, 100.0, first=True, whole_batches=False) == 1
