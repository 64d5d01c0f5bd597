"""The version a resumed async run pushes its checkpoint's weights as."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from stagectl.learner.channel_b.build import resume_version


@pytest.mark.parametrize(
    ("extra", "server_ver", "expected"),
    [
        ({"ver": 4, "ver_is_weights": True}, 0, 4),  # a fresh server: the weights keep their version
        ({"ver": 4, "ver_is_weights": False}, 0, 5),  # trained past version 4: a new version
        ({"ver": 4, "ver_is_weights": True}, 4, 5),  # a server already at 4 would refuse 4 again
        ({"ver": 4, "ver_is_weights": True}, 6, 7),  # a server past it (a later sync landed): above both
        ({"ver": 4}, 0, 5),  # written before `ver_is_weights`: never assumed
        ({}, 2, 3),  # no version saved: the next above the servers'
    ],
)
def test_resume_version(extra: dict, server_ver: int, expected: int) -> None:
    assert resume_version(extra, server_ver) == expected


def test_the_resume_line_names_the_saved_packs_versions_not_the_current_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two packs of version 5 saved, the run resumed at version 6: the line said '(version 6)' of them."""
    from stagectl.learner import checkpoint as ckpt
    from stagectl.learner.channel_b.build import restore_async

    saved = {"packs": [{"ver": 5}, {"ver": 5}], "stream_pos": 82}
    torch.save([saved], tmp_path / ckpt.ASYNC_STATE)
    restored: list[dict] = []
    async_b = SimpleNamespace(ver=6, restore=restored.append)
    restore_async(async_b, SimpleNamespace(resumed_from=tmp_path, world=SimpleNamespace(rank=0)))  # type: ignore[arg-type]
    assert restored == [saved]
    line = capsys.readouterr().err
    assert f"resumed the async state of {tmp_path.name}: 2 queued pack(s) of version 5 on rank 0, " in line
    assert "policy version 6 now, B stream from position 82" in line
