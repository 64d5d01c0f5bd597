"""How much room a checkpoint takes and had: the bytes a checkpoint tree holds, the free space where it is
written, and the reason a failed write gives when the disk was full (`learner.checkpoint.save_checkpoint`
says it with the newest intact checkpoint)."""

from __future__ import annotations

import errno
import shutil
from pathlib import Path


def disk_full_reason(
    exc: BaseException,
    *,
    free_bytes: int | None,
    needed_bytes: int | None,
    written_bytes: int,
    total_limit: int | None = None,
) -> str | None:
    """ "no space left on device: ..." when a checkpoint write failed for lack of space, else None: the
    error says so (ENOSPC, EDQUOT), or (torch's writer reports a full disk as `unexpected pos`) the free
    space was below what the rest of the checkpoint needed. `needed_bytes`: the size of a whole checkpoint
    (the newest intact one), None if unknown; `written_bytes`: what the failed write had written;
    `total_limit`: `training.save_total_limit` (at 1 there is none lower to suggest)."""
    says_full = isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)
    short = free_bytes is not None and needed_bytes is not None and free_bytes < needed_bytes - written_bytes
    if not (says_full or short):
        return None
    free = "unknown" if free_bytes is None else f"{free_bytes:,} bytes"
    needs = (
        f"about {needed_bytes:,} bytes" if needed_bytes is not None else f"more than {written_bytes:,} bytes"
    )
    return (
        f"no space left on device: {free} free when the write failed, a checkpoint needs {needs} "
        f"({written_bytes:,} written); "
        + (
            "free space or point training.output_dir at a larger disk (training.save_total_limit is 1: the "
            "newest checkpoint is kept until the next one is whole)"
            if total_limit == 1
            else "free space or set training.save_total_limit lower"
        )
    )


def tree_bytes(path: Path) -> int:
    """Bytes of the files under `path` (0 if it is gone)."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else 0


def free_bytes(path: Path) -> int | None:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None
