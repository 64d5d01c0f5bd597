"""The prefetcher's retry rules: back-off for server trouble, give up after an outage or a run of failures."""

from __future__ import annotations

from stagectl.learner.channel_b.pacing import FailurePolicy


def test_transient_failures_back_off_doubling_up_to_five_seconds() -> None:
    policy = FailurePolicy(max_consecutive_failures=2, outage_timeout_s=1000.0)
    waits = [policy.failed(float(t), transient=True) for t in range(8)]
    assert waits == [0.5, 1.0, 2.0, 4.0, 5.0, 5.0, 5.0, 5.0]  # never the 2-failure limit: that is for others


def test_an_outage_longer_than_the_timeout_gives_up_with_its_length() -> None:
    policy = FailurePolicy(max_consecutive_failures=1, outage_timeout_s=30.0)
    assert policy.failed(100.0, transient=True) == 0.5
    assert policy.failed(130.0, transient=True) == 1.0  # 30 s: not longer than the timeout
    verdict = policy.failed(131.0, transient=True)
    assert isinstance(verdict, str) and "unreachable for 31 s" in verdict and "timeout_s 30" in verdict


def test_other_failures_give_up_after_the_limit_in_a_row() -> None:
    policy = FailurePolicy(max_consecutive_failures=3, outage_timeout_s=30.0)
    assert [policy.failed(0.0, transient=False) for _ in range(2)] == [0.0, 0.0]
    assert policy.failed(0.0, transient=False) == "3 failures in a row"


def test_a_success_ends_the_outage_and_the_run() -> None:
    policy = FailurePolicy(max_consecutive_failures=2, outage_timeout_s=30.0)
    policy.failed(0.0, transient=True)
    policy.failed(0.0, transient=False)
    policy.succeeded()
    assert policy.failed(100.0, transient=False) == 0.0  # the count starts again
    assert policy.failed(100.0, transient=True) == 1.0  # two in a row now, but a new outage begins at 100
    assert policy.failed(129.0, transient=True) == 2.0
