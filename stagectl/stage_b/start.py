"""Rank 0's start-up of a Stage-B run, around the loop (`runner`): `prepare` reads and checks the tickets, the
guidance and, on a resume, the run's progress and consumer state, writing nothing (an error is broadcast, so
every rank stops cleanly); `start_run_dir` writes the run directory once every rank holds its engine (the
starting guidance, or a resume's cut back to its last batch boundary; config.yaml; plan.json)."""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from stagectl.config.plan import PLAN_FILE
from stagectl.config.plan_stage_b import StageBPlan, write_stage_b_plan
from stagectl.config.stage_b import MISSION_NAME
from stagectl.console import say
from stagectl.files import RESOLVED_CONFIG, write_resolved_config
from stagectl.rundir.resume import config_changes, read_yaml
from stagectl.stage_b import progress as prog
from stagectl.stage_b.consumer import SavedState, read_state
from stagectl.stage_b.guidance import Guidance
from stagectl.stage_b.guidance_store import GuidanceStore, read_guidance_file
from stagectl.stage_b.progress import Progress
from stagectl.stage_b.tickets import SKIP_HINT, Ticket, load_tickets

MAX_REPORTED_LINES = 20


@dataclass(frozen=True)
class Prepared:
    """What rank 0 broadcasts before the loop: the tickets and the starting guidance, or an error."""

    tickets: list[Ticket]
    guidance: Guidance | None  # at the resume point (fresh: guidance.path)
    fresh: bool  # the run directory had no guidance (artifacts are truncated)
    progress: Progress | None  # where the loop starts (fresh: batch 0)
    error: str | None = None
    saved: SavedState | None = None  # a resume's consumer state, read and checked once (`read_state`)


def valid_mission(name: str) -> bool:
    """A mission is a plain name: it becomes a directory under output.root/output.run_name."""
    return bool(MISSION_NAME.fullmatch(name))


def prepare(plan: StageBPlan) -> Prepared:
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


def start_run_dir(plan: StageBPlan, prepared: Prepared) -> None:
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
