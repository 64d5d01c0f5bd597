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

import shutil
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from stagectl import dist
from stagectl.config.plan import PLAN_FILE
from stagectl.config.plan_stage_b import StageBPlan, write_stage_b_plan
from stagectl.config.stage_b import MISSION_NAME
from stagectl.console import error_text, say
from stagectl.files import RESOLVED_CONFIG, write_resolved_config
from stagectl.rundir.liveness import clear_running, mark_running
from stagectl.rundir.resume import config_changes, read_yaml
from stagectl.stage_b import progress as prog
from stagectl.stage_b.consumer import Consumer, SavedState, read_state
from stagectl.stage_b.engine import Backend
from stagectl.stage_b.guidance import Guidance
from stagectl.stage_b.guidance_store import GuidanceStore, read_guidance_file
from stagectl.stage_b.judge import judge_shard
from stagectl.stage_b.progress import Progress
from stagectl.stage_b.sharding import epoch_order, global_batches, shard_bounds
from stagectl.stage_b.tickets import SKIP_HINT, Ticket, load_tickets
from stagectl.stopping import StopSignals
from stagectl.wire.errors import RolloutServerError

# the errors `stagectl stage-b` ends on with one `error:` line (progress.json records that line)
ENDING_ERRORS = (ValueError, FileNotFoundError, RolloutServerError, dist.CollectiveError)

MAX_REPORTED_LINES = 20
T = TypeVar("T")


class StartUpError(ValueError):
    """An error of the start-up that every rank raises alike (rank 0's broadcast tickets or guidance error, the
    model or servers every rank loads): rank 0 reports it. Any other error a rank ends on is its own (a ticket
    of its shard, its server chunk) and that rank reports it."""


@dataclass(frozen=True)
class Prepared:
    """What rank 0 broadcasts before the loop: the tickets and the starting guidance, or an error."""

    tickets: list[Ticket]
    guidance: Guidance | None  # at the resume point (fresh: guidance.path)
    fresh: bool  # the run directory had no guidance (artifacts are truncated)
    progress: Progress | None  # where the loop starts (fresh: batch 0)
    error: str | None = None
    saved: SavedState | None = None  # a resume's consumer state, read and checked once (`read_state`)


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


def valid_mission(name: str) -> bool:
    """A mission is a plain name: it becomes a directory under output.root/output.run_name."""
    return bool(MISSION_NAME.fullmatch(name))


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
            prepared = from_main(_prepare(plan) if world.is_main else None)
            if prepared.error is not None:
                raise StartUpError(prepared.error)
            if engine is None:
                try:
                    engine = own = build_backend(plan, world)
                except (ValueError, FileNotFoundError) as exc:  # the same model or servers on every rank
                    raise StartUpError(str(exc)) from None
            dist.barrier()  # every rank holds its engine: only now does the run directory get written
        if world.is_main:
            _start_run_dir(plan, prepared)
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


def _prepare(plan: StageBPlan) -> Prepared:
    """Rank 0: read and check the tickets, the guidance and, on a resume, the run's progress (nothing is
    written yet)."""
    try:
        if not valid_mission(plan.mission):
            raise ValueError(
                f"mission {plan.mission!r} must be a plain name (letters of any script, digits, _ . -)"
            )
        ticket_set = load_tickets(plan.tickets, plan.mission, skip_bad=plan.runner.bad_ticket_lines == "skip")
        for problem in ticket_set.problems[:MAX_REPORTED_LINES]:
            say("stage-b", f"skipped {problem}")
        if len(ticket_set.problems) > MAX_REPORTED_LINES:
            say("stage-b", f"... and {len(ticket_set.problems) - MAX_REPORTED_LINES} more bad ticket line(s)")
        if ticket_set.both_labels:
            shown = ", ".join(ticket_set.both_labels[:MAX_REPORTED_LINES])
            more = len(ticket_set.both_labels) - MAX_REPORTED_LINES
            say(
                "stage-b",
                f"{len(ticket_set.both_labels)} group(s) labelled both pass and fail, each label a ticket of its "
                f"own (group_id::label, as upstream keys them): {shown}"
                + (f" and {more} more" if more > 0 else ""),
            )
        store = GuidanceStore(plan.run_dir, plan.guidance.retention)
        existing = store.load()  # the CLI refused a run directory holding a run unless --resume
        digest = prog.tickets_digest([t.key for t in ticket_set.tickets], plan.runner.seed)
        saved = None
        if existing is None:
            guidance = read_guidance_file(plan.guidance.path, plan.mission)
            progress = Progress(digest)
        else:
            progress = _resume_point(plan, digest)
            if progress.consumer:  # checked here, before anything is written
                saved = _saved_state(plan.run_dir, progress, ticket_set.tickets)
            guidance = existing if saved is None else saved.guidance
        progress.num_bad_ticket_lines = len(ticket_set.problems)
        progress.bad_ticket_lines = ticket_set.problems[: prog.NUM_LISTED_BAD_LINES]
    except (ValueError, OSError) as exc:
        return Prepared([], None, False, None, error=str(exc))
    count = f"{len(ticket_set.tickets)} tickets of {plan.mission}"
    if ticket_set.problems:
        count += f" ({len(ticket_set.problems)} bad line(s) skipped: {SKIP_HINT})"
    if existing is None:
        say("stage-b", f"{count}; starting from guidance step {guidance.step}")
    elif progress.epoch >= plan.runner.epochs:
        say(
            "stage-b",
            f"{count}; the run has judged all {plan.runner.epochs} epoch(s) (runner.epochs): nothing left to "
            "judge (raise runner.epochs to go on)",
        )
    else:
        say(
            "stage-b",
            f"{count}; resuming at global batch {progress.batch_index} (epoch {progress.epoch}, "
            f"{progress.epoch_offset} of its tickets judged) with guidance step {guidance.step}",
        )
    return Prepared(ticket_set.tickets, guidance, fresh=existing is None, progress=progress, saved=saved)


def _resume_point(plan: StageBPlan, digest: str) -> Progress:
    """The progress of the run being resumed; `ValueError` when it cannot continue exactly."""
    run_dir = plan.run_dir
    progress = prog.read_progress(run_dir)
    if progress is None:
        raise ValueError(
            f"{run_dir} holds guidance.json but no {prog.PROGRESS_FILE} (a run of an older stagectl), so it "
            "cannot be resumed exactly; start a new run from its guidance: --set output.run_name=NEW_NAME "
            f"--set guidance.path={run_dir / 'guidance.json'}"
        )
    if progress.tickets_digest != digest:
        raise ValueError(
            f"the tickets or runner.seed differ from those of the run in {run_dir}: --resume continues the same "
            "tickets in the same order; start a new run instead (--overwrite, or --set output.run_name=NEW_NAME)"
        )
    prog.check_artifacts(run_dir, progress.artifact_bytes)
    return progress


def _saved_state(run_dir: Path, progress: Progress, tickets: list[Ticket]) -> SavedState:
    """The consumer's state in the run's `progress.json`; `ValueError` naming the file and the key."""
    try:
        return read_state(progress.consumer, {t.key: t for t in tickets})
    except ValueError as exc:
        raise ValueError(
            f"{run_dir / prog.PROGRESS_FILE}: not a Stage-B progress file ({exc}); the run cannot be resumed"
        ) from None


def _start_run_dir(plan: StageBPlan, prepared: Prepared) -> None:
    """Rank 0, once every check passed: the starting guidance (fresh runs), the resolved config and the
    plan every rank runs (`plan.json`: a record, not an input)."""
    assert prepared.guidance is not None
    run_dir = plan.run_dir
    assert prepared.progress is not None
    try:
        store = GuidanceStore(run_dir, plan.guidance.retention)
        if prepared.fresh:
            store.save(prepared.guidance)
        else:  # back to the last batch boundary: what a batch that was cut off wrote goes
            removed = prog.cut_artifacts(run_dir, prepared.progress.artifact_bytes)
            edited = store.restore(prepared.guidance)
            if edited is not None:
                say(
                    "stage-b",
                    f"warning: {run_dir / 'guidance.json'} was changed after the run stopped; --resume continues "
                    f"with the guidance it had then (step {prepared.guidance.step}, in progress.json). The changed "
                    f"file is kept as {edited}: to judge with it, start a new run: --set output.run_name=NEW_NAME "
                    f"--set guidance.path={edited}",
                )
            if removed:
                files = ", ".join(f"{name} ({size} bytes)" for name, size in removed.items())
                say(
                    "stage-b",
                    f"removed what the cut-off global batch {prepared.progress.batch_index} wrote: {files}",
                )
            _keep_config_before_resume(run_dir, plan.resolved_config, prepared.progress.batch_index)
        write_resolved_config(run_dir, plan.resolved_config)
        write_stage_b_plan(run_dir / PLAN_FILE, plan)
    except OSError as exc:
        raise ValueError(f"output.root: cannot write the run directory {run_dir}: {exc}") from None


def _keep_config_before_resume(run_dir: Path, new: Mapping[str, object], batch_index: int) -> None:
    """A resume whose resolved config differs from the run's `config.yaml` (another model, sampler grid,
    engine, ...): keep the old file as `config.batch-N.yaml` (the config global batches before N were judged
    with; kept once) and name every changed key, as train-ab's resume does, instead of overwriting the record
    of how the rows so far were made."""
    saved = read_yaml(run_dir / RESOLVED_CONFIG)
    if batch_index == 0 or not isinstance(saved, dict):  # nothing judged yet: no rows to keep a record of
        return
    changes = config_changes(saved, new)
    if not changes:
        return
    kept = run_dir / f"config.batch-{batch_index}.yaml"
    if not kept.exists():
        shutil.copy2(run_dir / RESOLVED_CONFIG, kept)
    listed = "; ".join(f"{key}: {old!r} -> {value!r}" for key, old, value in changes)
    say(
        "stage-b",
        f"warning: the resumed config differs from the one that judged global batches 0..{batch_index - 1} "
        f"({len(changes)} key{'s' if len(changes) != 1 else ''}): {listed}. That config is kept as {kept} and "
        "config.yaml holds the new values",
    )


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
