"""`stagectl rollout-server --access-log`: the per-request JSON lines go to a file, to stderr with `-`, or
nowhere (the default), checked on the real app (uvicorn on 127.0.0.1 in a thread, the fake engine)."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from stagectl.engines.fake import FakeEngine, default_weights
from stagectl.server.app import ACCESS_LOGGER, build_app
from stagectl.server.service import RolloutService, ServerSettings
from stagectl.server.serving import ThreadedServer, configure_access_log


def _eventually(read_more: Callable[[], str], count: int) -> str:
    """The access line is written just after the response went out: collect what `read_more` returns
    (briefly) until there are `count` lines."""
    deadline = time.monotonic() + 5.0
    text = read_more()
    while len(text.splitlines()) < count and time.monotonic() < deadline:
        time.sleep(0.02)
        text += read_more()
    return text


def _new_text(path: Path) -> Callable[[], str]:
    seen = 0

    def read_more() -> str:
        nonlocal seen
        text = path.read_text() if path.exists() else ""
        new, seen = text[seen:], len(text)
        return new

    return read_more


@pytest.fixture
def served() -> Iterator[str]:
    access = logging.getLogger(ACCESS_LOGGER)
    saved = (list(access.handlers), access.propagate, access.level)
    server = ThreadedServer(
        build_app(RolloutService(FakeEngine(default_weights(num_mib=1)), ServerSettings()))
    )
    server.start()
    yield server.url
    server.stop()
    for handler in list(access.handlers):  # leave the logger as other tests expect it (caplog)
        access.removeHandler(handler)
        handler.close()
    access.handlers[:], access.propagate, access.level = saved[0], saved[1], saved[2]


def test_a_file_gets_one_json_line_per_request(served: str, tmp_path: Path) -> None:
    log = tmp_path / "logs" / "access.jsonl"
    configure_access_log(str(log))
    assert httpx.get(f"{served}/health/").status_code == 200
    assert httpx.get(f"{served}/nowhere/").status_code == 404
    lines = [json.loads(line) for line in _eventually(_new_text(log), 2).splitlines()]
    assert [(e["event"], e["path"], e["status"]) for e in lines] == [
        ("access", "/health/", 200),
        ("access", "/nowhere/", 404),
    ]


def test_dash_is_stderr(served: str, capfd: pytest.CaptureFixture[str]) -> None:
    configure_access_log("-")
    httpx.get(f"{served}/health/")
    err = _eventually(lambda: capfd.readouterr().err, 1)
    assert json.loads(err.strip().splitlines()[-1])["path"] == "/health/"


def test_off_by_default(
    served: str, capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    configure_access_log(None)
    with caplog.at_level(logging.INFO):
        httpx.get(f"{served}/health/")
        time.sleep(0.5)  # the line would be written just after the response
    assert '"event": "access"' not in capfd.readouterr().err
    assert not [r for r in caplog.records if r.name == ACCESS_LOGGER]


def test_a_path_that_cannot_be_opened_is_a_clear_error(tmp_path: Path) -> None:
    access = logging.getLogger(ACCESS_LOGGER)
    saved = (list(access.handlers), access.propagate, access.level)
    try:
        with pytest.raises(ValueError, match=r"--access-log .*: cannot open it for appending"):
            configure_access_log(str(tmp_path))  # a directory
    finally:
        access.handlers[:], access.propagate, access.level = saved[0], saved[1], saved[2]
