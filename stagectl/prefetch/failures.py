"""When the prefetcher retries and when it gives up: a small pure class over the clock it is given.

Server trouble (connection, timeout, 5xx: *transient*) is retried with exponential back-off, 0.25 s doubling
up to 5 s, so the learner keeps training Channel-A while the server is away, until the outage has lasted
`outage_timeout_s`. Any other failure is retried at once until `max_consecutive_failures` in a row. A burst
that succeeds ends both runs.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class FailurePolicy:
    max_consecutive_failures: int
    outage_timeout_s: float
    num_consecutive: int = 0
    outage_since: float | None = None  # when the current run of transient failures began (monotonic)

    def succeeded(self) -> None:
        self.num_consecutive = 0
        self.outage_since = None

    def failed(self, now: float, *, transient: bool) -> float | str:
        """Count a failure at `now`: the seconds to back off before the next burst, or why to give up."""
        self.num_consecutive += 1
        if transient:
            self.outage_since = self.outage_since if self.outage_since is not None else now
            if now - self.outage_since > self.outage_timeout_s:
                return (
                    f"rollout servers unreachable for {now - self.outage_since:.0f} s "
                    f"(> vllm.server.timeout_s {self.outage_timeout_s:g})"
                )
            return min(5.0, 0.25 * 2 ** min(self.num_consecutive, 5))
        if self.num_consecutive >= self.max_consecutive_failures:
            return f"{self.num_consecutive} failures in a row"
        return 0.0
