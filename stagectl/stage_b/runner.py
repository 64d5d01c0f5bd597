"""`run_all(cfg)`: the Stage-B loop, the one orchestration entry point for one process or many.

Rank 0 reads the tickets and the guidance and broadcasts them (or the error, so every rank stops
cleanly); every rank then builds its engine (loads the model), and only when all of them have one does
rank 0 write anything (guidance, snapshot, config.yaml): a run that cannot start leaves no artifacts.
Per epoch rank 0 shuffles the tickets (seeded) and broadcasts the order. Per global batch
(`runner.per_rank_rollout_batch_size x world size` tickets) rank 0 broadcasts one guidance snapshot;
every rank judges its contiguous shard with it (`sharding.shard_bounds`); the candidates are gathered
to rank 0, which parses, selects, writes and reflects in batch order. A guidance change made while
consuming batch k therefore reaches the prompts from batch k+1 on. Only rank 0 touches the disk.

An error on any rank ends the run: torchrun stops every other rank as soon as one exits non-zero,
and every collective runs in a watchdog phase with a deadline (`launch.watchdog`: `startup_s` for
the set-up, `step_s` per global batch, `shutdown_s` for the end), so no rank is left waiting.
"""

from __future__ import annotations

import re
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from stagectl import dist
from stagectl.config import StagectlConfig, to_plain
from stagectl.files import write_resolved_config
from stagectl.stage_b import artifacts as art
from stagectl.stage_b.engine import DecodeSpec, Engine, JudgeRequest, candidate_seed
from stagectl.stage_b.guidance import Guidance
from stagectl.stage_b.guidance_store import GuidanceStore, read_guidance_file, utc_now
from stagectl.stage_b.metrics import MetricsWindow
from stagectl.stage_b.prompts import ReflectionRecord, rollout_messages
from stagectl.stage_b.reflection import reflect, reflection_row
from stagectl.stage_b.selection import needs_reflection, review_reason, select_verdict
from stagectl.stage_b.sharding import epoch_order, global_batches, shard_bounds
from stagectl.stage_b.tickets import Ticket, load_tickets
from stagectl.stage_b.verdict import parse_verdict

_MISSION_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
MAX_REPORTED_LINES = 20
T = TypeVar("T")


@dataclass(frozen=True)
class Prepared:
    """What rank 0 broadcasts before the loop: the tickets and the starting guidance, or an error."""

    tickets: list[Ticket]
    guidance: Guidance | None
    fresh: bool  # the run directory had no guidance (artifacts are truncated)
    error: str | None = None


@dataclass(frozen=True)
class Candidate:
    position: int  # index of the ticket inside its global batch
    grid_index: int
    sample_index: int
    seed: int
    rank: int
    text: str


@dataclass(frozen=True)
class RunSummary:
    run_dir: Path
    num_tickets: int
    num_batches: int
    num_judged: int
    accuracy: float | None
    guidance_step: int
    num_reflections: int


def run_dir_of(cfg: StagectlConfig) -> Path:
    assert cfg.mission is not None
    return cfg.output.root / cfg.output.run_name / cfg.mission


def run_all(cfg: StagectlConfig, engine: Engine | None = None) -> RunSummary | None:
    """Run the loop on this rank (world read from torchrun's environment); rank 0 gets the summary."""
    world = dist.read_world()
    dist.init_distributed(world, cfg.launch.watchdog)
    finished = False
    try:
        with dist.phase("start-up: tickets, guidance and model load", "startup_s"):
            prepared = from_main(_prepare(cfg) if world.is_main else None)
            if prepared.error is not None:
                raise ValueError(prepared.error)
            if engine is None:
                engine = build_engine(cfg, world)
            dist.barrier()  # every rank holds its engine: only now does the run directory get written
        if world.is_main:
            _start_run_dir(cfg, prepared)
        summary = Loop(cfg, world, prepared, engine).run()
        finished = True
        return summary
    finally:
        dist.teardown(final_barrier=finished)


def build_engine(cfg: StagectlConfig, world: dist.World) -> Engine:
    if cfg.runner.engine == "rules":
        from stagectl.stage_b.engine_rules import RulesEngine

        return RulesEngine()
    if cfg.runner.engine == "server":
        from stagectl.stage_b.engine_server import connect_server_engine

        server_engine, note = connect_server_engine(cfg.runner.server)
        log(f"rank {world.rank}: {note}")
        return server_engine
    from stagectl.stage_b.engine_hf import load_hf_engine

    engine, note = load_hf_engine(cfg, world)
    log(note)
    return engine


def from_main(value: T | None) -> T:
    """Rank 0's `value` on every rank (the other ranks pass None)."""
    out = dist.broadcast_object(value)
    assert out is not None
    return out


def log(message: str) -> None:
    print(f"stage-b: {message}", file=sys.stderr, flush=True)


def _prepare(cfg: StagectlConfig) -> Prepared:
    """Rank 0: read and check the tickets and the guidance (nothing is written yet)."""
    assert cfg.mission is not None and cfg.guidance is not None  # validate_stage_b
    try:
        if not _MISSION_NAME.match(cfg.mission):
            raise ValueError(f"mission {cfg.mission!r} must be a plain name (letters, digits, _ . -)")
        ticket_set = load_tickets(cfg.tickets, cfg.mission)
        for problem in ticket_set.problems[:MAX_REPORTED_LINES]:
            log(f"skipped {problem}")
        if len(ticket_set.problems) > MAX_REPORTED_LINES:
            log(f"... and {len(ticket_set.problems) - MAX_REPORTED_LINES} more bad ticket line(s)")
        run_dir = run_dir_of(cfg)
        store = GuidanceStore(run_dir, cfg.guidance.retention)
        existing = None if cfg.guidance.reset_on_rerun else store.load()
        guidance = existing or read_guidance_file(cfg.guidance.path)
    except (ValueError, OSError) as exc:
        return Prepared([], None, False, error=str(exc))
    source = "continuing from" if existing else "starting from"
    log(f"{len(ticket_set.tickets)} tickets of {cfg.mission}; {source} guidance step {guidance.step}")
    return Prepared(ticket_set.tickets, guidance, fresh=existing is None)


def _start_run_dir(cfg: StagectlConfig, prepared: Prepared) -> None:
    """Rank 0, once every check passed: the starting guidance (fresh runs) and the resolved config."""
    assert cfg.guidance is not None and prepared.guidance is not None
    run_dir = run_dir_of(cfg)
    try:
        if prepared.fresh:
            GuidanceStore(run_dir, cfg.guidance.retention).save(prepared.guidance)
        write_resolved_config(run_dir, to_plain(cfg))
    except OSError as exc:
        raise ValueError(f"output.root: cannot write the run directory {run_dir}: {exc}") from None


class Loop:
    def __init__(self, cfg: StagectlConfig, world: dist.World, prepared: Prepared, engine: Engine) -> None:
        assert cfg.mission is not None and cfg.guidance is not None and prepared.guidance is not None
        self.cfg = cfg
        self.mission = cfg.mission
        self.world = world
        self.tickets = prepared.tickets
        self.engine = engine
        self.guidance = prepared.guidance  # authoritative on rank 0 only
        self.queue: list[ReflectionRecord] = []
        self.num_reflections = 0
        self.num_judged = 0
        self.num_correct = 0
        self.window = MetricsWindow()
        self.window_batches = 0
        self.window_start = time.perf_counter()
        self.num_windows = 0
        self.writer: art.ArtifactWriter | None = None
        self.store: GuidanceStore | None = None
        if world.is_main:
            self.writer = art.ArtifactWriter(run_dir_of(cfg), fresh=prepared.fresh)
            self.store = GuidanceStore(run_dir_of(cfg), cfg.guidance.retention)

    def run(self) -> RunSummary | None:
        runner = self.cfg.runner
        batch_index = 0  # global batches over the whole run
        try:
            for epoch in range(runner.epochs):
                with dist.phase("epoch order broadcast", "step_s"):
                    order = from_main(
                        epoch_order(len(self.tickets), runner.seed, epoch) if self.world.is_main else None
                    )
                batches = global_batches(
                    len(order), runner.per_rank_rollout_batch_size, self.world.world_size
                )
                for start, end in batches:
                    batch = order[start:end]
                    with dist.phase(f"guidance broadcast of global batch {batch_index}", "step_s"):
                        guidance = from_main(self.guidance if self.world.is_main else None)
                    first, count = shard_bounds(len(batch), self.world.world_size, self.world.rank)
                    mine = self._judge(batch[first : first + count], first, guidance, epoch, batch_index)
                    with dist.phase(f"candidate gather of global batch {batch_index}", "step_s"):
                        gathered = dist.gather_objects(mine)
                    if gathered is not None:
                        self._consume(
                            batch, [c for part in gathered for c in part], guidance, epoch, batch_index
                        )
                    batch_index += 1
            if self.writer is None:
                return None
            if self.window_batches:
                self._write_metrics(epoch=runner.epochs - 1, batch_index=batch_index - 1)
        finally:
            if self.writer is not None:
                self.writer.close()
        return RunSummary(
            run_dir=run_dir_of(self.cfg),
            num_tickets=len(self.tickets),
            num_batches=batch_index,
            num_judged=self.num_judged,
            accuracy=self.num_correct / self.num_judged if self.num_judged else None,
            guidance_step=self.guidance.step,
            num_reflections=self.num_reflections,
        )

    # ------------------------------------------------------------ every rank

    def _judge(
        self, indices: list[int], first: int, guidance: Guidance, epoch: int, batch_index: int
    ) -> list[Candidate]:
        """Every candidate of this rank's shard: sampler.grid x samples_per_decode per ticket."""
        requests = [
            JudgeRequest(
                self.tickets[i],
                guidance,
                rollout_messages(guidance, self.tickets[i], self.mission),
                batch_index,
            )
            for i in indices
        ]
        out: list[Candidate] = []
        if not requests:
            return out
        sampler = self.cfg.sampler
        for grid_index, entry in enumerate(sampler.grid):
            for sample_index in range(sampler.samples_per_decode):
                seed = candidate_seed(self.cfg.runner.seed, entry.seed, sample_index, epoch, batch_index)
                spec = DecodeSpec(entry.temperature, entry.top_p, entry.max_new_tokens, seed)
                texts = self.engine.judge(requests, spec)
                if len(texts) != len(requests):
                    raise RuntimeError(f"the engine answered {len(texts)} of {len(requests)} requests")
                out += [
                    Candidate(first + k, grid_index, sample_index, seed, self.world.rank, text)
                    for k, text in enumerate(texts)
                ]
        return out

    # ------------------------------------------------------------ rank 0

    def _consume(
        self, batch: list[int], candidates: list[Candidate], guidance: Guidance, epoch: int, batch_index: int
    ) -> None:
        assert self.writer is not None
        by_position: dict[int, list[Candidate]] = defaultdict(list)
        for candidate in candidates:
            by_position[candidate.position].append(candidate)
        where = {"epoch": epoch, "batch_index": batch_index, "guidance_step": guidance.step}
        for position, ticket_index in enumerate(batch):
            ticket = self.tickets[ticket_index]
            mine = sorted(by_position[position], key=lambda c: (c.grid_index, c.sample_index))
            parses = [parse_verdict(c.text) for c in mine]
            ids = {"ticket_key": ticket.key, "group_id": ticket.group_id, "label": ticket.label}
            for c, parsed in zip(mine, parses, strict=True):
                entry = self.cfg.sampler.grid[c.grid_index]
                row = {
                    **where,
                    **ids,
                    "rank": c.rank,
                    "grid_index": c.grid_index,
                    "sample_index": c.sample_index,
                    "seed": c.seed,
                    "temperature": entry.temperature,
                    "top_p": entry.top_p,
                    "text": c.text,
                    "verdict": parsed.verdict,
                    "reason": parsed.reason,
                    "format_error": parsed.error,
                }
                self.writer.write(art.TRAJECTORIES, row)
                if not parsed.ok:
                    self.writer.write(art.MALFORMED, row)
            selection = select_verdict([p.verdict for p in parses], ticket.label)
            queued = needs_reflection(selection)
            self.writer.write(
                art.SELECTIONS,
                {
                    **where,
                    **ids,
                    "rank": mine[0].rank if mine else None,
                    "verdict": selection.verdict,
                    "vote_strength": selection.vote_strength,
                    "num_pass": selection.num_pass,
                    "num_fail": selection.num_fail,
                    "num_malformed": selection.num_malformed,
                    "label_match": selection.label_match,
                    "candidates_disagree": selection.candidates_disagree,
                    "queued_for_reflection": queued,
                },
            )
            reason = review_reason(selection, self.cfg.manual_review.min_vote_strength)
            if reason is not None:
                self.writer.write(
                    art.NEED_REVIEW, {**where, **ids, "reason": reason, "verdict": selection.verdict}
                )
            self.window.add(selection)
            self.num_judged += 1
            self.num_correct += selection.label_match
            if queued:
                reasons = tuple(p.reason for p in parses if p.ok)
                self.queue.append(
                    ReflectionRecord(
                        ticket, selection.verdict, selection.num_pass, selection.num_fail, reasons
                    )
                )
            if len(self.queue) >= self.cfg.reflection.batch_size:
                self._reflect(epoch, batch_index, trigger=ticket.key)
        self.window_batches += 1
        if self.window_batches >= self.cfg.runner.logging_steps:
            self._write_metrics(epoch, batch_index)
        self.writer.flush()

    def _reflect(self, epoch: int, batch_index: int, trigger: str) -> None:
        assert self.writer is not None and self.store is not None
        size = self.cfg.reflection.batch_size
        records, self.queue = self.queue[:size], self.queue[size:]
        # Reflection seeds live apart from rollout seeds (epoch -1), one per reflection.
        seed = candidate_seed(self.cfg.runner.seed, 0, self.num_reflections, -1, batch_index)
        result = reflect(
            self.engine, self.guidance, records, self.cfg.reflection, self.mission, seed, utc_now()
        )
        self.num_reflections += 1
        self.window.num_reflections += 1
        row = {"epoch": epoch, "batch_index": batch_index, "trigger_ticket": trigger}
        self.writer.write(art.REFLECTION, {**row, **reflection_row(result, records)})
        if result.outcome.changed:
            self.guidance = result.outcome.guidance
            self.store.save(self.guidance)
            self.window.num_guidance_changes += 1
            log(
                f"reflection {self.num_reflections}: guidance step {self.guidance.step} (batch {batch_index})"
            )

    def _write_metrics(self, epoch: int, batch_index: int) -> None:
        assert self.writer is not None
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
        log(
            f"batch {batch_index}: {row['num_tickets']} tickets, accuracy "
            f"{'n/a' if accuracy is None else f'{accuracy:.3f}'}, guidance step {self.guidance.step}"
        )
        self.num_windows += 1
        self.window = MetricsWindow()
        self.window_batches = 0
        self.window_start = time.perf_counter()
