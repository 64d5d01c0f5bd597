"""The version a resumed async run pushes its checkpoint's weights as."""

from __future__ import annotations

import pytest

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
