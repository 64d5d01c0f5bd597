"""Resource checks: free disk for the checkpoints the run keeps (`resources.disk`) and the per-rank GPU
memory estimate against the card (`resources.gpu`, where CUDA is present; `stagectl.memory`). Both read
the memory model's `TrainingKnobs` (which carry the world size), resolved from the config by the caller."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from stagectl.config.model_data import ModelConfig
from stagectl.config.training import TrainingConfig
from stagectl.doctor.report import Check, fail, ok, skip, warn
from stagectl.memory.estimate import DTYPE_BYTES, GIB, TrainingKnobs, estimate_memory, trainable_params
from stagectl.memory.from_config import model_shape
from stagectl.memory.shapes import ModelShape

GPU_WARN_FRACTION = 0.9  # an estimate above this share of the card is a warning (fragmentation, kernels)


@dataclass(frozen=True)
class CheckpointSize:
    model_bytes: int  # model/ in the storage dtype
    train_state_bytes: int  # AdamW moments and float32 masters (when model/ is stored in another dtype)

    @property
    def total(self) -> int:
        return self.model_bytes + self.train_state_bytes


def checkpoint_size(shape: ModelShape, knobs: TrainingKnobs) -> CheckpointSize:
    """Bytes of one `checkpoint-N/` (see `stagectl.learner.checkpoint` for the layout)."""
    total, trainable = shape.counts.total, trainable_params(shape, knobs)
    storage = DTYPE_BYTES[knobs.torch_dtype]  # model.torch_dtype
    masters = total * 4 if knobs.param_bytes == 4 and storage != 4 else 0
    return CheckpointSize(
        model_bytes=total * storage, train_state_bytes=2 * trainable * knobs.param_bytes + masters
    )


def num_checkpoints_on_disk(t: TrainingConfig) -> int:
    """The most checkpoints the run holds at once: `save_total_limit` plus the one being written before the
    oldest is removed, or every checkpoint it writes (`TrainingConfig.saves_checkpoint`, the learner's rule)."""
    written = sum(1 for step in range(1, t.max_steps + 1) if t.saves_checkpoint(step))
    if t.save_total_limit is None:
        return written
    return min(written, t.save_total_limit + 1)


def free_bytes(path: Path) -> tuple[Path, int]:
    """Free bytes on the filesystem that would hold `path` (its nearest existing ancestor)."""
    probe = path.absolute()
    while not probe.exists():
        probe = probe.parent
    return probe, shutil.disk_usage(probe).free


def check_disk(training: TrainingConfig, shape: ModelShape, knobs: TrainingKnobs) -> Check:
    name = "resources.disk"
    size = checkpoint_size(shape, knobs)
    count = num_checkpoints_on_disk(training)
    needed = count * size.total
    where, free = free_bytes(training.output_dir)
    what = (
        f"{count} checkpoint(s) of {_size(size.total)} (model/ {_size(size.model_bytes)}, optimizer and "
        f"masters {_size(size.train_state_bytes)}) need {_size(needed)}; {_size(free)} free at {where}"
    )
    if not os.access(where, os.W_OK):
        return fail(
            name,
            f"{where} is not writable (training.output_dir {training.output_dir})",
            "point training.output_dir at a writable directory",
        )
    if needed > free:
        limit = training.save_total_limit
        fix = (
            "free space or point training.output_dir at a larger disk (training.save_total_limit is 1: the "
            "newest checkpoint is kept until the next one is whole)"
            if limit == 1
            else f"free space, point training.output_dir at a larger disk, or set training.save_total_limit "
            f"(now {limit}) lower"
        )
        return fail(name, what, fix)
    return ok(name, what)


def disk_warning(model: ModelConfig, training: TrainingConfig, knobs: TrainingKnobs) -> str | None:
    """train-ab's pre-flight: `check_disk`'s finding when the checkpoints the run keeps will not fit (None
    when they fit, or the model's shape cannot be read: `stagectl doctor` says why)."""
    try:
        shape = model_shape(model.name_or_path)
    except ValueError:
        return None
    check = check_disk(training, shape, knobs)
    return None if check.status == "ok" else f"{check.message} (fix: {check.fix})"


def _size(num_bytes: int) -> str:
    return f"{num_bytes / GIB:.1f} GiB" if num_bytes >= GIB else f"{num_bytes / 2**20:.1f} MiB"


def check_gpu(nproc_per_node: int, shape: ModelShape, knobs: TrainingKnobs) -> list[Check]:
    """The per-rank estimate against the first visible card; `nproc_per_node`: `launch.nproc_per_node`."""
    import torch

    name = "resources.gpu"
    if not torch.cuda.is_available():
        return [skip(name, "no CUDA device here: the per-rank memory estimate needs one to compare with")]
    checks = []
    nproc, visible = nproc_per_node, torch.cuda.device_count()
    if nproc > visible:
        checks.append(
            fail(
                "resources.gpus",
                f"launch.nproc_per_node is {nproc} but this node has {visible} visible CUDA device(s)",
                f"set launch.nproc_per_node (or --nproc) to at most {visible}, or check CUDA_VISIBLE_DEVICES",
            )
        )
    estimate = estimate_memory(shape, knobs)
    card = torch.cuda.get_device_properties(0).total_memory
    what = (
        f"estimated peak {estimate.total / GIB:.1f} GiB per rank ({knobs.parallelism}, world size {knobs.world_size}, "
        f"mixed_precision {knobs.mixed_precision}) of {card / GIB:.1f} GiB on {torch.cuda.get_device_name(0)}"
    )
    relief = (
        "training.parallelism: fsdp, training.gradient_checkpointing: true, model.freeze_vit: true, "
        "or a smaller global_max_length (docs/memory.md)"
    )
    if estimate.total > card:
        checks.append(fail(name, what, relief))
    elif estimate.total > GPU_WARN_FRACTION * card:
        checks.append(warn(name, what + f" (> {GPU_WARN_FRACTION:.0%})", relief))
    else:
        checks.append(ok(name, what))
    return checks


def check_resources(
    model: ModelConfig, training: TrainingConfig, nproc_per_node: int, knobs: TrainingKnobs
) -> list[Check]:
    """Every resource line; the model's shape comes from its config.json and safetensors headers."""
    try:
        shape = model_shape(model.name_or_path)
    except ValueError as exc:
        return [skip("resources", f"model shape unknown ({exc}); see model.load")]
    return [check_disk(training, shape, knobs), *check_gpu(nproc_per_node, shape, knobs)]
