"""A checkpoint that cannot be written for lack of space says so ("no space left on device", the free and
the needed bytes), whether the OS says ENOSPC or torch's writer says `unexpected pos`; the previous
checkpoint stays intact and the partial one is removed."""

from __future__ import annotations

import errno
from collections import namedtuple
from pathlib import Path
from typing import Any

import pytest
import torch

from stagectl.config.training import TrainingConfig
from stagectl.learner import checkpoint as ckpt
from stagectl.learner.checkpoint_space import disk_full_reason, tree_bytes
from stagectl.learner.optim import build_optimizer

Usage = namedtuple("Usage", "total used free")


class TinySaver(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(64, 64)

    def save_pretrained(self, path: Path, safe_serialization: bool = True) -> None:
        path.mkdir(parents=True, exist_ok=True)
        torch.save(self.state_dict(), path / "weights.pt")


def _save(out: Path, step: int) -> Path:
    model = TinySaver()
    optimizer, scheduler = build_optimizer(model, TrainingConfig(max_steps=10))
    return ckpt.save_checkpoint(
        out,
        step,
        model=model,
        save_tokenizer=lambda path: (path / "tok.json").write_text("{}"),
        optimizer=optimizer,
        scheduler=scheduler,
        rng_states=[ckpt.rng_state()],
        trainer_state=ckpt.TrainerState(step, {"a_consumed": step}, {"num_updates": step}),
    )


def test_a_full_disk_under_torch_save_is_named_with_free_and_needed_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = _save(tmp_path, 2)
    size = tree_bytes(first)
    real_save = torch.save

    def full_disk_save(obj: Any, path: Any, *args: Any, **kwargs: Any) -> None:
        if Path(path).name == "optimizer.pt":  # what torch says when the disk fills mid-write
            raise RuntimeError(
                "[enforce fail at inline_container.cc:672] . unexpected pos 7078656 vs 7078544"
            )
        real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(torch, "save", full_disk_save)
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda path: Usage(10**9, 10**9 - 100, 100))
    with pytest.raises(ckpt.CheckpointWriteError) as caught:
        _save(tmp_path, 4)
    message = str(caught.value)
    assert "cannot write checkpoint-4" in message and "no space left on device: 100 bytes free" in message
    assert f"a checkpoint needs about {size:,} bytes" in message
    assert "unexpected pos" in message and f"the newest intact checkpoint is {first}" in message
    assert ckpt.list_checkpoints(tmp_path) == [first] and not list(tmp_path.glob(".tmp-checkpoint-*"))


def test_reason_from_the_error_or_the_free_space() -> None:
    enospc = OSError(errno.ENOSPC, "No space left on device")
    said = disk_full_reason(enospc, free_bytes=0, needed_bytes=None, written_bytes=4096)
    assert said is not None and "more than 4,096 bytes" in said
    assert said.endswith("free space or set training.save_total_limit lower")
    # at save_total_limit 1 there is no lower limit to suggest
    one = disk_full_reason(enospc, free_bytes=0, needed_bytes=None, written_bytes=4096, total_limit=1)
    assert one is not None and "save_total_limit lower" not in one
    assert one.endswith(
        "larger disk (training.save_total_limit is 1: the newest checkpoint is kept until the next one is whole)"
    )
    other = RuntimeError("unexpected pos")
    assert disk_full_reason(other, free_bytes=10**12, needed_bytes=10**6, written_bytes=0) is None
    assert disk_full_reason(other, free_bytes=None, needed_bytes=10**6, written_bytes=0) is None
    read_only = OSError(errno.EROFS, "Read-only file system")
    assert disk_full_reason(read_only, free_bytes=10**12, needed_bytes=10, written_bytes=0) is None
