"""`stopping.StopSignals`: the first SIGTERM/SIGINT sets the flag a loop reads, a second interrupts."""

from __future__ import annotations

import signal

import pytest

from stagectl.stopping import StopSignals, exit_code, noticed, stop_requested


def test_stop_signals_set_a_flag_then_interrupt() -> None:
    # whatever the process had (a shell's background job starts with SIGINT ignored, not Python's handler)
    before = signal.getsignal(signal.SIGINT)
    stop = StopSignals()
    with stop:
        assert signal.getsignal(signal.SIGINT) == stop._on_signal
        signal.raise_signal(signal.SIGTERM)
        assert stop.signum == signal.SIGTERM and stop.requested
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
        assert (stop.signum, stop.aborted_by) == (signal.SIGTERM, signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) == before  # restored


def test_exit_code_is_what_a_shell_reports() -> None:
    assert exit_code(signal.SIGINT) == 130 and exit_code(signal.SIGTERM) == 143


def test_a_process_that_ends_after_a_stop_ignores_further_signals() -> None:
    stop = StopSignals(ignore_after_stop=True)
    try:
        with stop:
            signal.raise_signal(signal.SIGTERM)
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
        signal.raise_signal(signal.SIGINT)  # ignored: no KeyboardInterrupt
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    with StopSignals(ignore_after_stop=True):
        pass  # no signal came: the previous handlers come back
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_stop_requested_is_true_inside_a_signalled_block_only() -> None:
    """`stop_requested` lets a wait deep inside a step see the loop's signal (no flag to thread through)."""
    assert not stop_requested()
    with StopSignals():
        with StopSignals():
            assert not stop_requested()
            signal.raise_signal(signal.SIGTERM)
            assert stop_requested()
        assert not stop_requested()  # the signalled block has ended
    assert not stop_requested()


def test_the_first_signal_says_what_the_stop_waits_for_once(capfd: pytest.CaptureFixture[str]) -> None:
    """A stop waits for a safe point (a B step's rollout call may take minutes): the first signal says so at
    once, in the process the user started, and a second one adds no line."""
    received: list[int] = []
    on_signal = noticed(received, "x: stopping after the current step (Ctrl-C again: stop now)")
    on_signal(signal.SIGINT)
    on_signal(signal.SIGINT)
    assert received == [signal.SIGINT, signal.SIGINT]
    assert capfd.readouterr().err == "x: stopping after the current step (Ctrl-C again: stop now)\n"

    with StopSignals(notice="y: stopping after the batch") as stop:
        signal.raise_signal(signal.SIGTERM)
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
    assert stop.aborted_by == signal.SIGINT
    assert capfd.readouterr().err == "y: stopping after the batch\n"
    with StopSignals():  # a rank: no notice
        signal.raise_signal(signal.SIGTERM)
    assert capfd.readouterr().err == ""
