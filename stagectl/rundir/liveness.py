"""Whether the train-ab run in a directory is still going: `running.json`, written by global rank 0 when its
run starts and removed however the run ends in that process (finished, stopped, failed). One left behind
names a process that was killed without a word (SIGKILL, the out-of-memory killer, a preempted job) or
is still running: its pid, host and start time tell which, so `stagectl report` need not say "did not
finish (or is still running)", and a second train-ab in the same directory (a job requeued while the
first still runs) is refused instead of writing over it. Pure path logic, no torch.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from stagectl.files import atomic_write_text

RUNNING = "running.json"
SETTLE_S = 3.0  # how long a refusal gives a process that was just killed to go (`still_running`)


def _started(pid: int) -> int | None:
    """The start time of process `pid` (clock ticks after boot, /proc/PID/stat field 22): with the pid it
    names one process even after the pid is reused. None where /proc cannot tell (gone, a zombie: killed
    and not yet reaped, not Linux)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def mark_running(out: Path) -> None:
    """Rank 0, once its run has started in `out`: record this process."""
    pid = os.getpid()
    state = {"pid": pid, "host": socket.gethostname(), "started": _started(pid)}
    atomic_write_text(out / RUNNING, json.dumps(state) + "\n")


def clear_running(out: Path) -> None:
    """Rank 0, however its run ended in this process. Best effort: a directory that turned read-only (the
    error being reported) keeps the file, which then names a process that is gone."""
    with contextlib.suppress(OSError):
        (out / RUNNING).unlink(missing_ok=True)


@dataclass(frozen=True)
class RunningProcess:
    """The process `running.json` names. `alive`: None when it ran on another host (this one cannot tell)."""

    pid: int
    host: str
    alive: bool | None

    def short(self) -> str:
        """For a one-line summary of the run: `running (pid 7 on h1)`, `killed`, `maybe running on h2`."""
        if self.alive is None:
            return f"maybe running on {self.host} (pid {self.pid})"
        return f"running (pid {self.pid} on {self.host})" if self.alive else "killed (its process is gone)"

    def describe(self) -> str:
        where = f"pid {self.pid} on {self.host}"
        if self.alive is None:
            return f"its process ({where}) may still be running: this host cannot tell"
        if self.alive:
            return f"still running ({where})"
        return (
            f"its process ({where}) is gone without recording how the run ended: killed (SIGKILL, the "
            "out-of-memory killer, a preempted job)"
        )


def still_running(out: Path, settle_s: float | None = None) -> RunningProcess | None:
    """The process `running.json` names if it is alive on this host, after giving one that was just killed
    up to `settle_s` to go (a job requeued right after its predecessor was SIGKILLed); None otherwise, and
    for this process (a run of its own, in process, has ended: it is asking)."""
    deadline = time.monotonic() + (SETTLE_S if settle_s is None else settle_s)
    while (proc := running_process(out)) is not None and proc.alive and proc.pid != os.getpid():
        if time.monotonic() >= deadline:
            return proc
        time.sleep(0.1)
    return None


def running_process(out: Path) -> RunningProcess | None:
    """The process that `out/running.json` names (None: no file, or one that cannot be read)."""
    try:
        state = json.loads((out / RUNNING).read_text())
        pid, host = int(state["pid"]), str(state["host"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if host != socket.gethostname():
        return RunningProcess(pid, host, None)
    started = _started(pid)
    recorded = state.get("started")
    return RunningProcess(pid, host, started is not None and (recorded is None or started == recorded))
