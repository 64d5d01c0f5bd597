"""Start `stagectl rollout-server` as a child process and find its address (embedded servers, tests).

The child prints `rollout-server: listening on URL` once its socket listens; a reader thread drains
the child's merged stdout/stderr (so it never blocks on a full pipe), keeps the last lines for error
messages, and hands the URL over. `stop()` sends SIGTERM (graceful) and kills after a grace period.
"""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Literal

from stagectl.wire.protocol import LISTENING_PREFIX


class ServerStartError(RuntimeError):
    """The child server exited or never printed its listening line."""


def rollout_server_argv(args: Sequence[str]) -> list[str]:
    """`python -m stagectl rollout-server ARGS...` with this interpreter."""
    return [sys.executable, "-m", "stagectl", "rollout-server", *args]


class ServerProcess:
    def __init__(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | Path | None = None,
        log_path: str | Path | None = None,
        new_session: bool = False,
    ) -> None:
        """Run `argv` (a process that prints the listening line); its output also goes to `log_path`.
        `new_session`: in a session of its own, so a terminal's Ctrl-C (SIGINT to the foreground process
        group) does not reach it; whoever started it stops it (`stop`)."""
        self.argv = list(argv)
        self.tail: collections.deque[str] = collections.deque(maxlen=40)
        self.url: str | None = None
        self._ready = threading.Event()
        self._log = open(log_path, "a", encoding="utf-8") if log_path else None  # noqa: SIM115
        self.proc = subprocess.Popen(
            self.argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            cwd=cwd,
            start_new_session=new_session,
        )
        self._reader = threading.Thread(target=self._read, name="rollout-server-output", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.tail.append(line.rstrip("\n"))
            if self._log is not None:
                self._log.write(line)
                self._log.flush()
            if self.url is None and line.startswith(LISTENING_PREFIX):
                self.url = line[len(LISTENING_PREFIX) :].strip()
                self._ready.set()
        self._ready.set()  # the child exited (or closed stdout) without listening

    def wait_listening(self, timeout_s: float = 120.0) -> str:
        """The server's base URL; `RuntimeError` with the child's last output if it never listens."""
        if not self._ready.wait(timeout_s) or self.url is None:
            self.stop()
            output = "\n".join(self.tail)
            raise ServerStartError(f"rollout-server did not start (exit code {self.proc.poll()}):\n{output}")
        return self.url

    def stop(self, grace_s: float = 40.0) -> int:
        """SIGTERM, wait up to `grace_s` (past the server's own 30 s graceful window, `serving.GRACEFUL_SHUTDOWN_S`:
        a call still decoding then gets its 503 and the engine closes, instead of a SIGKILL at 20 s), then SIGKILL; returns the exit code (-SIGTERM after a graceful
        shutdown: uvicorn re-raises the signal once in-flight requests finished and the engine closed)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(timeout=5)
        if self._log is not None:
            self._log.close()
        return int(self.proc.returncode)


def start_server_process(
    args: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | Path | None = None,
    log_path: str | Path | None = None,
    timeout_s: float = 120.0,
    new_session: bool = False,
) -> ServerProcess:
    """Start `stagectl rollout-server ARGS` and wait until it listens (`.url` holds its base URL)."""
    server = ServerProcess(
        rollout_server_argv(args), env=env, cwd=cwd, log_path=log_path, new_session=new_session
    )
    try:
        server.wait_listening(timeout_s)
    except BaseException:  # Ctrl-C while it starts: in its own session it did not get it, so stop it here
        server.stop()
        raise
    return server


# a rollout-server that was told to stop: exit 0, killed by SIGTERM/SIGINT, or exited 128 + that signal
# (a Ctrl-C that reached it before uvicorn ran, or the CLI's own exit code for a signal)
STOPPED_CODES = frozenset({0, -signal.SIGTERM, -signal.SIGINT, 128 + signal.SIGTERM, 128 + signal.SIGINT})


def keeper_action(
    code: int | None, *, num_restarts: int, max_restarts: int
) -> Literal["watch", "stopped", "spent", "restart"]:
    """What the keeper does about its server's exit `code` (None: still running): keep watching, leave a
    stopped server down, leave a crash down once the restarts are spent, or restart it."""
    if code is None:
        return "watch"
    if code in STOPPED_CODES:
        return "stopped"
    if num_restarts >= max_restarts:
        return "spent"
    return "restart"


class ServerKeeper:
    """Keeps a rollout-server child running (train-ab's embedded server): a watcher thread starts it again
    on the same port when it crashes (`keeper_action`: any exit but a stop), at most `max_restarts` times,
    each start announced on stderr. The learner sees the new process (its `instance_id`) and re-syncs it
    in full (`learner.channel_b.health`); once the restarts are spent the learner's `on_rollout_loss`
    applies. A restarted server runs in its own session when the first one did (`new_session`)."""

    def __init__(
        self,
        server: ServerProcess,
        args_for_port: Callable[[int], Sequence[str]],
        *,
        max_restarts: int,
        env: Mapping[str, str] | None = None,
        log_path: str | Path | None = None,
        timeout_s: float = 120.0,
        poll_s: float = 0.5,
        new_session: bool = False,
    ) -> None:
        assert server.url is not None, "keep a server that listens"
        self.server = server
        self.port = int(server.url.rsplit(":", 1)[1])
        self.args_for_port = args_for_port
        self.max_restarts = max_restarts
        self.env = env
        self.log_path = log_path
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self.new_session = new_session
        self.num_restarts = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="rollout-server-keeper", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            code = self.server.proc.poll()
            action = keeper_action(code, num_restarts=self.num_restarts, max_restarts=self.max_restarts)
            if action == "watch":
                continue
            if action == "stopped":
                _note(f"embedded rollout server stopped (code {code}); not restarted")
                return
            if action == "spent":
                _note(
                    f"embedded rollout server exited (code {code}); not restarted again (already restarted "
                    f"{self.num_restarts} time(s), rollout_server.embedded_max_restarts {self.max_restarts})"
                )
                return
            self.num_restarts += 1
            _note(
                f"embedded rollout server exited (code {code}); restarting it on port {self.port} "
                f"({self.num_restarts} of {self.max_restarts})"
            )
            self.server.stop()  # reaps it and closes its log
            try:
                self.server = start_server_process(
                    self.args_for_port(self.port),
                    env=self.env,
                    log_path=self.log_path,
                    timeout_s=self.timeout_s,
                    new_session=self.new_session,
                )
            except (
                ServerStartError
            ) as exc:  # counted as a restart; the next poll sees it gone and tries again
                _note(f"embedded rollout server restart failed: {exc}")

    def stop(self) -> int:
        """Stop watching, then stop the server; its exit code."""
        self._stop.set()
        self._thread.join()
        return self.server.stop()


def _note(message: str) -> None:
    print(f"train-ab: {message}", file=sys.stderr, flush=True)
