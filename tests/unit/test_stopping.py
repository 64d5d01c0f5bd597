"""`stopping.StopSignals`: the first SIGTERM/SIGINT sets the flag a loop reads, a second interrupts."""

from __future__ import annotations

import signal

import pytest

from stagectl.stopping import StopSignals, exit_code


def test_stop_signals_set_a_flag_then_interrupt() -> None:
    stop = StopSignals()
    with stop:
        assert signal.getsignal(signal.SIGINT) == stop._on_signal
        signal.raise_signal(signal.SIGTERM)
        assert stop.signum == signal.SIGTERM and stop.requested
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
        assert (stop.signum, stop.aborted_by) == (signal.SIGTERM, signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored


def test_exit_code_is_what_a_shell_reports() -> None:
    assert exit_code(signal.SIGINT) == 130 and exit_code(signal.SIGTERM) == 143
