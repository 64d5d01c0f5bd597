"""What a `--resume` continues from and what it checks before any server or rank starts: the newest
complete checkpoint, the world size that wrote it, and a config that changed since (kept as
`config.step-N.yaml`, each changed key named). Pure path logic, no torch."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from stagectl.console import plural
from stagectl.files import RESOLVED_CONFIG


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


def has_complete_checkpoint(out: Path) -> bool:
    """A `checkpoint-N/` with its trainer_state.json (the rule of `learner.checkpoint.list_checkpoints`,
    restated here without importing torch)."""
    return latest_complete_checkpoint(out) is not None


def resume_checkpoint(out: Path, resume: Path | str | None) -> Path | None:
    """The checkpoint a resume continues from: `latest` -> the newest complete one in `out`, a path -> that
    path, None (a new run) -> None."""
    if resume is None:
        return None
    return latest_complete_checkpoint(out) if str(resume) == "latest" else Path(resume)


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


def set_aside_later_checkpoints(out: Path, step: int) -> tuple[list[str], Path] | None:
    """Rank 0, once a resume from the checkpoint of `step` has passed its checks: `out`'s checkpoints of later
    steps belong to the continuation this resume replaces (its metrics rows are dropped too). They are moved
    into `out/superseded-after-step-{step}[-k]/`, kept whole, so that `latest` (the next `--resume`), export
    and eval of the run dir, and `save_total_limit`'s pruning see this run's checkpoints only (left in place,
    the stale newest one was resumed from next and the pruning deleted the run's own new checkpoint).
    Returns the names moved and the folder, None when there were none."""
    later = sorted(
        (int(p.name[len("checkpoint-") :]), p)
        for p in out.iterdir()
        if p.is_dir() and p.name.startswith("checkpoint-") and p.name[len("checkpoint-") :].isdigit()
    )
    later = [(n, p) for n, p in later if n > step]
    if not later:
        return None
    folder = out / f"superseded-after-step-{step}"
    k = 1
    while folder.exists():
        folder = out / f"superseded-after-step-{step}-{k}"
        k += 1
    folder.mkdir()
    moved: list[Path] = []
    try:
        for _, path in later:
            os.rename(path, folder / path.name)
            moved.append(path)
    except OSError as exc:  # e.g. a checkpoint made read-only to keep it: put back what moved, then refuse
        failed = path.name
        for done in moved:
            with contextlib.suppress(OSError):
                os.rename(folder / done.name, done)
        with contextlib.suppress(OSError):
            folder.rmdir()
        raise ValueError(
            f"training.resume_from_checkpoint: resuming from step {step} sets aside the later checkpoints of "
            f"{out} (the continuation it replaces), but {failed} cannot be moved to {folder}: "
            f"{exc.strerror or exc}; nothing was moved. Make it movable, or move it out of the run dir yourself"
        ) from None
    return [p.name for _, p in later], folder


def record_resume(
    out: Path, plain: dict[str, Any], resume: Path, step: int
) -> tuple[dict[str, Any], str | None]:
    """Rank 0, once a resume from `resume` (the checkpoint of `step`) has passed its checks: the later
    checkpoints set aside first (a refused move changes nothing: no `config.step-N.yaml` either), then the
    config that trained the steps so far kept; returns the config.yaml to write and the line to print about
    the move (None when nothing moved)."""
    superseded = set_aside_later_checkpoints(out, step)
    keep_config_before_resume(out, plain, resume)
    note = superseded_note(*superseded, resume) if superseded is not None else None
    return continuation_config(plain, out, resume), note


def continuation_config(plain: dict[str, Any], out: Path, resumed: Path) -> dict[str, Any]:
    """The config.yaml a resume writes: it continues the run (`train-ab RUN/config.yaml --resume`, what a stop
    prints) from the newest checkpoint the run writes, not again from one of its own named for this start
    (each continue went back to it, and set aside what the run had trained since). Another run's checkpoint
    stays named: before this run saves one, `latest` would start it from scratch."""
    if not resumed.resolve().is_relative_to(out.resolve()):
        return plain
    return {**plain, "training": {**plain["training"], "resume_from_checkpoint": "latest"}}


def superseded_note(names: list[str], folder: Path, checkpoint: Path) -> str:
    """The line a resume prints when it moved later checkpoints aside."""
    return (
        f"{', '.join(names)} (after {checkpoint.name}, from the continuation this resume replaces) moved to "
        f"{folder}/; a later --resume, export and eval of the run dir use this run's checkpoints"
    )


def world_size_refusal(checkpoint: Path, written_by: int, world_size: int) -> str:
    """Why `checkpoint` (written by `written_by` ranks) cannot resume in a world of `world_size`."""
    return (
        f"training.resume_from_checkpoint: {checkpoint.name} was written by {written_by} rank(s) but this "
        f"run has {world_size}; the data streams are sharded per rank and cannot be re-sharded "
        f"exactly. Resume with --nproc {written_by}, or start a new run from its weights "
        f"(model.name_or_path: {checkpoint / 'model'}, no resume_from_checkpoint)"
    )


def train_set_refusal(checkpoint: Path, written_with: int, num_samples: int) -> str:
    """Why `checkpoint` (written on a training set of `written_with` samples) cannot resume on one of
    `num_samples`."""
    return (
        f"training.resume_from_checkpoint: {checkpoint.name} was written on a training set of "
        f"{written_with} samples but the data (data.train_jsonl / data.synthetic) now has {num_samples}; its "
        "saved stream positions index the old set. Resume with the data it trained on, or start a new run "
        f"from its weights (model.name_or_path: {checkpoint / 'model'}, no resume_from_checkpoint)"
    )


def no_step_left(out: Path, resume: Path | str | None, max_steps: int) -> str | None:
    """Why a resume would train no step: the checkpoint it continues from is already at `max_steps` (the
    resume line saying so); None when there are steps left, or the checkpoint cannot tell (the ranks judge
    it). The launcher's refusal to start (`nothing_left_note`) and doctor's run-directory line share it."""
    checkpoint = resume_checkpoint(out, resume)
    if checkpoint is None:
        return None
    try:
        step = json.loads((checkpoint / "trainer_state.json").read_text())["global_step"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not isinstance(step, int) or step < max_steps:
        return None
    return resume_note(checkpoint, step, max_steps)


def nothing_left_note(out: Path, resume: Path | str | None, max_steps: int) -> str | None:
    """The launcher's line when the checkpoint a resume would continue from is already at `max_steps` (a
    job script that always passes --resume, run again after its run finished): no server or rank need
    start. None when there are steps left, or the checkpoint cannot tell (the ranks judge it)."""
    note = no_step_left(out, resume, max_steps)
    return None if note is None else f"{note}; nothing was started"


def resume_path_refusal(path: Path) -> str | None:
    """Why `path` (a `training.resume_from_checkpoint` other than `latest`) cannot be resumed from, or None
    when it is a complete checkpoint: missing, or without its trainer_state.json (a checkpoint's `model/`
    or a run directory named instead of a checkpoint: the line says which checkpoint was meant)."""
    if not path.exists():
        return (
            f"training.resume_from_checkpoint: {path} does not exist (give a checkpoint-N directory, or "
            "latest for the newest one in training.output_dir)"
        )
    if (path / "trainer_state.json").is_file():
        return None
    hint = ""
    newest = latest_complete_checkpoint(path)
    if path.name == "model" and (path.parent / "trainer_state.json").is_file():
        hint = f"; it is the model/ of {path.parent}: give that checkpoint directory"
    elif newest is not None:
        hint = (
            f"; it is a run directory: give its newest checkpoint {newest}, or latest with "
            f"training.output_dir: {path} (--resume)"
        )
    return (
        f"training.resume_from_checkpoint: {path} is not a complete checkpoint (no trainer_state.json){hint}"
    )


def check_resume_world_size(out: Path, resume: Path | str | None, world_size: int) -> None:
    """The launcher's early form of the ranks' resume checks (before a server or any rank starts):
    `ValueError` when a named checkpoint is missing or incomplete (`resume_path_refusal`), or when the
    checkpoint a resume would continue from was written by another number of ranks (its
    trainer_state.json says; older checkpoints are left to the ranks' check)."""
    checkpoint = resume_checkpoint(out, resume)
    if checkpoint is None:
        return
    if str(resume) != "latest":
        refused = resume_path_refusal(checkpoint)
        if refused is not None:
            raise ValueError(refused)
    try:
        state = json.loads((checkpoint / "trainer_state.json").read_text())
        written_by = state["data_state"]["world_size"]
    except (OSError, ValueError, KeyError, TypeError):
        return
    if isinstance(written_by, int) and written_by != world_size:
        raise ValueError(world_size_refusal(checkpoint, written_by, world_size))


def check_resume_train_set(out: Path, resume: Path | str | None, num_samples: int) -> None:
    """The launcher's early form of `learner.checkpoint.check_train_set`: `ValueError` when the checkpoint a
    resume would continue from was written on a training set of another size (its trainer_state.json says;
    a checkpoint that does not is left to the ranks)."""
    checkpoint = resume_checkpoint(out, resume)
    if checkpoint is None:
        return
    try:
        saved = json.loads((checkpoint / "trainer_state.json").read_text())["data_state"]["num_train_samples"]
    except (OSError, ValueError, KeyError, TypeError):
        return
    if isinstance(saved, int) and saved != num_samples:
        raise ValueError(train_set_refusal(checkpoint, saved, num_samples))


def read_yaml(path: Path) -> Any:
    """The YAML document at `path`, or None when it cannot be read or parsed."""
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


def config_change_note(out: Path, new: Mapping[str, Any], resume: Path | str | None) -> str | None:
    """The launcher's warning when the resolved config `new` differs from the one in `out/config.yaml` that
    trained the checkpoint a resume continues from, listing each changed key; None when nothing changed or
    there is nothing to resume. Nothing is written here: rank 0 keeps the old file
    (`keep_config_before_resume`) once the resume's own checks have passed."""
    changed = _changed_config(out, new, resume)
    if changed is None:
        return None
    checkpoint, changes = changed
    listed = "; ".join(f"{key}: {old!r} -> {value!r}" for key, old, value in changes)
    return (
        f"warning: the resumed config differs from the one that trained {checkpoint.name} "
        f"({len(changes)} key{'s' if len(changes) != 1 else ''}): {listed}. Once the resume starts, the steps "
        f"so far are kept with {_kept_path(out, checkpoint)} and config.yaml holds the new values"
    )


def keep_config_before_resume(out: Path, new: Mapping[str, Any], resume: Path | str | None) -> Path | None:
    """Rank 0, before a resume rewrites `out/config.yaml` with `new`: when they differ, copy it to
    `config.step-N.yaml` (N: the checkpoint resumed from; the config the steps up to N trained with, kept
    once). Returns the copy, None when nothing changed."""
    changed = _changed_config(out, new, resume)
    if changed is None:
        return None
    kept = _kept_path(out, changed[0])
    if not kept.exists():
        shutil.copy2(out / RESOLVED_CONFIG, kept)
    return kept


def _changed_config(
    out: Path, new: Mapping[str, Any], resume: Path | str | None
) -> tuple[Path, list[tuple[str, Any, Any]]] | None:
    saved = read_yaml(out / RESOLVED_CONFIG)
    checkpoint = resume_checkpoint(out, resume)
    if not isinstance(saved, dict) or checkpoint is None:
        return None
    changes = config_changes(saved, new)
    return (checkpoint, changes) if changes else None


def _kept_path(out: Path, checkpoint: Path) -> Path:
    return out / f"config.step-{checkpoint.name.removeprefix('checkpoint-')}.yaml"
