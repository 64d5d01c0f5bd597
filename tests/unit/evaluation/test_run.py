"""`stagectl.evaluation.run.EvalProgress` in a job's log (no terminal): a line at most every
`log_every_s` with the time left, and always one for the last chunk; nothing on the other ranks."""

from __future__ import annotations

import pytest

import stagectl.evaluation.run as run
from stagectl.evaluation.run import EvalProgress


def test_a_log_gets_a_line_every_interval_and_the_last_chunk(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    clock = [100.0]
    monkeypatch.setattr(run.time, "perf_counter", lambda: clock[0])
    progress = EvalProgress(80, enabled=True, log_every_s=10.0)
    for _ in range(10):  # a chunk of 8 images every 4 s
        clock[0] += 4.0
        progress.advance(8)
    progress.close()
    lines = capsys.readouterr().err.splitlines()
    # 12 s, 24 s, 36 s since the last line, then the last chunk at 40 s
    assert lines == [
        "eval: 24/80 images, 2.00 images/s, 28 s left",
        "eval: 48/80 images, 2.00 images/s, 16 s left",
        "eval: 72/80 images, 2.00 images/s, 4 s left",
        "eval: 80/80 images, 2.00 images/s",
    ]
    quiet = EvalProgress(80, enabled=False)
    quiet.advance(80)
    assert capsys.readouterr().err == "" and quiet.done == 80


def test_with_several_ranks_the_line_says_it_counts_rank_0s_share(capsys: pytest.CaptureFixture[str]) -> None:
    """`eval: 16/16 images` of a 32-image eval on two ranks read as a miscount next to `images=32 (of 32)`."""
    progress = EvalProgress(16, enabled=True, num_ranks=2, num_images=32)
    progress.advance(16)
    progress.close()
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("eval: 16/16 images (rank 0's share of 32 on 2 ranks), ")
