"""Where the learner's step time goes: wall seconds of each phase on the learner's own thread, summed over
one optimizer step and logged as `time/<phase>_s` (their sum never exceeds `time/step_s`; the rest is
bookkeeping: schedule broadcast, metrics reductions, evaluation).

- `wait_packs`: waiting for Channel-B work: step mode, the rollouts (generation on the learner or a
  server); async, the prefetcher status and the feasibility gate.
- `collate`: turning rollouts into micro-batches on the learner's thread (parse, match, targets, encode,
  pack, collate). In async mode the prefetcher thread does this (`time/prefetch_build_s` and
  `time/prefetch_collate_s`: its seconds in the step, on whatever core it runs).
- `forward_backward`: forward and backward passes (host-to-device copy included).
- `optimizer`: clipping, the optimizer and scheduler step.
- `fence`: async weight sync, waiting for the rollout calls in flight to finish.
- `weight_sync`: pushing the weights to the servers (after the fence closed).

Beside the phases, CPU seconds of the step: `time/learner_thread_cpu_s` (the learner's own thread) and
`time/other_threads_cpu_s` (every other thread of the process: the prefetcher, its HTTP calls, the weight
push's sender threads). With the learner pinned to its own cores, the second comes out of the first's.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

PHASES = ("wait_packs", "collate", "forward_backward", "optimizer", "fence", "weight_sync")


def phase_key(phase: str) -> str:
    return f"time/{phase}_s"


class PhaseTimer:
    """Seconds per phase of the current step (`reset` at the step's start, `row` at its end)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Start a step (on the learner's thread: its CPU clock is the one read)."""
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self._cpu_at_reset = (time.process_time(), time.thread_time())

    def add(self, phase: str, seconds: float) -> None:
        assert phase in self.seconds, phase
        self.seconds[phase] += seconds

    @contextmanager
    def time(self, phase: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.add(phase, time.perf_counter() - started)

    def row(self) -> dict[str, float]:
        """The step's phase seconds and CPU seconds (call on the learner's thread, at the step's end)."""
        process_cpu = time.process_time() - self._cpu_at_reset[0]
        thread_cpu = time.thread_time() - self._cpu_at_reset[1]
        return {
            **{phase_key(phase): seconds for phase, seconds in self.seconds.items()},
            "time/learner_thread_cpu_s": thread_cpu,
            "time/other_threads_cpu_s": max(0.0, process_cpu - thread_cpu),
        }
