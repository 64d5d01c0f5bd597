"""A train-ab run directory as a run leaves it, for the `stagectl.rundir` tests."""

from __future__ import annotations

import json
from pathlib import Path


def finished_run(out: Path, num_rows: int = 3, checkpoints: tuple[int, ...] = (2,)) -> None:
    out.mkdir(parents=True)
    (out / "config.yaml").write_text("training: {}\n")
    (out / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(num_rows)))
    for step in checkpoints:
        (out / f"checkpoint-{step}").mkdir()
        (out / f"checkpoint-{step}" / "trainer_state.json").write_text("{}")
    last = max(checkpoints, default=0)
    end = {"global_step": last, "max_steps": last, "stopped_by_signal": None}
    (out / "final_state.json").write_text(json.dumps(end))


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}
