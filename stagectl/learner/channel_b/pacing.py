"""How many rollouts the async prefetcher asks for next, as pure arithmetic (no threads, no I/O).

A rollout is worth generating only if a B step will train it while its policy version is eligible.
Packs of the current version `ver` stay eligible until the learner's version passes `ver +
version_window`, i.e. for the steps up to the `(version_window + 1)`-th weight sync from now; the
schedule says which of those steps want Channel-B. A B step takes `gas` packs of ONE version on every
rank (the oldest feasible version first), so packs only count in whole groups of `gas`:

- demand = `gas` x (B steps in the horizon) - the complete groups of older versions that EVERY rank holds
  (`QueueView.shared`: a group only this rank holds can never pass the gate, so it covers nothing; counting
  it once let two ranks each hold a group of a different version and neither produce more, which turned
  a B step into Channel-A);
- room = `prefetch_target_packs` - packs of other versions queued;
- wanted = min(demand, room) rounded down to a multiple of `gas`, less the current version's packs
  already queued.

The rollouts requested are what fills `wanted` packs (`pack_tokens` each) at the running estimate of
tokens per rollout. Zero means: wait.

When the prefetcher retries and when it gives up: a small pure class over the clock it is given.

Server trouble (connection, timeout, 5xx: *transient*) is retried with exponential back-off, 0.25 s doubling
up to 5 s, so the learner keeps training Channel-A while the server is away, until the outage has lasted
`outage_timeout_s`. Any other failure is retried at once until `max_consecutive_failures` in a row. A burst
that succeeds ends both runs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

from stagectl.schedule import channel_for_step


@dataclass(frozen=True)
class PacingRules:
    b_ratio: Fraction | float | str
    gas: int
    sync_every_steps: int
    version_window: int
    target_packs: int  # prefetch_target_packs
    pack_tokens: int  # packing_min_fill_ratio x packing_length: the tokens a ready pack is filled to
    max_steps: int | None = None  # no B step comes after the last one


@dataclass(frozen=True)
class QueueView:
    """What the queue holds now: `versions` eligible (oldest first) and `counts` of packs of each."""

    versions: Sequence[int]
    counts: Sequence[int]
    current_ver: int
    shared: Sequence[int] | None = None  # packs of each version every rank holds (None: `counts`)


def eligible_horizon(next_step: int, sync_every_steps: int, version_window: int) -> range:
    """The steps (from `next_step` on) at which packs of the version current now are still eligible.

    The weight version moves after step `s` whenever `(s + 1) % sync_every_steps == 0`; packs of version
    `v` are eligible while the learner's version is at most `v + version_window`."""
    first_sync = next_step + (-(next_step + 1)) % sync_every_steps  # the step after which ver moves
    last = first_sync + version_window * sync_every_steps
    return range(next_step, last + 1)


def b_steps_in(steps: range, b_ratio: Fraction | float | str) -> int:
    return sum(1 for s in steps if channel_for_step(s, b_ratio) == "B")


def packs_wanted(next_step: int, queue: QueueView, rules: PacingRules, open_step: int | None = None) -> int:
    """New packs of the current version that B steps from `next_step` on will train before they go stale.

    `open_step` is the first step whose post-update weight sync has not happened yet (default
    `next_step`): while step `next_step - 1` is still training, its sync is still ahead, so the version
    current now moves one sync earlier than `next_step` alone would say."""
    gas = rules.gas
    current = sum(c for v, c in zip(queue.versions, queue.counts, strict=True) if v == queue.current_ver)
    shared = queue.counts if queue.shared is None else queue.shared
    older_groups = sum(
        (c // gas) * gas for v, c in zip(queue.versions, shared, strict=True) if v < queue.current_ver
    )
    others = sum(queue.counts) - current
    horizon = eligible_horizon(
        next_step if open_step is None else min(open_step, next_step),
        rules.sync_every_steps,
        rules.version_window,
    )
    horizon = range(
        next_step, horizon.stop if rules.max_steps is None else min(horizon.stop, rules.max_steps)
    )
    demand = gas * b_steps_in(horizon, rules.b_ratio) - older_groups
    room = rules.target_packs - others
    target = (max(0, min(demand, room)) // gas) * gas
    return max(0, target - current)


def rollouts_for_tokens(tokens: int, tokens_per_rollout: float) -> int:
    """Rollouts that make `tokens` at the estimate, rounded down (a short pack beats an extra one)."""
    if tokens <= 0:
        return 0
    return math.floor(tokens / max(1.0, tokens_per_rollout))


ESTIMATE_WEIGHT = 0.2  # the weight of one request's tokens per rollout in the running estimate


def update_estimate(estimate: float, observed: float, num_requests: int) -> float:
    """The running estimate of segment tokens per requested rollout after a request that made `observed`
    (`num_requests`: the requests made so far, this one included): the mean of the requests so far for
    the first 1 / `ESTIMATE_WEIGHT` of them (the start-up estimate, prompt + `max_new_tokens`, is an upper
    bound and goes at the first request), then a moving average that weighs each request `ESTIMATE_WEIGHT`.
    Segments vary by +-20% around their mean on the tiny example, and the request is sized to the fill
    target at this estimate: weighing the last request half (as before) swung it by as much, and the
    packs of a burst sized low came out at 0.65-0.85 fill. At least one token per rollout."""
    weight = max(ESTIMATE_WEIGHT, 1.0 / max(1, num_requests))
    return max(1.0, (1.0 - weight) * estimate + weight * observed)


def request_multiples(decode_batch_size: int, server_batches: Sequence[int | None]) -> tuple[int, ...]:
    """The request sizes a prefetcher aligns to, largest first: the servers' batch, then the client's
    decode batch (`rollout_decode_batch_size`).

    A server decodes up to its `batch_size` rollouts (`/version/`: the engine's `max_batch_size`) in one
    generate call, whoever sent them, and a request is spread over the N servers in N contiguous parts: so
    N x `batch_size` gives every server whole batches. Only where every server reports the same batch
    (a server older than the field reports none): otherwise the decode batch alone."""
    sizes = [decode_batch_size]
    if server_batches and all(b is not None for b in server_batches) and len(set(server_batches)) == 1:
        batch = server_batches[0]
        assert batch is not None
        sizes.append(len(server_batches) * batch)
    return tuple(sorted(set(sizes), reverse=True))


def request_size(
    missing: int,
    room: int,
    tokens_per_rollout: float,
    *,
    whole_batches: bool,
    multiples: Sequence[int],
) -> int:
    """Rollouts to request for `missing` tokens when the packs have `room` tokens left, at the running
    estimate of tokens per rollout: the need, `ceil(missing / estimate)`, in one request, so that the
    packs reach their fill target (`pack_tokens` each) from one call. A B step costs the learner about
    the same whatever its packs hold, and a burst's later top-ups are often not sent at all (a weight
    sync waits for the section, or with `in_flight_sync` the servers would refuse them), so the first
    request must not leave the packs short. Top-ups follow only where the estimate ran high.

    With `whole_batches` the need is rounded up to whole batches (`multiples`, largest first: the
    servers' batch, then the decode batch; see `request_multiples`) where they still fit the room at the
    estimate: a batch of one or two rollouts costs the server about as much as a full one, so the extra
    rollouts are nearly free. What then fits no pack is carried, and a carry is trained only by a next
    burst of the SAME version, so the caller asks for that only when one follows (pacing wants more packs
    of this version than this burst builds, and no weight sync waits); never into packs of the next
    version, whose B step needs one version on every rank (docs/training.md, "Async actor-learner").
    The need is never rounded *down* to whole batches: that left the packs below the fill target (the
    tiny async example on 2 ranks: 8 rollouts of ~190 tokens where 2 packs of 1024 at 0.9 need 10, B pack
    fill 0.73-0.77). The rule reads only pacing state, the fence and the servers' batch, all the same on
    resume; `training.packing: false` never rounds.
    """
    per_rollout = max(1.0, tokens_per_rollout)
    need = max(1, math.ceil(missing / per_rollout))
    if whole_batches:
        for multiple in multiples:
            whole = math.ceil(need / multiple) * multiple
            if whole * per_rollout <= room:
                return whole
    return need


@dataclass
class FailurePolicy:
    max_consecutive_failures: int
    outage_timeout_s: float
    num_consecutive: int = 0
    outage_since: float | None = None  # when the current run of transient failures began (monotonic)

    def succeeded(self) -> None:
        self.num_consecutive = 0
        self.outage_since = None

    def failed(self, now: float, *, transient: bool) -> float | str:
        """Count a failure at `now`: the seconds to back off before the next burst, or why to give up."""
        self.num_consecutive += 1
        if transient:
            self.outage_since = self.outage_since if self.outage_since is not None else now
            if now - self.outage_since > self.outage_timeout_s:
                return (
                    f"rollout servers unreachable for {now - self.outage_since:.0f} s "
                    f"(> vllm.server.timeout_s {self.outage_timeout_s:g})"
                )
            return min(5.0, 0.25 * 2 ** min(self.num_consecutive, 5))
        if self.num_consecutive >= self.max_consecutive_failures:
            return f"{self.num_consecutive} failures in a row"
        return 0.0
