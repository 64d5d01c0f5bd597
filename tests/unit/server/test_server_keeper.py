"""`ServerKeeper` (train-ab's embedded server): a server that was stopped (exit 0, SIGTERM, SIGINT, or
128 + either) is not started again; a crash is, until the restarts are spent. The restart itself
runs end to end in tests/faults/test_rollout_loss.py (the embedded server SIGKILLed)."""

from __future__ import annotations

import os
import sys
import time

import pytest

from stagectl.server.launcher import ServerKeeper, ServerProcess, keeper_action
from stagectl.wire.protocol import LISTENING_PREFIX


def _child(exit_code: int) -> ServerProcess:
    """A stand-in child that 'listens', then exits with `exit_code` (negative: killed by that signal)."""
    # SIGINT's and SIGTERM's default actions restored first: a test runner's worker may start children with
    # SIGINT ignored (pytest-xdist's do), and an ignored SIGINT would let the child exit 0
    reset = "signal.signal(signal.SIGINT, signal.SIG_DFL); signal.signal(signal.SIGTERM, signal.SIG_DFL)"
    end = f"{reset}; os.kill(os.getpid(), {-exit_code})" if exit_code < 0 else f"sys.exit({exit_code})"
    code = f"import os, signal, sys, time; print('{LISTENING_PREFIX}http://127.0.0.1:5', flush=True); time.sleep(0.2); {end}"
    server = ServerProcess([sys.executable, "-c", code])
    server.wait_listening(30)
    return server


def _keep(server: ServerProcess, max_restarts: int) -> ServerKeeper:
    def no_start(port: int) -> list[str]:
        raise AssertionError(f"restarted on port {port}")

    return ServerKeeper(server, no_start, max_restarts=max_restarts, poll_s=0.05)


@pytest.mark.parametrize(
    ("code", "num_restarts", "action"),
    [
        (None, 0, "watch"),
        (0, 0, "stopped"),
        (-15, 0, "stopped"),
        (-2, 0, "stopped"),
        (130, 0, "stopped"),  # the server CLI's exit for a SIGINT that came before uvicorn ran
        (143, 3, "stopped"),
        (1, 0, "restart"),
        (-9, 2, "restart"),
        (-9, 3, "spent"),
        (-6, 3, "spent"),
    ],
)
def test_keeper_action(code: int | None, num_restarts: int, action: str) -> None:
    assert keeper_action(code, num_restarts=num_restarts, max_restarts=3) == action


def test_an_embedded_server_runs_in_a_session_of_its_own() -> None:
    """A terminal's Ctrl-C (SIGINT to the foreground process group) does not reach it: the learners
    finish their step against a live server and the launcher stops it last."""
    code = f"import time; print('{LISTENING_PREFIX}http://127.0.0.1:5', flush=True); time.sleep(30)"
    own = ServerProcess([sys.executable, "-c", code], new_session=True)
    shared = ServerProcess([sys.executable, "-c", code])
    try:
        own.wait_listening(30)
        shared.wait_listening(30)
        assert os.getsid(own.proc.pid) == own.proc.pid != os.getsid(0)
        assert os.getpgid(shared.proc.pid) == os.getpgid(0)
    finally:
        own.stop()
        shared.stop()


@pytest.mark.parametrize("exit_code", [0, -15, -2])  # 128 + either: keeper_action
def test_a_stopped_server_is_not_restarted(exit_code: int, capsys: pytest.CaptureFixture[str]) -> None:
    keeper = _keep(_child(exit_code), max_restarts=3)
    deadline = time.monotonic() + 10
    while "not restarted" not in capsys.readouterr().err:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert keeper.num_restarts == 0
    assert keeper.stop() == exit_code


def test_a_crash_past_the_restarts_is_left_down(capsys: pytest.CaptureFixture[str]) -> None:
    keeper = _keep(_child(-9), max_restarts=0)
    deadline = time.monotonic() + 10
    err = ""
    while "not restarted again" not in err:
        assert time.monotonic() < deadline
        time.sleep(0.05)
        err += capsys.readouterr().err
    assert "embedded rollout server exited (code -9)" in err and keeper.num_restarts == 0
    keeper.stop()


def test_a_ctrl_c_while_the_server_starts_stops_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """In its own session the child does not get the terminal's Ctrl-C: the starter stops it."""
    import stagectl.server.launcher as launcher

    started: list[ServerProcess] = []

    def interrupted(self: ServerProcess, timeout_s: float = 120.0) -> str:
        started.append(self)
        raise KeyboardInterrupt

    monkeypatch.setattr(
        launcher, "rollout_server_argv", lambda args: [sys.executable, "-c", "import time; time.sleep(60)"]
    )
    monkeypatch.setattr(ServerProcess, "wait_listening", interrupted)
    with pytest.raises(KeyboardInterrupt):
        launcher.start_server_process([], new_session=True)
    (server,) = started
    assert server.proc.poll() is not None  # stopped, not left running until the launcher exits
