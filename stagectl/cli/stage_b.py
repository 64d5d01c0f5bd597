"""`stagectl stage-b CONFIG [--gpus 0,1,2,3 | --nproc N] [--resume | --overwrite] [--set key=value ...]`.

The launcher parses CONFIG once and resolves the run's `StageBPlan` (`stagectl.config.plan_stage_b`). One
process runs that plan in-process; more are re-launched under torchrun with `--plan FILE` (hidden: the plan
written atomically to a private temporary directory), and each rank reads that file instead of parsing the
YAML again.
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
        help="Continue the run in the run directory from its guidance (artifacts appended).",
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
        _rank_from_plan(plan_file)
        return
    from stagectl.config import ConfigError, effective_world_size, load_config
    from stagectl.config.plan_stage_b import stage_b_plan
    from stagectl.launch import inside_torchrun
    from stagectl.rundir import STAGE_B_MARKERS, RunDirPolicy, apply_policy, files_summary
    from stagectl.stage_b.runner import valid_mission

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
    try:
        cfg = load_config(config, sets, world_size=None if inside_torchrun() else num_procs)
    except ConfigError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(1) from None
    try:
        plan = stage_b_plan(cfg)
    except ValueError as exc:
        fail(f"{config}: {exc}")
    if cfg.launch.nnodes != 1:
        fail("stage-b runs on one node; set launch.nnodes: 1")
    # once, before any rank starts (the ranks continue whatever guidance is there); a bad mission name is
    # reported by the runner
    if not inside_torchrun() and valid_mission(plan.mission):
        run_dir = plan.run_dir
        try:
            note = apply_policy(
                run_dir,
                files_summary(run_dir, STAGE_B_MARKERS),
                RunDirPolicy(resume=resume, overwrite=overwrite),
                key="output.root",
                command="--set output.run_name=NEW_NAME",
            )
        except ValueError as exc:
            fail(str(exc))
        if note is not None:
            typer.echo(note, err=True)
    if devices:
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(devices)  # before anything initialises CUDA
    if effective_world_size(cfg) > 1 and not inside_torchrun():
        raise typer.Exit(_relaunch(config, plan, cfg.launch))
    _run(plan)


def _relaunch(config: Path, plan: StageBPlan, launch: LaunchConfig) -> int:
    """torchrun's ranks get the plan as a file (written atomically, removed when they are done)."""
    from stagectl.config.plan import PLAN_FILE
    from stagectl.config.plan_stage_b import write_stage_b_plan
    from stagectl.launch import plan_dir, relaunch_under_torchrun

    with plan_dir() as tmp:
        path = write_stage_b_plan(tmp / PLAN_FILE, plan)
        return relaunch_under_torchrun(["stage-b", str(config), "--plan", str(path)], launch)


def _rank_from_plan(path: Path) -> None:
    from stagectl.config.plan_stage_b import read_stage_b_plan

    try:
        plan = read_stage_b_plan(path)
    except ValueError as exc:
        fail(str(exc))
    _run(plan)


def _run(plan: StageBPlan) -> None:
    from stagectl.dist import CollectiveError
    from stagectl.stage_b.runner import run_all

    try:
        summary = run_all(plan)
    except CollectiveError as exc:
        fail(str(exc))
    except (ValueError, FileNotFoundError) as exc:  # a bad config, model path, ticket or guidance file
        if os.environ.get("RANK", "0") != "0":
            raise typer.Exit(1) from None  # rank 0 reports the same error
        fail(str(exc))
    if summary is None:  # a non-zero rank
        return
    accuracy = "n/a" if summary.accuracy is None else f"{summary.accuracy:.3f}"
    typer.echo(
        f"stage-b: done, {plural(summary.num_judged, 'ticket')} judged in "
        f"{plural(summary.num_batches, 'global batch', 'global batches')}, accuracy {accuracy}, "
        f"{plural(summary.num_reflections, 'reflection')}, guidance step {summary.guidance_step}; "
        f"run dir {summary.run_dir}",
        err=True,
    )
