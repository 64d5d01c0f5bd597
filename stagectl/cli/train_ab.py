"""`stagectl train-ab CONFIG [--nproc N] [--resume | --overwrite] [--set key=value ...]`.

The launcher parses CONFIG once and resolves the run's `TrainPlan` (`stagectl.config.plan_train.train_plan`, after
an embedded server's address is known). One process trains that plan in-process; more ranks are re-launched
under torchrun with `--plan FILE` (hidden: the plan written atomically to a private temporary directory),
and each rank reads that file instead of parsing the YAML again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from stagectl.cli.common import fail

# the launcher's line at the first Ctrl-C / SIGTERM: the ranks finish their step (a B step may wait for a
# rollout call, up to its timeout), save and end
STOP_NOTICE = (
    "train-ab: stopping after the current step, which is then saved (Ctrl-C again: stop now, keeping only the "
    "last checkpoint)"
)

if TYPE_CHECKING:
    from stagectl.config import StagectlConfig
    from stagectl.config.model_data import DataConfig
    from stagectl.config.plan_train import TrainPlan


def early_stop(signum: int = signal.SIGINT) -> str:
    """The end line of a run a signal stopped before a trainer could save anything."""
    from stagectl.rundir.ending import signal_name

    return f"train-ab: interrupted ({signal_name(signum)}) before its first step; nothing new was saved"


def command(
    config: Path = typer.Argument(..., help="YAML config."),
    nproc: int | None = typer.Option(
        None,
        "--nproc",
        min=1,
        help="Learner processes per node (sets launch.nproc_per_node; the world size is N x launch.nnodes); "
        "a world size > 1 re-launches under torchrun.",
    ),
    resume: bool = typer.Option(
        False,
        "--resume",
        help="Continue the run in training.output_dir from its newest checkpoint (resume_from_checkpoint: "
        "latest unless the config names one); a new run when there is none yet.",
    ),
    overwrite: bool = typer.Option(
        False,
        "--overwrite",
        help="training.output_dir holds a run: move it aside to OUTPUT_DIR.replaced-<time> and start a new one.",
    ),
    overrides: list[str] = typer.Option([], "--set", help="Override a key: --set training.max_steps=10"),
    plan_file: Path | None = typer.Option(
        None, "--plan", hidden=True, help="(the launcher's, for its torchrun ranks) the resolved plan to run."
    ),
) -> None:
    """Run Stage-2 AB training (re-launches itself under torchrun when nproc > 1; starts an embedded
    rollout server first when rollout_server.embedded is true). A training.output_dir that already holds
    a run is refused unless --resume or --overwrite says what to do with it. A run SIGINT/SIGTERM stopped
    saves a checkpoint, prints how to continue and exits 128 + the signal."""
    if plan_file is not None:  # a rank the launcher started: the plan, never the YAML
        if overrides or nproc is not None or resume or overwrite:
            fail(
                "--plan (the launcher's option for its torchrun ranks) takes no --set, --nproc, --resume or --overwrite"
            )
        _rank_from_plan(plan_file)
        return
    from stagectl.config import ConfigError, effective_world_size, launch_world_size, load_config, to_plain
    from stagectl.config.fractions import as_fraction
    from stagectl.config.plan import server_rollouts
    from stagectl.config.rollout import DiskSync
    from stagectl.config.root import uses_server_rollouts
    from stagectl.data.jsonl import load_jsonl_dataset
    from stagectl.doctor.resource_checks import disk_warning
    from stagectl.files import check_output_dir
    from stagectl.launch import as_the_only_rank, embedded_rollout_server, inside_torchrun
    from stagectl.memory.from_config import knobs_from_config
    from stagectl.models.capability import model_problem_on_disk
    from stagectl.placement import check_devices
    from stagectl.rundir.policy import prepare_train_dir
    from stagectl.rundir.resume import (
        check_resume_train_set,
        check_resume_world_size,
        config_change_note,
        nothing_left_note,
    )
    from stagectl.wire.http import not_answering
    from stagectl.wire.tls import check_client_credentials

    if resume and overwrite:
        fail("--resume and --overwrite contradict each other; give one of them")
    sets = list(overrides)
    if nproc is not None:
        sets.append(f"launch.nproc_per_node={nproc}")
    if overwrite:
        sets.append("training.overwrite_output_dir=true")
    # the world the launcher validates and plans for: launch.nproc_per_node (--nproc) on every node, never a
    # $WORLD_SIZE left in its environment (torchrun's ranks: theirs)
    world_size = None if inside_torchrun() else launch_world_size(config, sets)
    try:
        cfg: StagectlConfig = load_config(config, sets, world_size=world_size)
        if resume and cfg.training.resume_from_checkpoint is None:
            sets.append("training.resume_from_checkpoint=latest")
            cfg = load_config(config, sets, world_size=world_size)
    except ConfigError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(1) from None
    if cfg.stage2_ab is None:
        fail(f"{config}: train-ab needs a stage2_ab section (stage2_ab.schedule.b_ratio)")
    if inside_torchrun():  # torchrun started by hand: each rank resolves the plan from the YAML
        _train(_plan_or_fail(cfg, effective_world_size(cfg)))
        return
    world_size = effective_world_size(cfg, world_size)  # the world the config was validated for: the plan's
    t = cfg.training
    ratio = cfg.stage2_ab.schedule.b_ratio if cfg.stage2_ab is not None else None
    a_only = ratio is not None and as_fraction(ratio) == 0
    try:
        # the data's lines and image paths, before the run directory, a server or any rank (a rank opens
        # every image again before the model loads: `learner.setup.load_train_samples`)
        num_samples = cfg.data.synthetic.num_samples if cfg.data and cfg.data.synthetic else None
        if cfg.data is not None and cfg.data.train_jsonl is not None:
            num_samples = len(
                load_jsonl_dataset(cfg.data.train_jsonl, cfg.data.image_root, box_format=cfg.data.box_format)
            )
        if cfg.data is not None:
            _check_held_out(cfg.data)
        model_problem = model_problem_on_disk(cfg.model.name_or_path)  # e.g. a text-only model
        if model_problem is not None:
            raise ValueError(f"model.name_or_path: {model_problem}")
        if cfg.launch.nnodes == 1:  # multi-node: global rank 0 alone decides (learner.setup)
            note = prepare_train_dir(t.output_dir, t.resume_from_checkpoint, t.overwrite_output_dir)
            if note is not None:
                typer.echo(note, err=True)
            # before a server starts: a checkpoint of another world size cannot resume (the ranks check again)
            check_resume_world_size(t.output_dir, t.resume_from_checkpoint, world_size)
            done = nothing_left_note(t.output_dir, t.resume_from_checkpoint, t.max_steps)
            if done is not None:
                typer.echo(f"train-ab: {done}", err=True)
                raise typer.Exit(0)
            if num_samples is not None:  # the ranks check it after a server starts
                check_resume_train_set(t.output_dir, t.resume_from_checkpoint, num_samples)
            changed = config_change_note(t.output_dir, _as_saved(cfg), t.resume_from_checkpoint)
            if changed is not None:
                typer.echo(f"train-ab: {changed}", err=True)
        check_output_dir(t.output_dir)  # before a server or any rank starts
        check_devices(cfg.launch, cfg.rollout_server)
        # the ranks build their rollout client (the token, the CA file) only after the model has loaded
        if uses_server_rollouts(cfg) and not cfg.rollout_server.embedded and not a_only:
            servers = server_rollouts(cfg).servers
            check_client_credentials(servers)
            down = not_answering(servers)  # a server still starting is waited for, by design: say so now
            if down:
                typer.echo(
                    f"train-ab: note: not answering /health/ now: {', '.join(down)}; once the model has loaded "
                    f"the ranks wait up to {servers.wait_healthy_s:g} s ({servers.wait_healthy_key}) for it",
                    err=True,
                )
        knobs = knobs_from_config(
            cfg.model, t, global_max_length=cfg.global_max_length, world_size=world_size
        )
        too_big = disk_warning(cfg.model, t, knobs)  # doctor's checkpoint-size estimate
        if too_big is not None:
            typer.echo(f"train-ab: warning: the checkpoints will not fit: {too_big}", err=True)
    except ValueError as exc:
        fail(str(exc))
    server: contextlib.AbstractContextManager[str | None] = contextlib.nullcontext()
    if cfg.rollout_server.embedded and a_only:  # no B step: no rollout, no weight push (channel_b.build)
        typer.echo("train-ab: b_ratio 0 (A-only): the embedded rollout server is not started", err=True)
    elif cfg.rollout_server.embedded:
        sync = server_rollouts(cfg).sync  # a disk sync's snapshots are what the server may load
        weights_dir = sync.disk_dir if isinstance(sync, DiskSync) else None
        server = embedded_rollout_server(
            config, sets, cfg.rollout_server, cfg.data, t.output_dir, weights_dir=weights_dir
        )
    with _server_errors(), server as url:
        user_config = cfg
        if url is not None:
            typer.echo(f"embedded rollout server: {url}", err=True)
            # the ranks learn the server's address from the config itself
            sets += [
                "rollout_server.embedded=false",
                f"custom.extra.rollout_matching.vllm.server.servers=[{{base_url: '{url}'}}]",
            ]
            cfg = load_config(config, sets, world_size=world_size)
        plan = _plan_or_fail(cfg, world_size)  # every node's launcher resolves its own
        # config.yaml holds the user's config (an embedded server stays embedded: resuming from it starts
        # one again); plan.json records the address this run used
        plan = dataclasses.replace(plan, run_config=dict(to_plain(user_config)))
        if world_size > 1:
            code, signals = _relaunch(config, plan)
            if signals:  # the ranks stopped cleanly (or at once, on a second signal) and said so
                if code:  # they were still starting (torchrun too), before train-ab's own handling
                    typer.echo(early_stop(signals[0]), err=True)
                raise typer.Exit(128 + signals[0])
            if code:
                raise typer.Exit(code)
        else:
            as_the_only_rank()  # a $WORLD_SIZE left in the environment is not this run's world
            _train(plan)


def _as_saved(cfg: StagectlConfig) -> dict[str, Any]:
    """`cfg` as rank 0 writes it to config.yaml (`learner.setup`)."""
    from stagectl.config import to_plain

    plain = dict(to_plain(cfg))
    plain["training"] = {**plain["training"], "overwrite_output_dir": False}
    return plain


def _check_held_out(data: DataConfig) -> None:
    """`data.eval.jsonl` read as rank 0's evaluator reads it (`learner.evaluate.Evaluator`: lines, images
    opened, COCO ids), which it does only once the model has loaded; `ValueError` naming the key."""
    from stagectl.data.jsonl import DataError, load_jsonl_dataset
    from stagectl.evaluation.coco import assign_ids

    held_out = data.eval
    if held_out is None or held_out.jsonl is None:
        return
    try:
        samples = load_jsonl_dataset(
            held_out.jsonl, held_out.image_root, box_format=data.box_format, verify_images=True
        )
    except DataError as exc:
        raise ValueError(f"data.eval.jsonl: {exc}") from None
    assign_ids(samples[: held_out.max_samples], str(held_out.jsonl))  # ids on every line or on none


def _plan_or_fail(cfg: StagectlConfig, world_size: int) -> TrainPlan:
    from stagectl.config.plan_train import train_plan

    try:
        return train_plan(cfg, world_size)
    except ValueError as exc:
        fail(str(exc))


@contextlib.contextmanager
def _server_errors() -> Iterator[None]:
    """The embedded server failing to start is a one-line error, and so is a Ctrl-C while it starts (typer's
    own exits pass through)."""
    from stagectl.server.launcher import ServerStartError

    try:
        yield
    except ServerStartError as exc:
        fail(str(exc))
    except KeyboardInterrupt:
        typer.echo(early_stop(), err=True)
        raise typer.Exit(128 + signal.SIGINT) from None


def _relaunch(config: Path, plan: TrainPlan) -> tuple[int, list[int]]:
    """torchrun's ranks get the plan as a file (written atomically, removed when they are done); each
    stop signal the launcher receives reaches them as it is (they name it in their stop line). Returns
    torchrun's exit code and the signals received."""
    from stagectl.config.plan import PLAN_FILE
    from stagectl.config.plan_train import write_train_plan
    from stagectl.launch import plan_dir, relaunch_under_torchrun
    from stagectl.stopping import noticed

    signals: list[int] = []
    on_signal = noticed(signals, STOP_NOTICE)
    with plan_dir() as tmp:
        path = write_train_plan(tmp / PLAN_FILE, plan)
        code = relaunch_under_torchrun(
            ["train-ab", str(config), "--plan", str(path)], plan.launch, on_signal=on_signal
        )
    return code, signals


def _rank_from_plan(path: Path) -> None:
    """A rank the launcher started. A Ctrl-C the launcher passed on before this rank's trainer ran (its
    imports, the rendezvous) ends it with exit 0: the launcher exits 130 (a rank exiting 130 would be
    reported by torchrun as failed)."""
    try:
        from stagectl.config.plan_train import read_train_plan

        try:
            plan = read_train_plan(path)
        except ValueError as exc:
            fail(str(exc))
        _train(plan)
    except KeyboardInterrupt:
        if int(os.environ.get("RANK", "0")) == 0:
            typer.echo(early_stop(), err=True)
        raise typer.Exit(0) from None


def _train(plan: TrainPlan) -> None:
    from stagectl.console import error_text, plural, say
    from stagectl.dist import CollectiveError, SharedError
    from stagectl.launch import inside_torchrun
    from stagectl.learner.channel_b.protocol import BStepLedger
    from stagectl.learner.checkpoint import CheckpointWriteError
    from stagectl.learner.loop import Trainer
    from stagectl.learner.metrics import rollout_f1_summary, run_rollout_f1s
    from stagectl.placement import place_learner_rank
    from stagectl.rundir.ending import abort_note, stop_note, write_failed_state
    from stagectl.rundir.liveness import clear_running
    from stagectl.rundir.policy import DirSnapshot

    rank = int(os.environ.get("RANK", "0"))
    out = plan.output_dir
    before = DirSnapshot.take(out)
    # a stopped run exits 128 + the signal; under torchrun the launcher gives that code (a rank exiting
    # non-zero would make torchrun report it as failed)
    signal_exit = not inside_torchrun()
    # the errors a run ends on with one `error:` line (anything else is a bug: its traceback)
    expected = (ValueError, FileNotFoundError, TimeoutError, CheckpointWriteError, CollectiveError)
    trainer: Trainer | None = None
    try:
        try:
            # before the model and any thread
            prefetcher_cpus = place_learner_rank(
                plan.launch, plan.cpus, int(os.environ.get("LOCAL_RANK", "0"))
            )
            notice = None if inside_torchrun() else STOP_NOTICE  # a rank: its launcher says it
            trainer = Trainer(plan, prefetcher_cpus=prefetcher_cpus, stop_notice=notice)
            step = trainer.run()
        except BaseException as exc:
            if rank == 0:
                clear_running(out)
            # a start that failed before its first step leaves no trace; a run that had begun records why
            # it ended in final_state.json (a signal's stop is recorded by the trainer itself)
            kept = rank == 0 and not before.undo_failed_start()
            if (
                kept
                and trainer is not None
                and not isinstance(exc, (KeyboardInterrupt, SystemExit, typer.Exit))
            ):
                error = error_text(exc, (*expected, SharedError))
                write_failed_state(
                    out, trainer.steps_done, plan.training.max_steps, error, trainer.b_steps_done
                )
                # what the finished steps trained, as a run that ends well or by a signal says it
                say("train-ab", BStepLedger.from_dict(trainer.b_steps_done).summary_line())
            raise
        else:
            if rank == 0:
                clear_running(out)
    except KeyboardInterrupt:  # a second stop signal during a stop, or Ctrl-C before training started
        if trainer is None or trainer.stopped_by_signal is None:  # no stop handler yet: nothing to save
            if rank == 0:
                typer.echo(early_stop(), err=True)
            raise typer.Exit(128 + signal.SIGINT if signal_exit else 0) from None
        second = trainer.aborted_by_signal or trainer.stopped_by_signal
        if rank == 0:
            typer.echo(abort_note(second, out), err=True)
        raise typer.Exit(128 + second if signal_exit else 0) from None
    except SharedError as exc:  # decided on rank 0 and raised on every rank: rank 0 reports it
        if rank != 0:
            raise typer.Exit(1) from None
        fail(str(exc))
    except expected as exc:
        fail(str(exc) or type(exc).__name__)
    if rank != 0:
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:  # one line per node of a multi-node run
            say(
                "train-ab",
                f"done, {plural(step, 'optimizer step')} (global rank 0 writes the run dir)",
                every_rank=True,
            )
        return
    assert trainer is not None  # it ran to the end
    stopped = trainer.stopped_by_signal
    if stopped is None:
        say("train-ab", f"done, {plural(step, 'optimizer step')}; run dir {out}")
    # what the run trained so far, also when a signal stopped it: a wanted B step that trained as A is in
    # the log of the run that skipped it, not only in final_state.json
    say("train-ab", trainer.b_steps.summary_line())
    off = trainer.b_steps.off_schedule(plan.channel_b.b_ratio_tolerance)
    if off is not None:
        say("train-ab", f"warning: {off}")
    if stopped is not None:  # its last line says how to continue
        typer.echo(stop_note(stopped, step, plan.training.max_steps, out), err=True)
        if signal_exit:
            raise typer.Exit(128 + stopped)
        return
    f1_line = rollout_f1_summary(run_rollout_f1s(out))  # the whole run's, not only this process's steps
    if f1_line is not None:
        say("train-ab", f1_line)
