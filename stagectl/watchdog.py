"""The rank watchdog: a deadline on every collective phase of a multi-rank run.

The main thread names the phase it is in (`with watchdog.phase("feasibility gate", "step_s")`) and
`stagectl.dist` names the collective inside it. A daemon thread checks the current phase against its
deadline (a field of `launch.watchdog`, counted from when the phase became current). When a deadline
passes, the rank writes one line naming the phase, the collective and the config key, then every
thread's Python stack, tells its launcher (SIGUSR1 to `STAGECTL_LAUNCHER_PID`, which then ends the
other ranks of the node) and exits with `WATCHDOG_EXIT_CODE` at once: the main thread is stuck in
native code, so neither exceptions nor interpreter teardown could end it.

The same thread ends the rank when the process that started it is gone (torchrun or the stagectl
launcher was killed): nothing else would stop a rank blocked in a collective then.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal, TextIO

from stagectl.config.training import WatchdogConfig

WATCHDOG_EXIT_CODE = 70  # a rank ended by its watchdog (the launcher reports it by this code)
ORPHAN_EXIT_CODE = 71  # a rank whose launcher is gone
LAUNCHER_PID_ENV = "STAGECTL_LAUNCHER_PID"

Budget = Literal["startup_s", "step_s", "weight_sync_s", "checkpoint_s", "eval_s", "shutdown_s"]


@dataclass
class _Phase:
    name: str
    budget: Budget
    deadline_s: float
    started: float  # time.monotonic() when it became the current phase
    collective: str | None = None


class Watchdog:
    def __init__(
        self,
        cfg: WatchdogConfig,
        *,
        rank: int,
        world_size: int,
        tick_s: float = 0.25,
        stream: TextIO | None = None,
    ) -> None:
        self.cfg = cfg
        self.rank = rank
        self.world_size = world_size
        self.tick_s = tick_s
        self.stream = stream or sys.stderr
        self._stack: list[_Phase] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._parent_pid = os.getppid()
        self._launcher_pid = _int_env(LAUNCHER_PID_ENV)
        self._thread = threading.Thread(target=self._run, name=f"watchdog-rank{rank}", daemon=True)

    # ------------------------------------------------------------------ main thread

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join()

    @contextmanager
    def phase(self, name: str, budget: Budget) -> Iterator[None]:
        """Run the body as phase `name` with the deadline `launch.watchdog.<budget>`; the enclosing
        phase, if any, becomes current again (with a fresh deadline) when the body ends."""
        entry = _Phase(name, budget, float(getattr(self.cfg, budget)), time.monotonic())
        with self._lock:
            self._stack.append(entry)
        try:
            yield
        finally:
            with self._lock:
                self._stack.remove(entry)
                if self._stack:
                    self._stack[-1].started = time.monotonic()

    @contextmanager
    def collective(self, name: str) -> Iterator[None]:
        """Mark the collective the current phase is blocked in (named when the deadline passes)."""
        with self._lock:
            current = self._stack[-1] if self._stack else None
            previous = current.collective if current else None
            if current is not None:
                current.collective = name
        try:
            yield
        finally:
            if current is not None:
                with self._lock:
                    current.collective = previous

    def describe(self) -> str:
        """`phase 'gate' (collective all_reduce(min))`, or `no phase` — for error messages."""
        with self._lock:
            current = self._stack[-1] if self._stack else None
        if current is None:
            return "no phase"
        inside = f", collective {current.collective}" if current.collective else ""
        return f"phase '{current.name}'{inside}"

    # ------------------------------------------------------------------ watchdog thread

    def _run(self) -> None:
        while not self._stop.wait(self.tick_s):
            with self._lock:
                current = self._stack[-1] if self._stack else None
                overdue = current is not None and time.monotonic() - current.started > current.deadline_s
            if overdue and current is not None:
                self._fire(current)
            gone = self._gone_parent()
            if gone:
                self._write(f"{self._who()}: {gone}; stopping this rank ({self.describe()})")
                os._exit(ORPHAN_EXIT_CODE)

    def _gone_parent(self) -> str | None:
        if os.getppid() != self._parent_pid:
            return f"its parent process (pid {self._parent_pid}, torchrun) is gone"
        if self._launcher_pid is not None and not pid_alive(self._launcher_pid):
            return f"the stagectl launcher (pid {self._launcher_pid}) is gone"
        return None

    def _fire(self, phase: _Phase) -> None:
        inside = f", blocked in collective {phase.collective}" if phase.collective else ""
        self._write(
            f"{self._who()}: watchdog: phase '{phase.name}' did not finish within "
            f"{phase.deadline_s:g} s (launch.watchdog.{phase.budget}){inside}; "
            "this rank's stacks follow, then it exits"
        )
        with contextlib.suppress(OSError, ValueError):  # stderr closed: the line above is all we can say
            faulthandler.dump_traceback(file=self.stream, all_threads=True)
        if self._launcher_pid is not None:
            with contextlib.suppress(OSError):
                os.kill(self._launcher_pid, signal.SIGUSR1)  # the launcher ends the other ranks
        os._exit(WATCHDOG_EXIT_CODE)

    def _who(self) -> str:
        return f"stagectl: rank {self.rank}/{self.world_size} (pid {os.getpid()})"

    def _write(self, line: str) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.stream.write(line + "\n")
            self.stream.flush()


def _int_env(name: str) -> int | None:
    value = os.environ.get(name, "")
    return int(value) if value.isdigit() else None


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists on this host (one of another user counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
