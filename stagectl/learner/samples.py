"""The per-sample audit trail: `{output_dir}/samples.jsonl`, one line per trained sample.

A line: `step` (optimizer step), `channel` (`A` or `B`), `rank`, `sample` (index in the data set),
`stream_pos` (its position in that rank's stream of that channel, from 0 across epochs: never reused),
and for Channel-B `gen_version` (the policy version whose weights generated the rollout) and
`train_version` (the version being trained when it was). Versions are the weight-sync version in async
mode and the number of optimizer updates in step mode (the rollouts come from the weights being trained).

Every rank records its own samples during the step (`StepAccumulator.samples`); at the step boundary rank
0 gathers them (one gather, inside the metrics phase) and, once the step's eval is done and its metrics row
written, appends the step's lines, flushed, in rank order. On resume the lines of steps at or after the
checkpoint's step are dropped (they are about to be trained again); otherwise the file is only ever
appended to.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

SAMPLES_FILE = "samples.jsonl"

# (channel, sample, stream_pos, gen_version, train_version); the versions are None for Channel-A
SampleRecord = tuple[str, int, int, int | None, int | None]


class SamplesWriter:
    """Rank 0's appender of `samples.jsonl`."""

    def __init__(self, output_dir: Path, *, resume_step: int | None) -> None:
        self.path = output_dir / SAMPLES_FILE
        output_dir.mkdir(parents=True, exist_ok=True)
        if resume_step is not None and self.path.exists():
            drop_from_step(self.path, resume_step)
        self._handle = self.path.open("a", encoding="utf-8")

    def write(self, step: int, per_rank: Sequence[Sequence[SampleRecord]]) -> None:
        lines = []
        for rank, records in enumerate(per_rank):
            for channel, sample, stream_pos, gen_ver, train_ver in records:
                line: dict[str, Any] = {
                    "step": step,
                    "channel": channel,
                    "rank": rank,
                    "sample": sample,
                    "stream_pos": stream_pos,
                }
                if channel == "B":
                    line["gen_version"] = gen_ver
                    line["train_version"] = train_ver
                lines.append(json.dumps(line, separators=(",", ":")) + "\n")
        self._handle.write("".join(lines))
        self._handle.flush()

    def close(self) -> None:
        self._handle.close()


def drop_from_step(path: Path, step: int) -> None:
    """Drop the lines of steps >= `step` (and a torn last line from a crash); rewritten through a
    temp file and a rename, so a crash here leaves the old file whole. Untouched when nothing goes."""
    text = path.read_text(encoding="utf-8")
    kept = []
    for line in text.splitlines():
        try:
            if json.loads(line)["step"] < step:
                kept.append(line)
        except (json.JSONDecodeError, KeyError, TypeError):
            continue
    new_text = "".join(f"{line}\n" for line in kept)
    if new_text == text:
        return
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(new_text, encoding="utf-8")
    os.replace(tmp, path)


def read_samples(path: Path) -> list[dict[str, Any]]:
    """Every line of a `samples.jsonl` (a torn last line from a crash is skipped)."""
    rows = []
    lines = path.read_text(encoding="utf-8").splitlines()
    for number, line in enumerate(lines, 1):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as exc:
            if number == len(lines):
                break
            raise ValueError(f"{path}:{number}: not JSON ({exc.msg}, column {exc.colno})") from None
    return rows
