"""The rank-0 half of a global batch: it owns the artifact writer, the guidance store, the metrics window
and the reflection queue, consumes the gathered candidates in batch order, and reflects (its parts of the
`StageBPlan`: the sampler grid, the reflection, the loop's seed and logging window, the review bar)."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, NonNegativeInt, ValidationError

from stagectl.config.plan_stage_b import ReflectionPlan, RunnerPlan, SamplerPlan
from stagectl.console import say
from stagectl.stage_b import artifacts as art
from stagectl.stage_b.engine import Backend, candidate_seed
from stagectl.stage_b.guidance import Guidance, parse_guidance
from stagectl.stage_b.guidance_store import GuidanceStore, utc_now
from stagectl.stage_b.metrics import MetricsWindow
from stagectl.stage_b.progress import validation_problems
from stagectl.stage_b.prompts import ReflectionRecord
from stagectl.stage_b.reflection import reflect, reflection_row
from stagectl.stage_b.rows import Candidate, ticket_rows
from stagectl.stage_b.tickets import Ticket


class Consumer:
    def __init__(
        self,
        run_dir: Path,
        guidance: Guidance,
        engine: Backend,
        *,
        fresh: bool,
        mission: str,
        sampler: SamplerPlan,
        reflection: ReflectionPlan,
        runner: RunnerPlan,
        guidance_retention: int,
        min_vote_strength: float,
    ) -> None:
        self.mission = mission
        self.sampler = sampler
        self.reflection = reflection
        self.runner = runner
        self.min_vote_strength = min_vote_strength
        self.engine = engine  # reflection runs on rank 0's engine
        self.guidance = guidance  # authoritative: the other ranks get it by broadcast
        self.writer = art.ArtifactWriter(run_dir, fresh=fresh)
        self.store = GuidanceStore(run_dir, guidance_retention)
        self.queue: list[ReflectionRecord] = []
        self.num_reflections = 0
        self.num_judged = 0
        self.num_correct = 0
        self.num_no_verdict = 0  # tickets without one well-formed candidate: judged wrong, queued for review
        self.window = MetricsWindow()
        self.window_batches = 0
        self.window_start = time.perf_counter()
        self.num_windows = 0

    def consume(
        self,
        tickets: Sequence[Ticket],
        candidates: Sequence[Candidate],
        guidance: Guidance,
        epoch: int,
        batch_index: int,
    ) -> None:
        """One global batch (`tickets` in batch order; `candidates` from every rank, judged under `guidance`)."""
        by_position: dict[int, list[Candidate]] = defaultdict(list)
        for candidate in candidates:
            by_position[candidate.position].append(candidate)
        where = {"epoch": epoch, "batch_index": batch_index, "guidance_step": guidance.step}
        for position, ticket in enumerate(tickets):
            mine = sorted(by_position[position], key=lambda c: (c.grid_index, c.sample_index))
            rows = ticket_rows(ticket, mine, self.sampler.grid, where, self.min_vote_strength)
            for row in rows.trajectories:
                self.writer.write(art.TRAJECTORIES, row)
            for row in rows.malformed:
                self.writer.write(art.MALFORMED, row)
            self.writer.write(art.SELECTIONS, rows.selection_row)
            if rows.review is not None:
                self.writer.write(art.NEED_REVIEW, rows.review)
            selection = rows.selection
            self.window.add(selection)
            self.num_judged += 1
            self.num_correct += selection.label_match
            self.num_no_verdict += selection.verdict is None
            if rows.queued_for_reflection:
                self.queue.append(
                    ReflectionRecord(
                        ticket, selection.verdict, selection.num_pass, selection.num_fail, rows.reasons
                    )
                )
            if len(self.queue) >= self.reflection.batch_size:
                self._reflect(epoch, batch_index, trigger=ticket.key)
        self.window_batches += 1
        if self.window_batches >= self.runner.logging_steps:
            self.write_metrics(epoch, batch_index)
        self.writer.flush()

    def _reflect(self, epoch: int, batch_index: int, trigger: str) -> None:
        size = self.reflection.batch_size
        records, self.queue = self.queue[:size], self.queue[size:]
        # Reflection seeds live apart from rollout seeds (epoch -1), one per reflection.
        seed = candidate_seed(self.runner.seed, 0, self.num_reflections, -1, batch_index)
        result = reflect(self.engine, self.guidance, records, self.reflection, self.mission, seed, utc_now())
        self.num_reflections += 1
        self.window.num_reflections += 1
        row = {"epoch": epoch, "batch_index": batch_index, "trigger_ticket": trigger}
        self.writer.write(art.REFLECTION, {**row, **reflection_row(result, records)})
        if result.outcome.changed:
            self.guidance = result.outcome.guidance
            self.store.save(self.guidance)
            self.window.num_guidance_changes += 1
            say(
                "stage-b",
                f"reflection {self.num_reflections}: guidance step {self.guidance.step} (batch {batch_index})",
            )

    def write_metrics(self, epoch: int, batch_index: int) -> None:
        """Close the current logging window (a row in metrics.jsonl and a line on the console)."""
        elapsed = time.perf_counter() - self.window_start
        row = {
            "window": self.num_windows,
            "epoch": epoch,
            "last_batch_index": batch_index,
            "num_batches": self.window_batches,
            "guidance_step": self.guidance.step,
            "reflection_queue": len(self.queue),
            **self.window.row(elapsed),
        }
        self.writer.write(art.METRICS, row)
        accuracy = row["accuracy"]
        # judged wrong for want of a well-formed answer, not for a wrong one
        no_verdict = row["num_no_verdict"]
        say(
            "stage-b",
            f"batch {batch_index}: {row['num_tickets']} tickets, accuracy "
            f"{'n/a' if accuracy is None else f'{accuracy:.3f}'}"
            + (f" ({no_verdict} without a verdict: malformed answers)" if no_verdict else "")
            + f", guidance step {self.guidance.step}",
        )
        self.num_windows += 1
        self.window = MetricsWindow()
        self.window_batches = 0
        self.window_start = time.perf_counter()

    def state(self) -> dict[str, Any]:
        """Everything a resumed run needs to go on exactly as this one would (plain JSON data)."""
        return {
            "guidance": self.guidance.to_json(),
            "num_reflections": self.num_reflections,
            "num_judged": self.num_judged,
            "num_correct": self.num_correct,
            "num_no_verdict": self.num_no_verdict,
            "num_windows": self.num_windows,
            "window": asdict(self.window),
            "window_batches": self.window_batches,
            "window_elapsed_s": time.perf_counter() - self.window_start,
            "queue": [
                {
                    "ticket": r.ticket.key,
                    "verdict": r.verdict,
                    "num_pass": r.num_pass,
                    "num_fail": r.num_fail,
                    "reasons": list(r.reasons),
                }
                for r in self.queue
            ],
        }

    def restore(self, saved: SavedState) -> None:
        """Continue from a saved `state()` (as `read_state` read and checked it)."""
        self.guidance = saved.guidance
        self.num_reflections = saved.num_reflections
        self.num_judged = saved.num_judged
        self.num_correct = saved.num_correct
        self.num_no_verdict = saved.num_no_verdict
        self.num_windows = saved.num_windows
        self.window = saved.window
        self.window_batches = saved.window_batches
        self.window_start = time.perf_counter() - saved.window_elapsed_s
        self.queue = list(saved.queue)

    def finish(self, epoch: int, batch_index: int) -> None:
        if self.window_batches:
            self.write_metrics(epoch, batch_index)

    def close(self) -> None:
        self.writer.close()


class _SavedRecord(BaseModel):
    model_config = ConfigDict(extra="ignore")

    ticket: str
    verdict: Literal["pass", "fail"] | None
    num_pass: NonNegativeInt
    num_fail: NonNegativeInt
    reasons: list[str]


class _Saved(BaseModel):
    """`Consumer.state()` as `progress.json` holds it: a key missing or of another type is an error naming it; a
    key this stagectl does not read is ignored, as `restore` always ignored it (another version's state)."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    guidance: dict[str, Any]
    num_reflections: NonNegativeInt
    num_judged: NonNegativeInt
    num_correct: NonNegativeInt
    num_no_verdict: NonNegativeInt = 0  # absent from a progress.json written before it was counted
    num_windows: NonNegativeInt
    window: dict[str, NonNegativeInt]  # `MetricsWindow`'s counters
    window_batches: NonNegativeInt
    window_elapsed_s: float
    queue: list[_SavedRecord]


@dataclass(frozen=True)
class SavedState:
    guidance: Guidance
    num_reflections: int
    num_judged: int
    num_correct: int
    num_no_verdict: int
    num_windows: int
    window: MetricsWindow
    window_batches: int
    window_elapsed_s: float
    queue: tuple[ReflectionRecord, ...]


def read_state(state: Mapping[str, Any], tickets: Mapping[str, Ticket]) -> SavedState:
    """A saved `Consumer.state()`; `ValueError` naming the key that is missing or of another type, or a window
    counter this stagectl does not count (what a `progress.json` of another stagectl, or edited by hand, ended
    the resume on with a traceback)."""
    try:
        saved = _Saved.model_validate(state)
    except ValidationError as exc:
        raise ValueError(validation_problems(exc, prefix="consumer.")) from None
    unknown = sorted(set(saved.window) - {f.name for f in fields(MetricsWindow)})
    if unknown:
        raise ValueError(f"consumer.window: unknown counter(s) {', '.join(unknown)}")
    try:
        guidance = parse_guidance(saved.guidance)
    except ValueError as exc:
        raise ValueError(f"consumer.guidance: {exc}") from None
    queue = []
    for i, record in enumerate(saved.queue):
        if record.ticket not in tickets:
            raise ValueError(f"consumer.queue.{i}.ticket: {record.ticket!r} is not a ticket of this run")
        queue.append(
            ReflectionRecord(
                tickets[record.ticket],
                record.verdict,
                record.num_pass,
                record.num_fail,
                tuple(record.reasons),
            )
        )
    return SavedState(
        guidance=guidance,
        num_reflections=saved.num_reflections,
        num_judged=saved.num_judged,
        num_correct=saved.num_correct,
        num_no_verdict=saved.num_no_verdict,
        num_windows=saved.num_windows,
        window=MetricsWindow(**saved.window),
        window_batches=saved.window_batches,
        window_elapsed_s=saved.window_elapsed_s,
        queue=tuple(queue),
    )
