"""What RUN_DIR holds: a train-ab output dir, a Stage-B mission dir, or a parent of mission dirs.

A Stage-B mission dir is recognised by `selections.jsonl` (the Stage-B runner creates all its
artifacts at start); a train-ab dir by `metrics.jsonl` without it; a `stagectl eval` output dir by
`metrics.json` next to `predictions.coco.json`. Parents are searched two levels
deep, so both `{output.root}/{run_name}` and `{output.root}` work.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

RunKind = Literal["train_ab", "stage_b", "eval"]

METRICS = "metrics.jsonl"
STAGE_B_MARKER = "selections.jsonl"
EVAL_METRICS = "metrics.json"  # with predictions.coco.json: a `stagectl eval` output dir
EVAL_MARKER = "predictions.coco.json"


@dataclass(frozen=True)
class Run:
    kind: RunKind
    path: Path


def is_stage_b_mission(path: Path) -> bool:
    return (path / STAGE_B_MARKER).is_file()


def find_runs(run_dir: Path) -> list[Run]:
    """The runs to report under `run_dir`; ValueError when there is nothing to report on."""
    if not run_dir.exists():
        raise ValueError(f"run directory not found: {run_dir}")
    if not run_dir.is_dir():
        raise ValueError(f"not a directory: {run_dir}")
    if is_stage_b_mission(run_dir):
        return [Run("stage_b", run_dir)]
    if (run_dir / METRICS).is_file():
        return [Run("train_ab", run_dir)]
    if (run_dir / EVAL_METRICS).is_file() and (run_dir / EVAL_MARKER).is_file():
        return [Run("eval", run_dir)]
    if not (run_dir / EVAL_METRICS).is_file() and (run_dir / EVAL_MARKER).is_file():
        raise ValueError(
            f"{run_dir} holds {EVAL_MARKER} but no {EVAL_METRICS}: a `stagectl eval` interrupted while writing "
            "its results (metrics.json is written last); run the eval again with --overwrite"
        )
    missions = sorted(
        {
            p.parent
            for pattern in (f"*/{STAGE_B_MARKER}", f"*/*/{STAGE_B_MARKER}")
            for p in run_dir.glob(pattern)
        }
    )
    if missions:
        return [Run("stage_b", m) for m in missions]
    raise ValueError(
        f"no {METRICS} in {run_dir}: expected a train-ab output_dir, a Stage-B mission dir, a `stagectl eval` dir "
        f"(or a parent of mission dirs)"
    )
