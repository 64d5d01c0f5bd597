"""Running the real CLI under fault injection (`inject/sitecustomize.py`) and checking what is left.

`FaultRun` starts `python -m stagectl ...` in its own session with output in a log file (never a pipe
that could fill up), the injection hook on `PYTHONPATH` and a per-run record directory in which every
Python process of the run (CLI, torchrun agent, ranks, rollout server) writes its pid. `leftovers()`
lists those still alive (pid *and* start time match, zombies count as gone); leaving the `with` block
kills exactly those, by pid, so a failing test never leaves processes behind.

`STAGECTL_FAULT_REPORT=FILE` makes each fault test append one JSON line of figures (what was injected,
whether the run survived or failed cleanly, exit latency, data lost) for SECURITY.md's table.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.integration.helpers import ROOT

INJECT_DIR = Path(__file__).parent / "inject"
REPORT_ENV = "STAGECTL_FAULT_REPORT"


@dataclass
class FaultRun:
    proc: subprocess.Popen[bytes]
    record_dir: Path
    log_path: Path
    started: float

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for(self, condition: Callable[[], bool], timeout_s: float, what: str) -> None:
        """Poll `condition` until true; fails with the run's output tail if the run ends or time is up."""
        deadline = time.monotonic() + timeout_s
        while not condition():
            if self.proc.poll() is not None:
                raise AssertionError(f"run ended (exit {self.proc.returncode}) before {what}:\n{self.tail()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no {what} within {timeout_s:g} s:\n{self.tail()}")
            time.sleep(0.1)

    def finish(self, timeout_s: float) -> int:
        """Wait for the CLI to exit; returns its exit code."""
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"run still going after {timeout_s:g} s:\n{self.tail()}") from None

    def tail(self, num_chars: int = 4000) -> str:
        return self.output()[-num_chars:]

    def fault_times(self) -> list[float]:
        return [entry["time"] for entry in _entries(self.record_dir, "fault")]

    def leftovers(self) -> list[dict[str, Any]]:
        return leftovers_in(self.record_dir)

    def wait_no_leftovers(self, timeout_s: float) -> list[dict[str, Any]]:
        """Processes of this run still alive after `timeout_s` (empty when all are gone)."""
        deadline = time.monotonic() + timeout_s
        while (left := self.leftovers()) and time.monotonic() < deadline:
            time.sleep(0.1)
        return left

    def num_processes(self) -> int:
        return len(_entries(self.record_dir, "pid"))


@contextmanager
def fault_run(
    args: Sequence[str],
    tmp_path: Path,
    *,
    fault: str | None = None,
    env: dict[str, str] | None = None,
    name: str = "run",
) -> Iterator[FaultRun]:
    """Start `python -m stagectl ARGS` with the injection hook; kill whatever of it is left at the end."""
    record_dir = tmp_path / f"{name}-processes"
    record_dir.mkdir()
    log_path = tmp_path / f"{name}.log"
    python_path = os.pathsep.join(p for p in (str(INJECT_DIR), os.environ.get("PYTHONPATH", "")) if p)
    full_env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": python_path,
        "STAGECTL_FAULT_DIR": str(record_dir),
        **(env or {}),
    }
    full_env.pop("WORLD_SIZE", None)
    if fault is not None:
        full_env["STAGECTL_FAULT"] = fault
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "stagectl", *args],
            cwd=ROOT,
            env=full_env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    run = FaultRun(proc, record_dir, log_path, time.monotonic())
    try:
        yield run
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for entry in run.leftovers():
            os.kill(entry["pid"], signal.SIGKILL)


def leftovers_in(record_dir: Path) -> list[dict[str, Any]]:
    """The processes recorded in `record_dir` that are still alive."""
    return [entry for entry in _entries(record_dir, "pid") if _alive(entry)]


def _entries(record_dir: Path, kind: str) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(record_dir.glob(f"{kind}-*.json"))]


def _alive(entry: dict[str, Any]) -> bool:
    """Is the recorded process still running (same pid and start time, not a zombie)?"""
    try:
        stat = Path(f"/proc/{entry['pid']}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    fields = stat.rsplit(")", 1)[1].split()
    return fields[0] != "Z" and int(fields[19]) == entry["start_ticks"]


def report(**figures: Any) -> None:
    """Append one line of figures to `$STAGECTL_FAULT_REPORT` (no-op when unset)."""
    path = os.environ.get(REPORT_ENV)
    if path:
        with open(path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(figures) + "\n")
