"""A stop asked for by a signal: SIGTERM or SIGINT (Ctrl-C) sets a flag that a loop reads at its next safe
point (after a step or a global batch, where it saves and ends); a second signal stops at once
(`KeyboardInterrupt`). Import-light (no torch): the loops broadcast the flag themselves.

    stop = StopSignals()
    with stop:                      # installs the handlers, restores the previous ones on exit
        for ...:
            if agreed(stop.requested): break
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Any

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_active: list[StopSignals] = []  # the `with StopSignals()` blocks this process is in, innermost last


def stop_requested() -> bool:
    """A stop signal came to a block this process is in: for a wait deep inside a loop's step (a B step
    waiting for a rollout server) that must end so the loop reaches its safe point and stops."""
    return any(stop.requested for stop in _active)


def say_now(line: str) -> None:
    """`line` on stderr from inside a signal handler (`os.write`: a buffered stream the interrupted code may
    be writing to would raise a reentrant-call error)."""
    os.write(2, f"{line}\n".encode())


def noticed(received: list[int], notice: str) -> Callable[[int], None]:
    """A launcher's `on_signal`: each signal is added to `received`; the first also prints `notice` (what
    the stop waits for, and that a second signal stops at once), so the wait for a safe point, up to a
    rollout call's timeout, is not silence."""

    def on_signal(signum: int) -> None:
        received.append(signum)
        if len(received) == 1:
            say_now(notice)

    return on_signal


class StopSignals:
    """`ignore_after_stop`: once a signal came, leaving the block ignores further ones instead of restoring
    the previous handlers (for a process that ends right after: a Ctrl-C during its exit, torch's and
    gloo's clean-up, would otherwise end it by SIGINT with a traceback, and torchrun would call it failed).
    `notice`: printed at the first signal (by the process the user started, not by every rank)."""

    def __init__(self, *, ignore_after_stop: bool = False, notice: str | None = None) -> None:
        self.ignore_after_stop = ignore_after_stop
        self.notice = notice
        self.signum: int | None = None  # the first signal received
        self.aborted_by: int | None = None  # a second one (the loop was interrupted where it stood)
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def __enter__(self) -> StopSignals:
        self._previous = {sig: signal.signal(sig, self._on_signal) for sig in STOP_SIGNALS}
        _active.append(self)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self in _active:
            _active.remove(self)
        stopped = self.ignore_after_stop and self.signum is not None
        for sig, handler in self._previous.items():
            signal.signal(sig, signal.SIG_IGN if stopped else handler)
        self._previous = {}

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None:
            self.aborted_by = signum
            raise KeyboardInterrupt  # second signal: stop now
        self.signum = signum
        if self.notice is not None:
            say_now(self.notice)


def exit_code(signum: int) -> int:
    """What a shell reports for a process a signal stopped: 128 + the signal number (130 for Ctrl-C)."""
    return 128 + signum
