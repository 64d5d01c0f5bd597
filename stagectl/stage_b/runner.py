"""`run_all(plan)`: the Stage-B loop, the one orchestration entry point for one process or many (`plan`:
the `StageBPlan` the command resolved; the consumer and the backend get their parts of it).

Rank 0 reads the tickets and the guidance and broadcasts them (or the error, so every rank stops
cleanly); every rank then builds its engine (loads the model), and only when all of them have one does
rank 0 write anything (guidance, snapshot, config.yaml, plan.json): a run that cannot start leaves no
artifacts.
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
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from stagectl import dist
from stagectl.config.plan import PLAN_FILE
from stagectl.config.plan_stage_b import StageBPlan, write_stage_b_plan
from stagectl.console import say
from stagectl.files import write_resolved_config
from stagectl.stage_b.consumer import Consumer
from stagectl.stage_b.engine import Backend
from stagectl.stage_b.guidance import Guidance
from stagectl.stage_b.guidance_store import GuidanceStore, read_guidance_file
from stagectl.stage_b.judge import judge_shard
from stagectl.stage_b.sharding import epoch_order, global_batches, shard_bounds
from stagectl.stage_b.tickets import Ticket, load_tickets

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
class RunSummary:
    run_dir: Path
    num_tickets: int
    num_batches: int
    num_judged: int
    accuracy: float | None
    guidance_step: int
    num_reflections: int


def valid_mission(name: str) -> bool:
    """A mission is a plain name: it becomes a directory under output.root/output.run_name."""
    return bool(_MISSION_NAME.match(name))


def run_all(plan: StageBPlan, engine: Backend | None = None) -> RunSummary | None:
    """Run the loop on this rank (world read from torchrun's environment); rank 0 gets the summary."""
    world = dist.read_world()
    dist.init_distributed(world, plan.watchdog)
    finished = False
    try:
        with dist.phase("start-up: tickets, guidance and model load", "startup_s"):
            prepared = from_main(_prepare(plan) if world.is_main else None)
            if prepared.error is not None:
                raise ValueError(prepared.error)
            if engine is None:
                engine = build_backend(plan, world)
            dist.barrier()  # every rank holds its engine: only now does the run directory get written
        if world.is_main:
            _start_run_dir(plan, prepared)
        summary = Loop(plan, world, prepared, engine).run()
        finished = True
        return summary
    finally:
        dist.teardown(final_barrier=finished)


def build_backend(plan: StageBPlan, world: dist.World) -> Backend:
    backend = plan.backend
    if backend.kind == "rules":
        from stagectl.stage_b.engine_rules import RulesBackend

        return RulesBackend()
    if backend.kind == "server":
        from stagectl.stage_b.engine_server import connect_server_backend

        server_engine, note = connect_server_backend(backend.servers)
        say("stage-b", note, every_rank=True)
        return server_engine
    from stagectl.stage_b.engine_model import load_model_backend

    engine, note = load_model_backend(backend, world)
    say("stage-b", note, every_rank=True)
    return engine


def from_main(value: T | None) -> T:
    """Rank 0's `value` on every rank (the other ranks pass None)."""
    out = dist.broadcast_object(value)
    assert out is not None
    return out


def _prepare(plan: StageBPlan) -> Prepared:
    """Rank 0: read and check the tickets and the guidance (nothing is written yet)."""
    try:
        if not valid_mission(plan.mission):
            raise ValueError(f"mission {plan.mission!r} must be a plain name (letters, digits, _ . -)")
        ticket_set = load_tickets(plan.tickets, plan.mission)
        for problem in ticket_set.problems[:MAX_REPORTED_LINES]:
            say("stage-b", f"skipped {problem}")
        if len(ticket_set.problems) > MAX_REPORTED_LINES:
            say("stage-b", f"... and {len(ticket_set.problems) - MAX_REPORTED_LINES} more bad ticket line(s)")
        store = GuidanceStore(plan.run_dir, plan.guidance.retention)
        existing = store.load()  # the CLI refused a run directory holding a run unless --resume
        guidance = existing or read_guidance_file(plan.guidance.path)
    except (ValueError, OSError) as exc:
        return Prepared([], None, False, error=str(exc))
    source = "continuing from" if existing else "starting from"
    say(
        "stage-b",
        f"{len(ticket_set.tickets)} tickets of {plan.mission}; {source} guidance step {guidance.step}",
    )
    return Prepared(ticket_set.tickets, guidance, fresh=existing is None)


def _start_run_dir(plan: StageBPlan, prepared: Prepared) -> None:
    """Rank 0, once every check passed: the starting guidance (fresh runs), the resolved config and the
    plan every rank runs (`plan.json`: a record, not an input)."""
    assert prepared.guidance is not None
    run_dir = plan.run_dir
    try:
        if prepared.fresh:
            GuidanceStore(run_dir, plan.guidance.retention).save(prepared.guidance)
        write_resolved_config(run_dir, plan.resolved_config)
        write_stage_b_plan(run_dir / PLAN_FILE, plan)
    except OSError as exc:
        raise ValueError(f"output.root: cannot write the run directory {run_dir}: {exc}") from None


class Loop:
    """Epochs of global batches: rank 0 broadcasts the order and the guidance snapshot, every rank judges
    its shard (`judge.judge_shard`), rank 0's `Consumer` takes the gathered candidates in batch order."""

    def __init__(self, plan: StageBPlan, world: dist.World, prepared: Prepared, engine: Backend) -> None:
        assert prepared.guidance is not None
        self.plan = plan
        self.world = world
        self.tickets = prepared.tickets
        self.engine = engine
        self.consumer = (
            Consumer(
                plan.run_dir,
                prepared.guidance,
                engine,
                fresh=prepared.fresh,
                mission=plan.mission,
                sampler=plan.sampler,
                reflection=plan.reflection,
                runner=plan.runner,
                guidance_retention=plan.guidance.retention,
                min_vote_strength=plan.min_vote_strength,
            )
            if world.is_main
            else None
        )

    def run(self) -> RunSummary | None:
        runner = self.plan.runner
        batch_index = 0  # global batches over the whole run
        try:
            for epoch in range(runner.epochs):
                with dist.phase("epoch order broadcast", "step_s"):
                    order = from_main(
                        epoch_order(len(self.tickets), runner.seed, epoch) if self.world.is_main else None
                    )
                for start, end in global_batches(
                    len(order), runner.per_rank_rollout_batch_size, self.world.world_size
                ):
                    self._global_batch([self.tickets[i] for i in order[start:end]], epoch, batch_index)
                    batch_index += 1
            if self.consumer is None:
                return None
            self.consumer.finish(epoch=runner.epochs - 1, batch_index=batch_index - 1)
        finally:
            if self.consumer is not None:
                self.consumer.close()
        c = self.consumer
        return RunSummary(
            run_dir=self.plan.run_dir,
            num_tickets=len(self.tickets),
            num_batches=batch_index,
            num_judged=c.num_judged,
            accuracy=c.num_correct / c.num_judged if c.num_judged else None,
            guidance_step=c.guidance.step,
            num_reflections=c.num_reflections,
        )

    def _global_batch(self, batch: list[Ticket], epoch: int, batch_index: int) -> None:
        with dist.phase(f"guidance broadcast of global batch {batch_index}", "step_s"):
            guidance = from_main(self.consumer.guidance if self.consumer is not None else None)
        first, count = shard_bounds(len(batch), self.world.world_size, self.world.rank)
        mine = judge_shard(
            self.engine,
            batch[first : first + count],
            first,
            guidance,
            mission=self.plan.mission,
            sampler=self.plan.sampler,
            run_seed=self.plan.runner.seed,
            rank=self.world.rank,
            epoch=epoch,
            batch_index=batch_index,
        )
        with dist.phase(f"candidate gather of global batch {batch_index}", "step_s"):
            gathered = dist.gather_objects(mine)
        if gathered is not None:
            assert self.consumer is not None
            self.consumer.consume(batch, [c for part in gathered for c in part], guidance, epoch, batch_index)
