"""`samples.jsonl`: one line per trained sample, appended per step; a resume drops the lines of steps at or
after the checkpoint's step and nothing else; a torn last line is skipped; Channel-A positions of a
buffer saved without them are recovered from the stream."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stagectl.data.sampler import ShardedSampler
from stagectl.learner.channel_a import recover_positions
from stagectl.learner.samples import SamplesWriter, read_samples


def _write_steps(out: Path, steps: range, resume_step: int | None = None) -> None:
    writer = SamplesWriter(out, resume_step=resume_step)
    for step in steps:
        writer.write(step, [[("A", step, step, None, None)], [("B", 10 + step, step, step - 1, step)]])
    writer.close()


def test_lines_name_step_channel_rank_sample_position_and_b_versions(tmp_path: Path) -> None:
    _write_steps(tmp_path, range(2))
    rows = read_samples(tmp_path / "samples.jsonl")
    assert rows[:2] == [
        {"step": 0, "channel": "A", "rank": 0, "sample": 0, "stream_pos": 0},
        {
            "step": 0,
            "channel": "B",
            "rank": 1,
            "sample": 10,
            "stream_pos": 0,
            "gen_version": -1,
            "train_version": 0,
        },
    ]
    assert len(rows) == 4


def test_resume_drops_steps_from_the_checkpoint_on_and_appends(tmp_path: Path) -> None:
    _write_steps(tmp_path, range(6))
    with (tmp_path / "samples.jsonl").open("a") as handle:
        handle.write('{"step": 6, "chan')  # torn by a SIGKILL
    _write_steps(tmp_path, range(4, 8), resume_step=4)
    rows = read_samples(tmp_path / "samples.jsonl")
    assert [r["step"] for r in rows] == [s for s in range(8) for _ in (0, 1)]


def test_a_run_without_resume_never_truncates(tmp_path: Path) -> None:
    _write_steps(tmp_path, range(3))
    _write_steps(tmp_path, range(3, 5))
    assert [r["step"] for r in read_samples(tmp_path / "samples.jsonl")] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]


def test_a_bad_line_in_the_middle_is_named(tmp_path: Path) -> None:
    path = tmp_path / "samples.jsonl"
    path.write_text(json.dumps({"step": 0}) + "\n{oops\n" + json.dumps({"step": 1}) + "\n")
    with pytest.raises(ValueError, match=r"samples.jsonl:2: not JSON .*column 2"):
        read_samples(path)


def test_buffer_positions_saved_without_them_are_recovered_from_the_stream() -> None:
    sampler = ShardedSampler(7, rank=1, world_size=2, seed=3, stream="A")
    drawn = [(next(sampler), pos) for pos in range(9)]  # crosses an epoch boundary (3 per epoch)
    buffered = [drawn[k] for k in (2, 5, 6, 8)]  # what a packing buffer might still hold, oldest first
    assert recover_positions(sampler, [index for index, _ in buffered]) == [pos for _, pos in buffered]
