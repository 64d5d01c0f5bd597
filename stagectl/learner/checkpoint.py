"""Checkpoints: written whole or not at all (temp dir + rename), loaded back for an exact resume.

Layout of `{output_dir}/checkpoint-{step}/`:
  model/              Hugging Face format: `from_pretrained` and `vllm serve` load it as they load the
                      base checkpoint (same weight names; the tokenizer has the 1000 coordinate tokens
                      and `vocab_size` covers them), tokenizer + chat template + image processor; in
                      the storage dtype (`model.torch_dtype`), consolidated on rank 0 under fsdp
  optimizer.pt        AdamW state (ddp)      scheduler.pt   LR scheduler state
  master_weights.safetensors   float32 master weights (ddp, when `model/` is stored in another dtype)
  train_state/        fsdp: master weights and AdamW state, sharded (torch.distributed.checkpoint; every
                      rank writes its shards, so multi-node runs need `output_dir` on a shared filesystem)
  rng.pt              torch/python/numpy RNG state of every rank (index = rank)
  async_state.pt      async Channel-B runs: every rank's async state (index = rank; plain data): its queued
                      packs (version, pack stats, each rollout's sample, B-stream position and token ids),
                      the leftovers carried to the next burst, the B-stream position after the last
                      finished burst, the pacing estimate and the counters (see `learner.channel_b.prefetcher`)
  trainer_state.json  global_step, every rank's data stream positions (`data_state.ranks[r]`),
                      the world size that wrote it, the training set's size (`num_train_samples`),
                      policy version, counters
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel

from stagectl import dist
from stagectl.files import follow_umask
from stagectl.learner.checkpoint_space import disk_full_reason, free_bytes, tree_bytes
from stagectl.learner.optim import apply_schedule
from stagectl.models.loading import DamagedWeightsError
from stagectl.models.quiet import hf_progress_bars_off
from stagectl.rundir.resume import resume_path_refusal, train_set_refusal, world_size_refusal

CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
TRAINER_STATE = "trainer_state.json"
ASYNC_STATE = "async_state.pt"
MASTER_WEIGHTS = "master_weights.safetensors"
SHARDED_STATE = "train_state"


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (disk full, read-only directory, ...); the previous
    checkpoints are untouched and the partial one is removed."""


@dataclass
class TrainerState:
    global_step: int
    data_state: dict[str, Any]
    extra: dict[str, Any]


def rng_state() -> dict[str, Any]:
    return {
        "torch": torch.get_rng_state(),
        "python": _jsonable(random.getstate()),
        "numpy": _jsonable(np.random.get_state()),
    }


def restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))


def _jsonable(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, tuple | list):
        return [_jsonable(v) for v in value]
    return value


def shards_staging_dir(output_dir: Path, step: int) -> Path:
    """Rank 0: an empty directory the ranks write `train_state` shards into before the checkpoint is
    assembled (stale ones of an interrupted save are removed first)."""
    output_dir.mkdir(parents=True, exist_ok=True)
    for stale in output_dir.glob(".tmp-shards-*"):
        shutil.rmtree(stale, ignore_errors=True)
    path = output_dir / f".tmp-shards-{step}-{os.getpid()}"
    path.mkdir()
    return path


def save_checkpoint(
    output_dir: Path,
    step: int,
    *,
    model: Any,
    save_tokenizer: Any,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Any,
    rng_states: list[dict[str, Any]],
    trainer_state: TrainerState,
    total_limit: int | None = None,
    model_state: dict[str, torch.Tensor] | None = None,
    master_state: dict[str, torch.Tensor] | None = None,
    sharded_dir: Path | None = None,
    async_states: list[dict[str, Any]] | None = None,
) -> Path:
    """Write `checkpoint-{step}` atomically: everything goes to a temp dir that is renamed at the end,
    so a crash leaves either the whole checkpoint or none (plus a `.tmp-*` dir that the next save removes).
    A checkpoint being replaced or pruned is renamed away before it is deleted, so a crash never leaves
    a half-deleted `checkpoint-*` that looks complete. A write error (disk full, read-only directory)
    raises `CheckpointWriteError` naming the newest intact checkpoint.

    `model_state` (the full state dict in the storage dtype) is what `model/` holds when given (fsdp, or
    a storage dtype other than the parameters'); `master_state` is written as `master_weights.safetensors`;
    `sharded_dir` (the ranks' `train_state` shards) is moved in, and then `optimizer` is None;
    `async_states` (one per rank) is written as `async_state.pt`."""
    final = output_dir / f"checkpoint-{step}"
    tmp = output_dir / f".tmp-checkpoint-{step}-{os.getpid()}"
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        for stale in output_dir.glob(".tmp-checkpoint-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
        save_inference_model(model, tmp / "model", state_dict=model_state)
        save_tokenizer(tmp / "model")
        if master_state is not None:
            save_file(master_state, str(tmp / MASTER_WEIGHTS))
        if sharded_dir is not None:
            os.replace(sharded_dir, tmp / SHARDED_STATE)
        if async_states is not None:
            torch.save(async_states, tmp / ASYNC_STATE)
        if optimizer is not None:
            torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
        torch.save(rng_states, tmp / "rng.pt")
        state = {
            "global_step": trainer_state.global_step,
            "data_state": trainer_state.data_state,
            "extra": trainer_state.extra,
        }
        (tmp / TRAINER_STATE).write_text(json.dumps(state, indent=2))
        _fsync_tree(tmp)
        if final.exists():
            os.replace(final, output_dir / f".tmp-checkpoint-{step}-replaced-{os.getpid()}")
        os.replace(tmp, final)
        _fsync_dir(output_dir)
    except (OSError, SafetensorError, RuntimeError) as exc:  # torch.save reports I/O errors as RuntimeError
        written = tree_bytes(tmp)
        free = free_bytes(output_dir)  # as the write failed, before the partial one is removed
        shutil.rmtree(tmp, ignore_errors=True)
        if sharded_dir is not None:
            shutil.rmtree(sharded_dir, ignore_errors=True)
        intact = list_checkpoints(output_dir)
        kept = f"the newest intact checkpoint is {intact[-1]}" if intact else "no earlier checkpoint exists"
        reason = (exc.strerror or str(exc)) if isinstance(exc, OSError) else str(exc)
        needed = tree_bytes(intact[-1]) if intact else None  # checkpoints of one run have one size
        full = disk_full_reason(
            exc, free_bytes=free, needed_bytes=needed, written_bytes=written, total_limit=total_limit
        )
        if full is not None:
            reason = f"{full} ({reason})"
        raise CheckpointWriteError(
            f"cannot write checkpoint-{step} in {output_dir}: {reason}; {kept}"
        ) from exc
    if total_limit is not None:
        for old in list_checkpoints(output_dir)[:-total_limit]:
            doomed = output_dir / f".tmp-checkpoint-pruned-{old.name}"
            os.replace(old, doomed)
            shutil.rmtree(doomed, ignore_errors=True)
    for replaced in output_dir.glob(f".tmp-checkpoint-{step}-replaced-*"):
        shutil.rmtree(replaced, ignore_errors=True)
    return final


def save_inference_model(model: Any, path: Path, state_dict: dict[str, torch.Tensor] | None = None) -> None:
    """`save_pretrained` with the config a user generates with: the learner trains with `use_cache`
    off (packed forwards), but the saved `config.json` keeps the KV cache on, as published checkpoints
    do (the learner turns it off again when it resumes from this checkpoint). `state_dict` (full tensors,
    e.g. gathered from FSDP shards or converted to the storage dtype) replaces the model's own, and
    `config.json` names its dtype."""
    if not isinstance(model, PreTrainedModel):  # a stand-in that only knows save_pretrained
        model.save_pretrained(path, safe_serialization=True)
        return
    use_cache = model.config.use_cache
    model.config.use_cache = True
    try:
        with hf_progress_bars_off():
            model.save_pretrained(path, safe_serialization=True, state_dict=state_dict)
    finally:
        model.config.use_cache = use_cache
    follow_umask(path)  # save_pretrained leaves model.safetensors 0600; vLLM may run as another user
    if state_dict:
        # save_pretrained names the parameters' dtype (float32 masters); the file holds state_dict's
        _set_config_dtype(
            path / "config.json", str(next(iter(state_dict.values())).dtype).removeprefix("torch.")
        )


def _set_config_dtype(config_file: Path, dtype: str) -> None:
    config = json.loads(config_file.read_text())
    for section in [config, *(v for v in config.values() if isinstance(v, dict) and "dtype" in v)]:
        if "dtype" in section:
            section["dtype"] = dtype
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def list_checkpoints(output_dir: Path) -> list[Path]:
    """Complete checkpoints in `output_dir`, oldest first."""
    if not output_dir.is_dir():
        return []
    found = []
    for child in output_dir.iterdir():
        match = CHECKPOINT_RE.match(child.name)
        if match and (child / TRAINER_STATE).is_file():
            found.append((int(match.group(1)), child))
    return [path for _, path in sorted(found)]


def resolve_resume(resume: Path | str | None, output_dir: Path) -> Path | None:
    """`latest` -> newest checkpoint in `output_dir` (None when there is none); a path -> checked dir."""
    if resume is None:
        return None
    if str(resume) == "latest":
        found = list_checkpoints(output_dir)
        return found[-1] if found else None
    path = Path(resume)
    refused = resume_path_refusal(path)  # the launcher refuses it before a server or any rank starts
    if refused is not None:
        raise FileNotFoundError(refused)
    return path


def load_trainer_state(path: Path) -> TrainerState:
    raw = json.loads((path / TRAINER_STATE).read_text())
    return TrainerState(global_step=int(raw["global_step"]), data_state=raw["data_state"], extra=raw["extra"])


def check_world_size(path: Path, world_size: int) -> None:
    """A checkpoint resumes only in the world size that wrote it: the data streams are sharded per
    rank and each rank's stream position and RNG state are its own."""
    state = load_trainer_state(path)
    saved = state.data_state.get("world_size")
    num_rng = len(load_rng_states(path))
    written_by = int(saved) if saved is not None else num_rng
    if written_by != world_size:
        raise ValueError(world_size_refusal(path, written_by, world_size))


def check_train_set(path: Path, num_samples: int) -> None:
    """A checkpoint resumes only on a training set of the size it was written with: its stream positions
    and the samplers' permutations index that set (a shrunk set would fail on a missing index, a grown
    one would silently draw another order). Checkpoints written before the size was recorded pass."""
    saved = load_trainer_state(path).data_state.get("num_train_samples")
    if isinstance(saved, int) and saved != num_samples:
        raise ValueError(train_set_refusal(path, saved, num_samples))


# what reading a damaged or cut-off checkpoint file raises (torch's zip reader, safetensors, json, the disk)
DAMAGED = (
    RuntimeError,
    OSError,
    EOFError,
    SafetensorError,
    json.JSONDecodeError,
    DamagedWeightsError,
)


@contextlib.contextmanager
def reading(path: Path | None, what: str) -> Iterator[None]:
    """Load `what` of checkpoint `path` (None: not a checkpoint, nothing changes): a file that cannot be read
    is one `ValueError` naming the checkpoint, the part and the earlier checkpoint to resume from instead
    (it was the loader's traceback)."""
    if path is None:
        yield
        return
    try:
        yield
    except DAMAGED as exc:
        if isinstance(exc, dist.CollectiveError):  # a collective's failure, not the file's
            raise
        detail = str(exc).splitlines()[0].split(". ")[0][:200] if str(exc) else ""  # its first sentence
        older = [p for p in list_checkpoints(path.parent) if _step_of(p) < _step_of(path)]
        way = (
            f"resume from an earlier one (--set training.resume_from_checkpoint={older[-1]}) or move "
            f"{path.name} aside"
            if older
            else f"move {path.name} aside to start again"
        )
        raise ValueError(
            f"training.resume_from_checkpoint: {path}: its {what} cannot be loaded ({type(exc).__name__}: "
            f"{detail}); the checkpoint is damaged or incomplete: {way}"
        ) from None


def _step_of(path: Path) -> int:
    match = CHECKPOINT_RE.match(path.name)
    return int(match.group(1)) if match else -1


def load_rank_state(path: Path, rank: int) -> dict[str, Any]:
    """Rank `rank`'s saved stream positions (checkpoints written before per-rank state: rank 0's)."""
    data = load_trainer_state(path).data_state
    if "ranks" in data:
        return dict(data["ranks"][rank])
    return {"a_consumed": data["a_consumed"], "b_consumed": data["b_consumed"]}


def load_async_state(path: Path, rank: int) -> dict[str, Any] | None:
    """Rank `rank`'s async state, or None for a checkpoint without one (a step-mode run, or one written
    before async state was saved)."""
    file = path / ASYNC_STATE
    if not file.is_file():
        return None
    states = torch.load(file, weights_only=True)
    if not isinstance(states, list) or len(states) <= rank or not isinstance(states[rank], dict):
        raise ValueError(f"training.resume_from_checkpoint: {file} holds no async state for rank {rank}")
    return dict(states[rank])


def load_master_weights(path: Path, model: torch.nn.Module) -> None:
    """Overwrite the weights loaded from `model/` (storage dtype) with the float32 masters, when the
    checkpoint has them (ddp; fsdp's come with `train_state`)."""
    master = path / MASTER_WEIGHTS
    if master.is_file():
        model.load_state_dict(load_file(str(master)), strict=True)


OPTIMIZER_KNOBS = ("weight_decay", "betas", "eps")  # AdamW settings a resume takes from its own config


def load_optimizer_state(
    path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any
) -> None:
    """AdamW (and, from `train_state`, the master weights) and the scheduler of checkpoint `path`.
    Every rank calls it (loading `train_state` is a collective)."""
    from stagectl.learner import sharding

    # the resumed config's AdamW settings hold from here on, as config.yaml says (loading the state
    # restores the checkpoint's param groups, whose weight_decay / betas / eps are its config's)
    configured = [
        {key: group[key] for key in OPTIMIZER_KNOBS if key in group} for group in optimizer.param_groups
    ]
    if (path / SHARDED_STATE).is_dir():
        sharding.load_sharded_state(model, optimizer, str(path / SHARDED_STATE))
    elif sharding.is_sharded(model):
        raise ValueError(
            f"training.resume_from_checkpoint: {path.name} was written with training.parallelism: ddp "
            "(no train_state/); resume it with parallelism: ddp, or start a new fsdp run from its weights "
            f"(model.name_or_path: {path / 'model'})"
        )
    else:
        optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True))
    for group, knobs in zip(optimizer.param_groups, configured, strict=True):
        group.update(knobs)
    # `LambdaLR.load_state_dict` restores the checkpoint's `base_lrs` (its config's learning_rate); the
    # resumed config's learning_rate is the peak from here on (config.yaml says so), as its lambdas are
    base_lrs = list(scheduler.base_lrs)
    scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
    scheduler.base_lrs = base_lrs
    apply_schedule(optimizer, scheduler)  # the resumed config's lr for the next step, not the saved one


def load_rng_states(path: Path) -> list[dict[str, Any]]:
    return list(torch.load(path / "rng.pt", weights_only=True))


def _fsync_tree(root: Path) -> None:
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            with open(os.path.join(dirpath, name), "rb") as handle:
                os.fsync(handle.fileno())
        _fsync_dir(Path(dirpath))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
