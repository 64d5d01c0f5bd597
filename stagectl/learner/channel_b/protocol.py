"""The interface the trainer drives (`ChannelB`: step or async mode, built by `build`), the per-step
`Decision`, and the ledger of B steps.

Per optimizer step the trainer calls `decide` (every rank; a collective in async mode), then `run` for a
B step (exactly `gas` micro-steps' worth of forward/backward, then the trainer's one optimizer update),
then `after_update` (weight sync when due) and `metrics`; `saved_version` and `rank_state` at a checkpoint;
`close` once at the end (the Channel-B closes its own rollout client and weight sync).

What a run trained: the B steps the schedule wanted, those trained, and why each other one became
Channel-A. A small pure ledger the learner loop fills once per step (rank 0's decision, the same on every
rank), saved with every checkpoint and read back on resume, written to `final_state.json` and the
end-of-run summary line; `stagectl report` reads it from `final_state.json`.

Reasons a wanted B step trains as Channel-A:
- `queue_empty`: the ready packs were late (async: the prefetcher had not finished them; part of the
  async design, reported).
- `no_server`: no rollout server could serve (down, or restarted and not yet re-synced);
  `stage2_ab.channel_b.on_rollout_loss: continue_a_only` only, `stop` waits and then stops the run.
- `stale_packs`: the packs there were had fallen outside the version window.
- `gate`: some ranks held a step's packs and others did not (the all-ranks feasibility gate).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from stagectl.learner.packs import StepAccumulator

SkipReason = Literal["queue_empty", "no_server", "stale_packs", "gate"]
SKIP_REASONS: tuple[SkipReason, ...] = ("queue_empty", "no_server", "stale_packs", "gate")


def skip_reason(*, serving: bool, some_rank_held: bool, went_stale: bool) -> SkipReason:
    """Why a B step the schedule wanted trains as Channel-A (`BStepLedger`), first match wins: no
    server serves; some rank held the step's packs but not every rank (the feasibility gate); packs fell
    out of the version window since the last step; else the packs were late."""
    if not serving:
        return "no_server"
    if some_rank_held:
        return "gate"
    if went_stale:
        return "stale_packs"
    return "queue_empty"


@dataclass
class BStepLedger:
    num_steps: int = 0
    num_wanted: int = 0
    num_trained: int = 0
    skipped: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SKIP_REASONS, 0))

    def record(self, wants_b: bool, kind: str, reason: SkipReason | None) -> None:
        """One optimizer step: the schedule wanted B (`wants_b`), it trained `kind`; a wanted B step that
        trained as A names its `reason`."""
        assert kind == "A" or wants_b, "a B step the schedule did not want"
        self.num_steps += 1
        self.num_wanted += wants_b
        self.num_trained += kind == "B"
        if wants_b and kind == "A":
            assert reason is not None, "a skipped B step without its reason"
            self.skipped[reason] += 1

    @property
    def num_skipped(self) -> int:
        return self.num_wanted - self.num_trained

    def as_dict(self) -> dict[str, Any]:
        """The plain-data form (checkpoints, `final_state.json`)."""
        return {
            "num_steps": self.num_steps,
            "b_steps_wanted": self.num_wanted,
            "b_steps_trained": self.num_trained,
            "b_steps_as_a": {reason: n for reason, n in self.skipped.items() if n},
        }

    @classmethod
    def from_dict(cls, saved: Mapping[str, Any]) -> BStepLedger:
        skipped: dict[str, int] = dict.fromkeys(SKIP_REASONS, 0)
        for reason, n in saved["b_steps_as_a"].items():
            if reason not in skipped:
                raise ValueError(
                    f"b_steps_as_a: unknown reason {reason!r} (known: {', '.join(SKIP_REASONS)})"
                )
            skipped[reason] = int(n)
        return cls(
            int(saved["num_steps"]), int(saved["b_steps_wanted"]), int(saved["b_steps_trained"]), skipped
        )

    def summary_line(self) -> str:
        """`B steps: 10 wanted, 3 trained; 7 as Channel-A (no_server 5, queue_empty 2)`."""
        line = f"B steps: {self.num_wanted} wanted, {self.num_trained} trained"
        if self.num_skipped:
            reasons = ", ".join(f"{reason} {n}" for reason, n in self.skipped.items() if n)
            line += f"; {self.num_skipped} as Channel-A ({reasons})"
        return line

    def off_schedule(self, tolerance: float) -> str | None:
        """A warning when the realized B ratio is further than `tolerance` from the schedule's, else None."""
        if self.num_steps == 0:
            return None
        wanted = self.num_wanted / self.num_steps
        realized = self.num_trained / self.num_steps
        if abs(wanted - realized) <= tolerance:
            return None
        return (
            f"realized b_ratio {realized:.2f} is off the schedule's {wanted:.2f} by more than "
            f"stage2_ab.channel_b.b_ratio_tolerance {tolerance:g}: {self.summary_line()}"
        )


@dataclass(frozen=True)
class Decision:
    kind: Literal["A", "B"]
    ver: int | None = None  # async: the policy version whose packs the B step trains
    reason: SkipReason | None = None  # a wanted B step that trains as A: why (`BStepLedger`)


class ChannelB(Protocol):
    def start(self) -> None:
        """Begin producing (async: start the prefetcher)."""
        ...

    def decide(self, step: int, policy_wants_b: bool) -> tuple[Decision, dict[str, Any]]:
        """The step's channel on every rank (rank 0 decides), plus metrics of the decision."""
        ...

    def run(self, step: int, decision: Decision, acc: StepAccumulator) -> dict[str, Any]:
        """A B step's forward/backward passes (the caller makes the one optimizer update)."""
        ...

    def after_update(self, num_updates: int) -> dict[str, Any]:
        """After the optimizer update: weight sync when due."""
        ...

    def metrics(self) -> dict[str, Any]:
        """Cumulative Channel-B metrics for the step's row (may be a collective), with its rollout client's
        and weight sync's counters when it has servers."""
        ...

    def rank_state(self) -> dict[str, Any]:
        """This rank's Channel-B stream positions (async: and its async state under "async", which the
        checkpoint writes to its own file), saved with a checkpoint."""
        ...

    def saved_version(self) -> dict[str, Any]:
        """What a checkpoint records of the policy version (async: `ver`, `ver_is_weights`; else empty)."""
        ...

    def close(self, deadline_s: float) -> None:
        """Stop producing, close the rollout client and the weight sync (raises if a thread will not stop
        within `deadline_s`)."""
        ...
