"""Pacing arithmetic: rollouts are generated only for packs a coming B step will train in time."""

from __future__ import annotations

import functools
import itertools
import math
import random

import pytest

from stagectl.learner.channel_b.pacing import (
    ESTIMATE_WEIGHT,
    PacingRules,
    QueueView,
    b_steps_in,
    eligible_horizon,
    packs_wanted,
    request_multiples,
    request_size,
    rollouts_for_tokens,
    update_estimate,
)
from stagectl.packing import pack_into


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


def test_request_size_asks_for_the_whole_need_and_never_rounds_it_down() -> None:
    size = functools.partial(request_size, multiples=(8, 4))
    # the tiny async example: 2 packs of 1024 at fill 0.9 (1844 tokens), ~190 tokens a segment: 10 rollouts
    # in one request (rounded down to the server's batch of 8 they filled the packs to 0.73-0.77)
    assert size(1844, 2048, 190.0, whole_batches=False) == 10
    assert size(1844, 2048, 190.0, whole_batches=True) == 10  # 16 or 12 would not fit the packs
    # a need of a whole batch stays one; a top-up of less than a batch is asked as it is (never skipped)
    assert size(800, 10_000, 100.0, whole_batches=False) == 8
    assert size(300, 10_000, 100.0, whole_batches=False) == 3
    # an estimate below one token per rollout counts as one; at least one rollout is asked
    assert size(3, 10, 0.1, whole_batches=False) == 3
    assert size(0, 10, 100.0, whole_batches=False) == 1


def test_request_size_rounds_up_to_the_servers_batch_then_the_decode_batch_where_the_surplus_fits() -> None:
    size = functools.partial(request_size, multiples=(8, 4))
    # 10 needed: up to 2 server batches where they fit the room at the estimate, else 3 decode batches
    assert size(1000, 10_000, 100.0, whole_batches=True) == 16
    assert size(1000, 1_200, 100.0, whole_batches=True) == 12
    assert size(1000, 1_100, 100.0, whole_batches=True) == 10  # no whole batches fit: the need
    assert size(1000, 10_000, 100.0, whole_batches=False) == 10  # no burst of the version follows
    far = functools.partial(request_size, multiples=(256, 4))
    assert far(1000, 1_200, 100.0, whole_batches=True) == 12


def test_update_estimate_is_the_mean_at_first_then_a_moving_average() -> None:
    # the start-up upper bound (prompt + max_new_tokens) goes at the first request
    assert update_estimate(300.0, 180.0, 1) == 180.0
    assert update_estimate(180.0, 200.0, 2) == 190.0  # the mean of two requests
    # from the 5th request on each weighs ESTIMATE_WEIGHT: one short request moves it a little
    assert update_estimate(190.0, 140.0, 9) == pytest.approx(
        (1 - ESTIMATE_WEIGHT) * 190.0 + ESTIMATE_WEIGHT * 140.0
    )
    assert update_estimate(190.0, 0.0, 9) >= 1.0  # every rollout too long: still at least a token


def test_requests_sized_at_the_estimate_fill_the_packs_of_the_async_example() -> None:
    """The burst a 2-rank async run at bs 1 makes, replayed: 2 packs of 1024 tokens (fill target 0.9) from
    segments of the lengths the tiny example's rollouts made (137-239 tokens, 20 bursts); each burst sized
    by `request_size` at `update_estimate`'s running estimate, in one request (a weight sync usually waits,
    so no top-up), packed by `pack_into`. The fill of every burst's packs, mean over the bursts >= 0.9."""
    rng = random.Random(0)
    choices = [137, 149, 167, 179, 197, 209, 227, 239]
    target, capacity = math.ceil(0.9 * 1024) * 2, 2 * 1024
    estimate, fills = 96.0 + 96.0 + 9.0, []
    for num_requests in range(1, 21):
        count = request_size(target, capacity, estimate, whole_batches=False, multiples=(8, 4))
        lengths = [rng.choice(choices) for _ in range(count)]
        estimate = update_estimate(estimate, sum(lengths) / count, num_requests)
        groups, _ = pack_into(lengths, 2, 1024)
        fills.append(sum(lengths[i] for g in groups for i in g) / capacity)
    assert sum(fills) / len(fills) >= 0.9
    assert min(fills) >= 0.7
