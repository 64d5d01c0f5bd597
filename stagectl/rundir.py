"""What a command does with an output directory that already holds a run: refuse (the default), continue
it (`--resume`), or move it aside (`--overwrite`); and the clean-up that leaves no trace of a start that
failed before its first step. Pure path logic, no torch: the CLI calls it before any server or rank starts.

A directory "holds a run" when it has what a run produced and a new run would destroy (`markers` below:
rows in metrics.jsonl, a checkpoint, final_state.json for train-ab; metrics.json / predictions for eval;
guidance.json for stage-b). A directory holding only a resolved `config.yaml` and an empty metrics file is
a start that failed before its first step: nothing of value, so a new run replaces it without a flag.

`--overwrite` renames the directory to a sibling `NAME.replaced-YYYYMMDD-HHMMSS` (a rename: instant, no
byte lost, the user deletes it when sure) and says so in one line. See docs/run_directories.md for why
this is the default instead of a fresh versioned subdirectory per run.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from stagectl.config.plan import PLAN_FILE
from stagectl.console import plural
from stagectl.files import RESOLVED_CONFIG

FINAL_STATE = "final_state.json"

# what train-ab writes into its run directory (the clean-up of a failed start removes only these)
TRAIN_FILES = (
    RESOLVED_CONFIG,
    PLAN_FILE,
    "metrics.jsonl",
    "samples.jsonl",  # = learner.samples.SAMPLES_FILE, opened before the first step
    FINAL_STATE,
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
    if end is not None:
        parts.append(end.describe())
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
    found = train_run_summary(out)
    if found is not None and str(resume) == "latest" and not has_complete_checkpoint(out):
        raise ValueError(
            f"training.resume_from_checkpoint: latest: {out} holds a run ({found}) but no complete "
            "checkpoint to continue from; pass --overwrite to move it aside and start again"
        )
    if found is not None and resume is None and not overwrite:
        raise refusal(out, found, key="training.output_dir", command=TRAIN_DIR_HINT)
    return found


def has_complete_checkpoint(out: Path) -> bool:
    """A `checkpoint-N/` with its trainer_state.json (the rule of `learner.checkpoint.list_checkpoints`,
    restated here without importing torch)."""
    return latest_complete_checkpoint(out) is not None


def resume_note(checkpoint: Path, step: int, max_steps: int) -> str:
    """The line a resumed train-ab prints: which checkpoint, and from which step it continues."""
    if step >= max_steps:
        return (
            f"resuming from {checkpoint}: it is at step {step} and training.max_steps is {max_steps}, so no "
            "step is left to train (raise training.max_steps to train further)"
        )
    return (
        f"resuming from {checkpoint}: {plural(step, 'optimizer step')} done, continuing with step {step + 1} of "
        f'{max_steps} (metrics.jsonl rows with "step" >= {step} are replaced, earlier ones kept)'
    )


def signal_name(signum: int) -> str:
    """`SIGINT` for 2 (`signal N` for a number with no name here)."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def continue_command(out: Path) -> str:
    """The whole command that continues the run in `out`: its own config.yaml holds every --set, the
    learner count and, for an embedded server, `rollout_server.embedded: true`."""
    return f"stagectl train-ab {out / RESOLVED_CONFIG} --resume"


def stop_note(signum: int, step: int, max_steps: int, out: Path) -> str:
    """The end line of a run stopped by a signal: where its checkpoint is and how to continue it."""
    return (
        f"stopped by {signal_name(signum)} after step {step} of {max_steps}; checkpoint saved "
        f"({out / f'checkpoint-{step}'}). Continue with: {continue_command(out)}"
    )


def abort_note(signum: int, out: Path) -> str:
    """The end line of a run a second signal stopped at once (no checkpoint of its last steps)."""
    latest = latest_complete_checkpoint(out)
    last = (
        f"the last good checkpoint is {latest}; continue with: {continue_command(out)}"
        if latest is not None
        else "no checkpoint was written (nothing to resume from)"
    )
    return f"a second {signal_name(signum)} stopped the run at once, without a checkpoint: {last}"


def latest_complete_checkpoint(out: Path) -> Path | None:
    """The newest `checkpoint-N/` with its trainer_state.json (see `has_complete_checkpoint`), or None."""
    if not out.is_dir():
        return None
    steps = [
        int(p.name[len("checkpoint-") :])
        for p in out.iterdir()
        if p.name.startswith("checkpoint-")
        and p.name[len("checkpoint-") :].isdigit()
        and (p / "trainer_state.json").is_file()
    ]
    return out / f"checkpoint-{max(steps)}" if steps else None


def world_size_refusal(checkpoint: Path, written_by: int, world_size: int) -> str:
    """Why `checkpoint` (written by `written_by` ranks) cannot resume in a world of `world_size`."""
    return (
        f"training.resume_from_checkpoint: {checkpoint.name} was written by {written_by} rank(s) but this "
        f"run has {world_size}; the data streams are sharded per rank and cannot be re-sharded "
        f"exactly. Resume with --nproc {written_by}, or start a new run from its weights "
        f"(model.name_or_path: {checkpoint / 'model'}, no resume_from_checkpoint)"
    )


def check_resume_world_size(out: Path, resume: Path | str | None, world_size: int) -> None:
    """The launcher's early form of `learner.checkpoint.check_world_size` (before a server or any rank
    starts): `ValueError` when the checkpoint a resume would continue from was written by another number
    of ranks (its trainer_state.json says; older checkpoints are left to the ranks' check)."""
    checkpoint = latest_complete_checkpoint(out) if str(resume) == "latest" else None
    if resume is not None and str(resume) != "latest":
        checkpoint = Path(resume)
    if checkpoint is None:
        return
    try:
        state = json.loads((checkpoint / "trainer_state.json").read_text())
        written_by = state["data_state"]["world_size"]
    except (OSError, ValueError, KeyError, TypeError):
        return
    if isinstance(written_by, int) and written_by != world_size:
        raise ValueError(world_size_refusal(checkpoint, written_by, world_size))


# ---------------------------------------------------------------- how a train-ab run ended


@dataclass(frozen=True)
class RunEnd:
    """What `final_state.json` says about the end of a run (written when it reached `max_steps` and when a
    signal stopped it). `max_steps`: None when neither the file nor config.yaml names it."""

    step: int
    max_steps: int | None
    stopped_by_signal: int | None

    @property
    def finished(self) -> bool:
        if self.max_steps is not None:
            return self.step >= self.max_steps
        return self.stopped_by_signal is None

    def describe(self) -> str:
        """`finished`, or `stopped at step 8 of 200 (SIGINT)`."""
        if self.finished:
            return "finished"
        of = f" of {self.max_steps}" if self.max_steps is not None else ""
        by = f" ({signal_name(self.stopped_by_signal)})" if self.stopped_by_signal is not None else ""
        return f"stopped at step {self.step}{of}{by}"


def run_end(final_state: Mapping[str, Any], config_max_steps: int | None = None) -> RunEnd:
    """The end `final_state` records; `config_max_steps` (config.yaml's) for a file from before it held
    `max_steps`. `ValueError` when `global_step` is missing."""
    if not isinstance(final_state.get("global_step"), int):
        raise ValueError(f"{FINAL_STATE} has no integer global_step")
    max_steps = final_state.get("max_steps", config_max_steps)
    stopped = final_state.get("stopped_by_signal")
    return RunEnd(
        step=final_state["global_step"],
        max_steps=max_steps if isinstance(max_steps, int) else None,
        stopped_by_signal=stopped if isinstance(stopped, int) else None,
    )


def read_run_end(out: Path) -> RunEnd | None:
    """`run_end` of `out/final_state.json` (None when there is none or it cannot be read)."""
    try:
        final_state = json.loads((out / FINAL_STATE).read_text())
        config = _read_yaml(out / RESOLVED_CONFIG)
        max_steps = config.get("training", {}).get("max_steps") if isinstance(config, dict) else None
        return run_end(final_state, max_steps if isinstance(max_steps, int) else None)
    except (OSError, ValueError, AttributeError):
        return None


def _read_yaml(path: Path) -> Any:
    try:
        return yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return None


# ---------------------------------------------------------------- a resume that changes the config

# keys a resume sets itself or that act on one start only: never reported as a change
RESUME_OWN_KEYS = frozenset({"training.resume_from_checkpoint", "training.overwrite_output_dir"})


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """`{"a": {"b": 1}}` -> `{"a.b": 1}`; lists and scalars are leaves."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten(value, f"{dotted}."))
        else:
            flat[dotted] = value
    return flat


def config_changes(saved: Mapping[str, Any], new: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """The dotted keys whose value differs between the run's saved config and the resumed one, sorted:
    (key, old, new); a key only one side has shows `<unset>` on the other."""
    old_flat, new_flat = flatten(saved), flatten(new)
    unset = "<unset>"
    return [
        (key, old_flat.get(key, unset), new_flat.get(key, unset))
        for key in sorted(old_flat.keys() | new_flat.keys())
        if key not in RESUME_OWN_KEYS and old_flat.get(key, unset) != new_flat.get(key, unset)
    ]


def keep_config_before_resume(out: Path, new: Mapping[str, Any], resume: Path | str | None) -> str | None:
    """Before a resume rewrites `out/config.yaml`: when the resolved config `new` differs from it, copy it
    to `config.step-N.yaml` (N: the checkpoint resumed from; the config the steps up to N trained with,
    kept once) and return the warning listing each changed key; None when nothing changed or there is
    nothing to resume."""
    saved = _read_yaml(out / RESOLVED_CONFIG)
    checkpoint = latest_complete_checkpoint(out) if str(resume) == "latest" else None
    if resume is not None and str(resume) != "latest":
        checkpoint = Path(resume)
    if not isinstance(saved, dict) or checkpoint is None:
        return None
    changes = config_changes(saved, new)
    if not changes:
        return None
    step = checkpoint.name.removeprefix("checkpoint-")
    kept = out / f"config.step-{step}.yaml"
    if not kept.exists():
        shutil.copy2(out / RESOLVED_CONFIG, kept)
    listed = "; ".join(f"{key}: {old!r} -> {value!r}" for key, old, value in changes)
    return (
        f"warning: the resumed config differs from the one that trained {checkpoint.name} "
        f"({len(changes)} key{'s' if len(changes) != 1 else ''}): {listed}. The steps so far trained "
        f"with {kept}; config.yaml now holds the new values"
    )
