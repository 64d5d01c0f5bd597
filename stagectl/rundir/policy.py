from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from stagectl.config.plan import PLAN_FILE
from stagectl.files import RESOLVED_CONFIG
from stagectl.rundir.ending import FINAL_STATE, read_run_end
from stagectl.rundir.liveness import RUNNING, running_process, still_running
from stagectl.rundir.resume import has_complete_checkpoint

# what train-ab writes into its run directory (the clean-up of a failed start removes only these)
TRAIN_FILES = (
    RESOLVED_CONFIG,
    PLAN_FILE,
    "metrics.jsonl",
    "samples.jsonl",  # = learner.samples.SAMPLES_FILE, opened before the first step
    FINAL_STATE,
    RUNNING,
    "wandb_run_id",
    "tensorboard",
    "weight_sync",
)
EVAL_MARKERS = ("metrics.json", "predictions.coco.json", "ground_truth.coco.json")
STAGE_B_MARKERS = ("guidance.json", "trajectories.jsonl", "selections.jsonl")


@dataclass(frozen=True)
class RunDirPolicy:
    """What the user asked for when the directory already holds a run (at most one of the two)."""

    resume: bool = False
    overwrite: bool = False

    def __post_init__(self) -> None:
        if self.resume and self.overwrite:
            raise ValueError("--resume and --overwrite contradict each other; give one of them")


def train_run_summary(out: Path) -> str | None:
    """A short description of the train-ab run in `out` ("24 metrics rows, checkpoint-12, checkpoint-24,
    finished"), or None when `out` holds no run."""
    if not out.is_dir():
        return None
    parts = []
    num_rows = count_rows(out / "metrics.jsonl")
    if num_rows:
        parts.append(f"{num_rows} metrics row{'s' if num_rows != 1 else ''}")
    checkpoints = sorted(
        (p for p in out.iterdir() if p.is_dir() and p.name.startswith("checkpoint-")),
        key=lambda p: (len(p.name), p.name),
    )
    if checkpoints:
        names = [p.name for p in checkpoints]
        parts.append(", ".join(names if len(names) <= 3 else [names[0], "...", names[-1]]))
    end = read_run_end(out)
    proc = running_process(out) if end is None else None
    if end is not None:
        parts.append(end.describe(why=False))
    elif proc is not None and parts:  # alone (a start killed before its first row) it makes no run
        parts.append(proc.short())
    return ", ".join(parts) if parts else None


def files_summary(out: Path, markers: Iterable[str]) -> str | None:
    """The marker files present in `out` ("metrics.json, predictions.coco.json"), or None."""
    found = [name for name in markers if (out / name).exists()]
    return ", ".join(found) if found else None


def count_rows(path: Path) -> int:
    """Non-blank lines of a JSONL file (0 when it does not exist)."""
    if not path.is_file():
        return 0
    with path.open("rb") as handle:
        return sum(1 for line in handle if line.strip())


def apply_policy(
    out: Path, found: str | None, policy: RunDirPolicy, *, key: str, command: str, can_resume: bool = True
) -> str | None:
    """Refuse, or move aside, the run `found` in `out` (None: nothing there). Returns the one line to print
    when something was done; `ValueError` (naming `key` and the flags) when the user must choose."""
    if found is None or policy.resume:
        return None
    if policy.overwrite:
        moved = move_aside(out)
        return f"--overwrite: moved the previous run in {out} ({found}) to {moved}; delete it when sure"
    raise refusal(out, found, key=key, command=command, can_resume=can_resume)


def refusal(out: Path, found: str, *, key: str, command: str, can_resume: bool = True) -> ValueError:
    """The error of a command that will not start in `out`, which holds the run `found`: the ways forward."""
    resume = "--resume to continue it, " if can_resume else ""
    return ValueError(
        f"{key}: {out} already holds a run ({found}); nothing was changed. Pass {resume}--overwrite to move "
        f"it aside (to {out.name}.replaced-<time>), or choose another directory ({command})"
    )


def move_aside(out: Path) -> Path:
    """Rename `out` to a free sibling `NAME.replaced-YYYYMMDD-HHMMSS[-k]`."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    target = out.with_name(f"{out.name}.replaced-{stamp}")
    k = 1
    while target.exists():
        target = out.with_name(f"{out.name}.replaced-{stamp}-{k}")
        k += 1
    try:
        os.rename(out, target)
    except OSError as exc:
        raise ValueError(
            f"--overwrite: cannot move {out} aside to {target}: {exc.strerror or exc}; "
            "move or delete it yourself, or choose another directory"
        ) from None
    return target


@dataclass(frozen=True)
class DirSnapshot:
    """What `out` held before a start, so a failed start can remove exactly what it created."""

    out: Path
    existed: bool
    entries: frozenset[str]

    @classmethod
    def take(cls, out: Path) -> DirSnapshot:
        if not out.is_dir():
            return cls(out, False, frozenset())
        return cls(out, True, frozenset(os.listdir(out)))

    def undo_failed_start(self, created_names: Iterable[str] = TRAIN_FILES) -> bool:
        """After a start that failed before its first metrics row: remove the files it created (only names in
        `created_names` that were not there before) and the directory itself when this start created it and
        it is now empty. Nothing is removed once the run has a metrics row or a checkpoint. True when the
        directory is gone or back to what it was."""
        out = self.out
        if not out.is_dir():
            return True
        if count_rows(out / "metrics.jsonl") or any(p.name.startswith("checkpoint-") for p in out.iterdir()):
            return False
        for name in created_names:
            path = out / name
            if name in self.entries or not (path.exists() or path.is_symlink()):
                continue
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
        if not self.existed and not any(out.iterdir()):
            out.rmdir()
        return True


# ---------------------------------------------------------------- train-ab


def prepare_train_dir(out: Path, resume: Path | str | None, overwrite: bool) -> str | None:
    """train-ab's policy for `training.output_dir` (`resume`: `training.resume_from_checkpoint`, `overwrite`:
    `training.overwrite_output_dir`). Idempotent: the CLI applies it before any server starts, global rank 0
    again before it writes (the only place for a multi-node run). Returns the line to print, if any."""
    found = train_dir_verdict(out, resume, overwrite)
    policy = RunDirPolicy(resume=resume is not None, overwrite=overwrite)
    return apply_policy(out, found, policy, key="training.output_dir", command=TRAIN_DIR_HINT)


TRAIN_DIR_HINT = "stagectl train-ab ... --set training.output_dir=NEW_DIR"


def train_dir_verdict(out: Path, resume: Path | str | None, overwrite: bool) -> str | None:
    """train-ab's verdict on `training.output_dir`, acting on nothing (`stagectl doctor` asks it too): the
    run found there (None: none), which `resume` continues or `overwrite` moves aside; `ValueError`, with
    the ways forward, when train-ab refuses to start there."""
    proc = still_running(out)
    if proc is not None:
        raise ValueError(
            f"training.output_dir: {out} is in use: a train-ab run is {proc.short()} there (a job started "
            "twice?); nothing was changed. Let it end, or stop it (Ctrl-C or SIGTERM saves a checkpoint) and "
            "continue it with --resume"
        )
    found = train_run_summary(out)
    if found is not None and str(resume) == "latest" and not has_complete_checkpoint(out):
        raise ValueError(
            f"training.resume_from_checkpoint: latest: {out} holds a run ({found}) but no complete "
            "checkpoint to continue from; pass --overwrite to move it aside and start again"
        )
    if found is not None and resume is None and not overwrite:
        raise refusal(out, found, key="training.output_dir", command=TRAIN_DIR_HINT)
    return found
