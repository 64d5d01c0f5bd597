"""The rank watchdog: phases, deadlines, what it prints, how it exits (in child processes, because a
watchdog that fires ends its process)."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import textwrap
import time

from stagectl.config.training import WatchdogConfig
from stagectl.watchdog import LAUNCHER_PID_ENV, ORPHAN_EXIT_CODE, WATCHDOG_EXIT_CODE, Watchdog


def _run_child(code: str, env: dict[str, str] | None = None, timeout: float = 30) -> tuple[int, str, float]:
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )
    return proc.returncode, proc.stderr, time.monotonic() - started


STUCK_IN_PHASE = """
    import time
    from stagectl.config.training import WatchdogConfig
    from stagectl.watchdog import Watchdog

    def blocked_in_collective():
        time.sleep(60)

    dog = Watchdog(WatchdogConfig(step_s=1.0), rank=1, world_size=2, tick_s=0.05)
    dog.start()
    with dog.phase("feasibility gate", "step_s"), dog.collective("all_reduce(min)"):
        blocked_in_collective()
"""


def test_a_phase_past_its_deadline_names_phase_collective_key_and_stack_then_exits() -> None:
    code, stderr, seconds = _run_child(STUCK_IN_PHASE)
    assert code == WATCHDOG_EXIT_CODE
    assert seconds < 15  # 1 s deadline, plus interpreter start-up
    first = next(line for line in stderr.splitlines() if "watchdog" in line)
    assert "rank 1/2" in first
    assert "phase 'feasibility gate'" in first
    assert "launch.watchdog.step_s" in first
    assert "blocked in collective all_reduce(min)" in first
    assert "blocked_in_collective" in stderr  # the Python stack of the stuck main thread


def test_the_watchdog_tells_the_launcher_before_it_exits() -> None:
    """SIGUSR1 to STAGECTL_LAUNCHER_PID is how the launcher learns to end the other ranks."""
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import signal, sys, time\n"
            "signal.signal(signal.SIGUSR1, lambda *a: (print('got SIGUSR1', flush=True), sys.exit(0)))\n"
            "print('ready', flush=True)\n"
            "time.sleep(60)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert launcher.stdout is not None and launcher.stdout.readline().strip() == "ready"
        code, _, _ = _run_child(STUCK_IN_PHASE, env={LAUNCHER_PID_ENV: str(launcher.pid)})
        assert code == WATCHDOG_EXIT_CODE
        out, _ = launcher.communicate(timeout=10)
        assert "got SIGUSR1" in out
    finally:
        launcher.kill()


def test_a_rank_whose_launcher_is_gone_stops_itself() -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    code, stderr, seconds = _run_child(
        """
        import time
        from stagectl.config.training import WatchdogConfig
        from stagectl.watchdog import Watchdog

        Watchdog(WatchdogConfig(), rank=0, world_size=2, tick_s=0.05).start()
        time.sleep(60)
        """,
        env={LAUNCHER_PID_ENV: str(gone.pid)},
    )
    assert code == ORPHAN_EXIT_CODE
    assert f"the stagectl launcher (pid {gone.pid}) is gone" in stderr
    assert seconds < 15


def test_phases_nest_and_the_enclosing_one_comes_back_with_a_fresh_deadline() -> None:
    dog = Watchdog(WatchdogConfig(step_s=5.0, checkpoint_s=9.0), rank=0, world_size=2, stream=io.StringIO())
    assert dog.describe() == "no phase"
    with dog.phase("train step", "step_s"):
        with dog.phase("checkpoint", "checkpoint_s"), dog.collective("barrier"):
            assert dog.describe() == "phase 'checkpoint', collective barrier"
        assert dog.describe() == "phase 'train step'"
        current = dog._stack[-1]
        assert current.deadline_s == 5.0
        assert time.monotonic() - current.started < 1.0  # restarted when the inner phase ended
    assert dog.describe() == "no phase"


def test_a_phase_that_ends_in_time_never_fires() -> None:
    code, stderr, _ = _run_child(
        """
        import time
        from stagectl.config.training import WatchdogConfig
        from stagectl.watchdog import Watchdog

        dog = Watchdog(WatchdogConfig(step_s=0.5), rank=0, world_size=2, tick_s=0.05)
        dog.start()
        for _ in range(6):  # 6 x 0.3 s: each phase ends before its own deadline
            with dog.phase("forward/backward", "step_s"):
                time.sleep(0.3)
        dog.stop()
        print("finished")
        """
    )
    assert code == 0, stderr
    assert "watchdog" not in stderr
