"""`stagectl stage-b CONFIG [--gpus 0,1,2,3 | --nproc N] [--resume | --overwrite] [--set key=value ...]`.

The launcher parses CONFIG once and resolves the run's `StageBPlan` (`stagectl.config.plan_stage_b`). One
process runs that plan in-process; more are re-launched under torchrun with `--plan FILE` (hidden: the plan
written atomically to a private temporary directory), and each rank reads that file instead of parsing the
YAML again.

SIGTERM or Ctrl-C stops the run before its next global batch (the one running finishes and is saved in
`progress.json`); the last line says how to continue, and the exit code is 128 + the signal (130 for Ctrl-C).
Under torchrun the launcher forwards the signal to the ranks, which stop the same way and exit 0, and the
launcher prints that line and exits with that code (no rank "fails"). A second signal stops at once: the
batch in flight is abandoned, and `--resume` removes what it wrote.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from stagectl.cli.common import fail
from stagectl.console import plural

if TYPE_CHECKING:
    from stagectl.config.plan_stage_b import StageBPlan
    from stagectl.config.training import LaunchConfig

# the line at the first Ctrl-C / SIGTERM: the ranks finish their global batch (its rollout calls included)
STOP_NOTICE = (
    "stage-b: stopping after the current batch, whose results are then saved (Ctrl-C again: stop now; "
    "--resume drops the cut-off batch)"
)


def parse_gpus(text: str) -> list[str]:
    """`0,1,3` -> ["0", "1", "3"]; `ValueError` for anything but distinct non-negative integers."""
    devices = [part.strip() for part in text.split(",")]
    if not devices or not all(d.isdigit() for d in devices):
        raise ValueError(
            f"--gpus must be a comma-separated list of device numbers like 0,1,2,3, got {text!r}"
        )
    if len(set(devices)) != len(devices):
        raise ValueError(f"--gpus lists a device twice: {text!r}")
    return devices


def command(
    config: Path = typer.Argument(..., help="YAML config."),
    gpus: str | None = typer.Option(
        None, "--gpus", help="Devices, e.g. 0,1,2,3: one process per device (CUDA_VISIBLE_DEVICES)."
    ),
    nproc: int | None = typer.Option(
        None, "--nproc", min=1, help="Processes; > 1 re-launches under torchrun (CPU ranks use gloo)."
    ),
    resume: bool = typer.Option(
        False,
        "--resume",
        help="Continue the run in the run directory at the global batch where it stopped (its progress.json; "
        "same tickets and runner.seed); a finished run goes on only when runner.epochs was raised.",
    ),
    overwrite: bool = typer.Option(
        False,
        "--overwrite",
        help="The run directory holds a run: move it aside to DIR.replaced-<time> and start from guidance.path.",
    ),
    overrides: list[str] = typer.Option([], "--set", help="Override a key: --set runner.epochs=2"),
    plan_file: Path | None = typer.Option(
        None, "--plan", hidden=True, help="(the launcher's, for its torchrun ranks) the resolved plan to run."
    ),
) -> None:
    """Run the Stage-B guidance loop (re-launches itself under single-node torchrun for > 1 process). A run
    directory ({output.root}/{output.run_name}/{mission}) that holds a run is refused unless --resume or
    --overwrite says what to do with it."""
    if plan_file is not None:  # a rank the launcher started: the plan, never the YAML
        if overrides or gpus is not None or nproc is not None or resume or overwrite:
            fail(
                "--plan (the launcher's option for its torchrun ranks) takes no --set, --gpus, --nproc, "
                "--resume or --overwrite"
            )
        _rank_from_plan(plan_file, config)
        return
    restart = (config, bool(overrides) or gpus is not None or nproc is not None)
    from stagectl.config import ConfigError, effective_world_size, launch_world_size, load_config
    from stagectl.config.plan_stage_b import stage_b_plan
    from stagectl.files import check_output_dir
    from stagectl.launch import as_the_only_rank, inside_torchrun
    from stagectl.models.capability import template_problem_on_disk
    from stagectl.rundir.liveness import still_running
    from stagectl.rundir.policy import STAGE_B_MARKERS, RunDirPolicy, apply_policy, files_summary
    from stagectl.stage_b.progress import describe, read_progress
    from stagectl.stage_b.start import valid_mission

    devices: list[str] = []
    if gpus is not None:
        try:
            devices = parse_gpus(gpus)
        except ValueError as exc:
            fail(str(exc))
        if nproc is not None and nproc != len(devices):
            fail(f"--nproc {nproc} disagrees with --gpus {gpus} ({len(devices)} devices); give one of them")
    num_procs = len(devices) or nproc
    sets = list(overrides)
    if num_procs is not None:
        sets.append(f"launch.nproc_per_node={num_procs}")
    # the processes the launcher starts: --nproc / --gpus, else launch.nproc_per_node, never a $WORLD_SIZE left
    # in its environment (a torchrun started by hand: its own)
    world_size = None if inside_torchrun() else launch_world_size(config, sets)
    try:
        cfg = load_config(config, sets, world_size=world_size)
    except ConfigError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(1) from None
    try:
        plan = stage_b_plan(cfg)
    except ValueError as exc:
        fail(f"{config}: {exc}")
    if cfg.launch.nnodes != 1:
        fail("stage-b runs on one node; set launch.nnodes: 1")
    if cfg.runner.engine == "model":  # each rank renders it only after loading the model
        problem = template_problem_on_disk(cfg.model.name_or_path)
        if problem is not None:
            fail(f"model.name_or_path: {problem}")
    # once, before any rank starts (the ranks continue whatever guidance is there); a bad mission name was
    # refused by the config (and again by the runner, for a plan.json written by hand)
    if not inside_torchrun() and valid_mission(plan.mission):
        run_dir = plan.run_dir
        try:
            proc = still_running(run_dir)
            if proc is not None:
                raise ValueError(
                    f"output.root: {run_dir} is in use: a stage-b run is {proc.short()} there (a job started "
                    "twice?); nothing was changed. Let it end, or stop it (Ctrl-C or SIGTERM) and continue it "
                    "with --resume"
                )
            found = files_summary(run_dir, STAGE_B_MARKERS)
            progress = read_progress(run_dir) if found is not None else None
            if found is not None and progress is not None:
                found += f"; {describe(progress)}"
            note = apply_policy(
                run_dir,
                found,
                RunDirPolicy(resume=resume, overwrite=overwrite),
                key="output.root",
                command="--set output.run_name=NEW_NAME",
            )
            check_output_dir(run_dir, key="output.root")  # rank 0 first writes it after the model loads
        except ValueError as exc:
            fail(str(exc))
        if note is not None:
            typer.echo(note, err=True)
        if resume and progress is not None and progress.epoch >= plan.runner.epochs:
            # the runner's own verdict, before a model loads or a rank starts (train-ab's `nothing_left_note`)
            typer.echo(
                f"stage-b: {run_dir} has judged all {plan.runner.epochs} epoch(s) (runner.epochs): nothing left "
                "to judge (raise runner.epochs to go on); nothing was started",
                err=True,
            )
            raise typer.Exit(0)
    if devices:
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(devices)  # before anything initialises CUDA
    if effective_world_size(cfg, world_size) > 1 and not inside_torchrun():
        raise typer.Exit(_relaunch(plan, cfg.launch, restart))
    as_the_only_rank()  # one process: a stale $WORLD_SIZE / $RANK is not its world
    _run(plan, restart)


def _relaunch(plan: StageBPlan, launch: LaunchConfig, restart: tuple[Path, bool]) -> int:
    """torchrun's ranks get the plan as a file (written atomically, removed when they are done). A run the
    ranks stopped on a signal ends with the stop line here and 128 + the signal this launcher got."""
    from stagectl.config.plan import PLAN_FILE
    from stagectl.config.plan_stage_b import write_stage_b_plan
    from stagectl.launch import plan_dir, relaunch_under_torchrun
    from stagectl.stage_b.progress import read_progress
    from stagectl.stopping import exit_code, noticed

    received: list[int] = []
    with plan_dir() as tmp:
        path = write_stage_b_plan(tmp / PLAN_FILE, plan)
        args = ["stage-b", str(restart[0]), "--plan", str(path)]
        code = relaunch_under_torchrun(args, launch, on_signal=noticed(received, STOP_NOTICE))
    try:
        progress = read_progress(plan.run_dir)
    except ValueError:
        progress = None
    if code != 0:
        return exit_code(received[0]) if received else code
    if progress is not None and progress.status == "finished":  # a signal during the last batch
        return 0
    if progress is not None and progress.status == "stopped" and progress.stopped_by_signal is not None:
        signum = received[0] if received else progress.stopped_by_signal
    elif received:  # the ranks stopped during their start-up
        signum = received[0]
    else:
        return 0
    typer.echo(stop_line(signum, plan.run_dir, restart), err=True)
    return exit_code(signum)


def stop_line(signum: int, run_dir: Path, restart: tuple[Path, bool]) -> str:
    """The last line of a run a signal stopped: where it stopped (from `progress.json`) and how to continue."""
    import signal

    from stagectl.stage_b.progress import PROGRESS_FILE, read_progress

    progress = read_progress(run_dir)
    config, extra_options = restart
    same = " and the same --set/--gpus/--nproc options" if extra_options else ""
    name = signal.Signals(signum).name
    if progress is None:  # stopped during the start-up, before the run directory was written
        return f"stage-b: stopped by {name} before the run started; nothing was written. Run the same command again"
    return (
        f"stage-b: stopped by {name} before global batch {progress.batch_index} (epoch {progress.epoch}); "
        f"progress saved in {run_dir / PROGRESS_FILE}. "
        f"Continue with: stagectl stage-b {config} --resume{same}"
    )


def server_lost_line(exc: Exception, run_dir: Path, restart: tuple[Path, bool] | None) -> str:
    """The error of a run whose rollout servers stopped answering: the server's error, what is saved (from
    `progress.json`) and how to continue once a server answers again."""
    from stagectl.stage_b.progress import PROGRESS_FILE, read_progress

    try:
        progress = read_progress(run_dir)
    except ValueError:
        progress = None
    if progress is None:
        return f"{exc}; nothing was saved (the run had not started). Run the same command again once a server answers"
    config = "CONFIG" if restart is None else str(restart[0])
    same = " and the same --set/--gpus/--nproc options" if restart is not None and restart[1] else ""
    return (
        f"{exc}. Progress is saved before global batch {progress.batch_index} (epoch {progress.epoch}) in "
        f"{run_dir / PROGRESS_FILE}; once a server answers (runner.server.base_urls), continue with: "
        f"stagectl stage-b {config} --resume{same}"
    )


def _rank_from_plan(path: Path, config: Path) -> None:
    from stagectl.config.plan_stage_b import read_stage_b_plan

    try:
        plan = read_stage_b_plan(path)
    except ValueError as exc:
        fail(str(exc))
    _run(plan, None, rerun=(config, True))  # the user's command had --nproc at least


def _run(plan: StageBPlan, restart: tuple[Path, bool] | None, rerun: tuple[Path, bool] | None = None) -> None:
    """Run the plan on this rank. `restart` (CONFIG, whether the user gave options): a process the user
    started, which prints the stop line itself; None: a rank of our launcher, which prints it. `rerun`: the
    same for a launcher's rank, for the hint of an error line it prints."""
    import signal

    from stagectl.dist import CollectiveError
    from stagectl.stage_b.runner import StartUpError, run_all
    from stagectl.stopping import StopSignals
    from stagectl.wire.errors import RolloutServerError

    rank = os.environ.get("RANK", "0")
    # the process ends right after a stop; one the user started says what the stop waits for
    stop = StopSignals(ignore_after_stop=True, notice=STOP_NOTICE if restart is not None else None)
    try:
        with stop:
            summary = run_all(plan, stop)
    except KeyboardInterrupt:  # a second signal (or one before the handlers were in place): stopped at once
        _stopped(stop.signum or signal.SIGINT, plan, restart, rank)
        return
    except CollectiveError as exc:
        fail(str(exc))
    except RolloutServerError as exc:  # runner.engine: server and no server left to answer
        if rank != "0":  # its own chunk's: rank 0 ends on the gather this rank leaves, not on this error
            typer.echo(f"error: rank {rank}: {exc}", err=True)
            raise typer.Exit(1) from None
        fail(server_lost_line(exc, plan.run_dir, restart or rerun))
    except (ValueError, FileNotFoundError) as exc:  # a bad config, model path, ticket or guidance file
        if rank != "0":
            if not isinstance(exc, StartUpError):  # e.g. a ticket of this rank's shard: only this rank has it
                typer.echo(f"error: rank {rank}: {exc}", err=True)
            raise typer.Exit(1) from None  # rank 0 reports a start-up error, the same on every rank
        fail(str(exc))
    if summary is None:  # a non-zero rank
        if stop.signum is not None:
            _stopped(stop.signum, plan, restart, rank)
        return
    if summary.num_bad_ticket_lines:
        typer.echo(
            f"stage-b: warning: {summary.num_bad_ticket_lines} bad ticket line(s) skipped "
            f"(runner.bad_ticket_lines: skip), first: {summary.bad_ticket_lines[0]}",
            err=True,
        )
    if summary.num_no_verdict:  # a degraded run: its accuracy counts answers it could not read as wrong
        typer.echo(
            f"stage-b: warning: {summary.num_no_verdict} of {plural(summary.num_judged, 'ticket')} got no verdict: "
            "no candidate answered in the `Verdict: pass|fail` / `Reason: ...` format (failure_malformed.jsonl; "
            "the tickets are in need_review_queue.jsonl and count as wrong in the accuracy)",
            err=True,
        )
    if summary.stopped_by_signal is not None:
        _stopped(summary.stopped_by_signal, plan, restart, rank)
        return
    accuracy = "n/a" if summary.accuracy is None else f"{summary.accuracy:.3f}"
    typer.echo(
        f"stage-b: done, {plural(summary.num_judged, 'ticket')} judged in "
        f"{plural(summary.num_batches, 'global batch', 'global batches')}, accuracy {accuracy}, "
        f"{plural(summary.num_reflections, 'reflection')}, guidance step {summary.guidance_step}; "
        f"run dir {summary.run_dir}",
        err=True,
    )


def _stopped(signum: int, plan: StageBPlan, restart: tuple[Path, bool] | None, rank: str) -> None:
    """A signal ended the run: our launcher's ranks exit 0 (it reports), a process the user started prints
    the stop line (rank 0) and exits with 128 + the signal."""
    from stagectl.stopping import exit_code

    if restart is None:
        raise typer.Exit(0)
    if rank == "0":
        typer.echo(stop_line(signum, plan.run_dir, restart), err=True)
    raise typer.Exit(exit_code(signum))
