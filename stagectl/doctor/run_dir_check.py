"""The run-directory check (`training.output_dir`): what train-ab will do with the directory, by train-ab's
own rule (`rundir.policy.train_dir_verdict`), acting on nothing: start a new run there, continue the run it holds
(`--resume`; a warning when its checkpoint is already at `training.max_steps`, so that train-ab starts nothing),
move that run aside (`--overwrite`), or refuse to start; and whether the directory can be written
(`files.check_output_dir`, train-ab's own probe, which leaves the disk as it found it)."""

from __future__ import annotations

from stagectl.config.training import TrainingConfig
from stagectl.doctor.report import Check, fail, ok, warn
from stagectl.files import check_output_dir
from stagectl.rundir.policy import TRAIN_DIR_HINT, train_dir_verdict
from stagectl.rundir.resume import no_step_left


def check_run_dir(training: TrainingConfig, resume: bool) -> Check:
    """`resume`: doctor was given `--resume` (train-ab's: `resume_from_checkpoint: latest` unless the
    config names a checkpoint)."""
    name = "training.output_dir"
    out = training.output_dir
    resume_from = training.resume_from_checkpoint
    if resume_from is None and resume:
        resume_from = "latest"
    try:
        found = train_dir_verdict(out, resume_from, training.overwrite_output_dir)
    except ValueError as exc:
        if resume_from is None:
            fix = (
                "train-ab (and doctor) --resume continues that run, --overwrite moves it aside, or "
                f"start the new run elsewhere: {TRAIN_DIR_HINT}"
            )
        else:
            fix = f"--overwrite moves it aside, or start the new run elsewhere: {TRAIN_DIR_HINT}"
        return fail(name, f"train-ab will refuse to start: {exc}", fix)
    try:
        check_output_dir(out)
    except ValueError as exc:
        return fail(
            name, f"train-ab will refuse to start: {exc}", f"start the run elsewhere: {TRAIN_DIR_HINT}"
        )
    if found is None:
        return ok(name, f"{out} holds no run: train-ab starts a new one there")
    if resume_from is not None:
        done = no_step_left(out, resume_from, training.max_steps)
        if done is not None:  # train-ab --resume then exits 0 without starting a server or a rank
            return warn(
                name,
                f"{out} holds a run ({found}) that train-ab --resume has nothing left to train: {done}",
                "raise training.max_steps (--set training.max_steps=N) to continue it, or --overwrite to "
                "start again",
            )
        return ok(name, f"{out} holds a run ({found}): train-ab --resume continues it from {resume_from}")
    return ok(
        name,
        f"{out} holds a run ({found}): train-ab --overwrite moves it aside to {out.name}.replaced-<time>",
    )
