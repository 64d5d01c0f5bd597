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

After every global batch rank 0 records the boundary in `progress.json` (`stage_b.progress`). Before every
global batch it broadcasts whether a stop was asked for (`stopping.StopSignals`: SIGTERM or Ctrl-C); if so,
every rank ends there and `progress.json` says `stopped`. `--resume` starts from that boundary: the same
tickets, epoch order, seeds and consumer state, so the resumed run's rows equal an unstopped run's.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from stagectl import dist
from stagectl.config.plan_stage_b import StageBPlan
from stagectl.console import error_text, say
from stagectl.rundir.liveness import clear_running, mark_running
from stagectl.stage_b import progress as prog
from stagectl.stage_b.consumer import Consumer
from stagectl.stage_b.engine import Backend
from stagectl.stage_b.judge import judge_shard
from stagectl.stage_b.sharding import epoch_order, global_batches, shard_bounds
from stagectl.stage_b.start import Prepared, prepare, start_run_dir
from stagectl.stage_b.tickets import Ticket
from stagectl.stopping import StopSignals
from stagectl.wire.errors import RolloutServerError

# the errors `stagectl stage-b` ends on with one `error:` line (progress.json records that line)
ENDING_ERRORS = (ValueError, FileNotFoundError, RolloutServerError, dist.CollectiveError)

T = TypeVar("T")


class StartUpError(ValueError):
    """An error of the start-up that every rank raises alike (rank 0's broadcast tickets or guidance error, the
    model or servers every rank loads): rank 0 reports it. Any other error a rank ends on is its own (a ticket
    of its shard, its server chunk) and that rank reports it."""


@dataclass(frozen=True)
class RunSummary:
    run_dir: Path
    num_tickets: int
    num_batches: int
    num_judged: int
    accuracy: float | None
    guidance_step: int
    num_reflections: int
    stopped_by_signal: int | None  # None: every epoch ran
    num_bad_ticket_lines: int  # skipped (`runner.bad_ticket_lines: skip`)
    bad_ticket_lines: list[str]  # the first few, `file:line: what`
    num_no_verdict: int = 0  # tickets without one well-formed candidate (counted wrong in `accuracy`)


def run_all(
    plan: StageBPlan, stop: StopSignals | None = None, engine: Backend | None = None
) -> RunSummary | None:
    """Run the loop on this rank (world read from torchrun's environment); rank 0 gets the summary.
    `stop`: the signals that end the loop before its next global batch (the caller installs them; None:
    none). The engine this builds is closed before returning (`engine`: a caller's, which it closes)."""
    stop = StopSignals() if stop is None else stop
    world = dist.read_world()
    dist.init_distributed(world, plan.watchdog)
    finished = False
    own: Backend | None = None
    try:
        with dist.phase("start-up: tickets, guidance and model load", "startup_s"):
            prepared = from_main(prepare(plan) if world.is_main else None)
            if prepared.error is not None:
                raise StartUpError(prepared.error)
            if engine is None:
                try:
                    engine = own = build_backend(plan, world)
                except (ValueError, FileNotFoundError) as exc:  # the same model or servers on every rank
                    raise StartUpError(str(exc)) from None
            dist.barrier()  # every rank holds its engine: only now does the run directory get written
        if world.is_main:
            start_run_dir(plan, prepared)
            mark_running(plan.run_dir)  # removed however the loop ends in this process
        try:
            summary = Loop(plan, world, prepared, engine).run(stop)
        finally:
            if world.is_main:
                clear_running(plan.run_dir)
        finished = True
        return summary
    finally:
        try:
            if own is not None:  # its threads end before the interpreter does
                own.close()
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


class Loop:
    """Epochs of global batches from the resume point: rank 0 broadcasts the order, the stop decision and the
    guidance snapshot, every rank judges its shard (`judge.judge_shard`), rank 0's `Consumer` takes the
    gathered candidates in batch order and records the boundary in `progress.json`."""

    def __init__(self, plan: StageBPlan, world: dist.World, prepared: Prepared, engine: Backend) -> None:
        assert prepared.guidance is not None and prepared.progress is not None
        self.plan = plan
        self.world = world
        self.tickets = prepared.tickets
        self.engine = engine
        self.progress = prepared.progress
        self.consumer: Consumer | None = None
        if world.is_main:
            self.consumer = Consumer(
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
            if prepared.saved is not None:
                self.consumer.restore(prepared.saved)
            self._record("running")

    def run(self, stop: StopSignals) -> RunSummary | None:
        runner = self.plan.runner
        stopped: int | None = None
        try:
            for epoch, batch, done in self._batches():
                with dist.phase("stop-signal broadcast", "step_s"):
                    stopped = from_main((stop.signum or -1) if self.world.is_main else None)  # -1: go on
                if stopped >= 0:
                    break
                self._global_batch(batch, epoch, self.progress.batch_index)
                self.progress.batch_index += 1
                self.progress.epoch, self.progress.epoch_offset = done
                self._record("running")
            else:
                stopped = None
                if self.consumer is not None:
                    self.consumer.finish(epoch=runner.epochs - 1, batch_index=self.progress.batch_index - 1)
            self._record("finished" if stopped is None else "stopped", stopped)
        except KeyboardInterrupt:  # a second signal: the batch in flight is abandoned (resume cuts its rows)
            self._record("stopped", stop.signum, at_boundary=False)
            raise
        except Exception as exc:  # an error ends the run: progress.json says so, the resume point stays
            self.progress.error = error_text(exc, ENDING_ERRORS)
            self._record("failed", at_boundary=False)
            raise
        finally:
            if self.consumer is not None:
                self.consumer.close()
        c = self.consumer
        if c is None:
            return None
        return RunSummary(
            run_dir=self.plan.run_dir,
            num_tickets=len(self.tickets),
            num_batches=self.progress.batch_index,
            num_judged=c.num_judged,
            accuracy=c.num_correct / c.num_judged if c.num_judged else None,
            num_no_verdict=c.num_no_verdict,
            guidance_step=c.guidance.step,
            num_reflections=c.num_reflections,
            stopped_by_signal=stopped,
            num_bad_ticket_lines=self.progress.num_bad_ticket_lines,
            bad_ticket_lines=list(self.progress.bad_ticket_lines),
        )

    def _batches(self) -> Iterator[tuple[int, list[Ticket], tuple[int, int]]]:
        """(epoch, the global batch's tickets, the (epoch, offset) after it) from the resume point on."""
        runner = self.plan.runner
        first_epoch, offset = self.progress.epoch, self.progress.epoch_offset
        for epoch in range(first_epoch, runner.epochs):
            with dist.phase("epoch order broadcast", "step_s"):
                order = from_main(
                    epoch_order(len(self.tickets), runner.seed, epoch) if self.world.is_main else None
                )
            skip = offset if epoch == first_epoch else 0
            rest = order[skip:]
            for start, end in global_batches(
                len(rest), runner.per_rank_rollout_batch_size, self.world.world_size
            ):
                done = skip + end
                after = (epoch, done) if done < len(order) else (epoch + 1, 0)
                yield epoch, [self.tickets[i] for i in rest[start:end]], after

    def _record(self, status: prog.Status, signum: int | None = None, *, at_boundary: bool = True) -> None:
        """Rank 0: the current batch boundary (the consumer's state and the artifacts' lengths at it) into
        `progress.json`; `at_boundary=False` (mid-batch) keeps the last boundary and changes the status only."""
        if self.consumer is None:
            return
        self.progress.status = status
        self.progress.stopped_by_signal = signum
        if status != "failed":  # a resumed run: the error that ended it before is past
            self.progress.error = None
        if at_boundary:
            self.progress.consumer = self.consumer.state()
            self.progress.artifact_bytes = self.consumer.writer.lengths()
        prog.write_progress(self.plan.run_dir, self.progress)

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
