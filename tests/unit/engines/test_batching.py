"""The batching worker: grouping rule, batch sizes under concurrency, error delivery, close."""

from __future__ import annotations

import threading
import time

import pytest

from stagectl.engines.batching import BatchingWorker, take_batch


@pytest.mark.parametrize(
    ("keys", "max_size", "expected"),
    [
        ([], 4, []),
        (["a"], 4, [0]),
        (["a", "a", "a"], 2, [0, 1]),
        (["a", "b", "a", "b", "a"], 8, [0, 2, 4]),
        (["b", "a", "a"], 8, [0]),
    ],
)
def test_take_batch(keys: list[str], max_size: int, expected: list[int]) -> None:
    assert take_batch(keys, max_size) == expected


def _recording_worker(max_batch_size: int, wait_ms: float, delay_s: float = 0.0):
    batches: list[list[int]] = []

    def run(items: list[int]) -> list[int]:
        batches.append(list(items))
        time.sleep(delay_s)
        return [i * 10 for i in items]

    worker: BatchingWorker[int, int] = BatchingWorker(
        run, key=lambda i: i % 2, max_batch_size=max_batch_size, batch_wait_ms=wait_ms
    )
    return worker, batches


def test_one_submit_is_one_batch_per_key_and_results_keep_order() -> None:
    worker, batches = _recording_worker(max_batch_size=8, wait_ms=50)
    try:
        assert worker.run([0, 2, 1, 4, 3]) == [0, 20, 10, 40, 30]
    finally:
        worker.close()
    assert sorted(map(sorted, batches)) == [[0, 2, 4], [1, 3]]  # grouped by key (parity)
    assert worker.batch_sizes() == {3: 1, 2: 1}


def test_concurrent_callers_share_batches_up_to_the_limit() -> None:
    worker, batches = _recording_worker(max_batch_size=4, wait_ms=100, delay_s=0.05)
    results: dict[int, list[int]] = {}

    def call(k: int) -> None:
        results[k] = worker.run([2 * k])

    threads = [threading.Thread(target=call, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    worker.close()
    assert results == {k: [20 * k] for k in range(8)}
    assert max(len(b) for b in batches) == 4  # grouped, never above max_batch_size
    assert len(batches) < 8


def test_an_error_fails_only_its_batch() -> None:
    def run(items: list[int]) -> list[int]:
        if 13 in items:
            raise RuntimeError("boom")
        return items

    worker: BatchingWorker[int, int] = BatchingWorker(run, key=lambda i: i, max_batch_size=8, batch_wait_ms=0)
    try:
        with pytest.raises(RuntimeError, match="boom"):
            worker.run([13])
        assert worker.run([5]) == [5]  # the worker survives
    finally:
        worker.close()


def test_an_exception_as_a_result_fails_that_item_alone() -> None:
    worker: BatchingWorker[int, int] = BatchingWorker(
        lambda items: [ValueError(f"bad {i}") if i < 0 else i for i in items],
        key=lambda i: 0,
        max_batch_size=4,
        batch_wait_ms=0,
    )
    good, bad, other = worker.submit([1, -2, 3])
    assert good.result(5) == 1 and other.result(5) == 3
    with pytest.raises(ValueError, match="bad -2"):
        bad.result(5)
    worker.close()


def test_wrong_result_count_is_an_error() -> None:
    worker: BatchingWorker[int, int] = BatchingWorker(
        lambda items: [], key=lambda i: 0, max_batch_size=2, batch_wait_ms=0
    )
    try:
        with pytest.raises(RuntimeError, match="returned 0 results for 1 items"):
            worker.run([1])
    finally:
        worker.close()


def test_close_finishes_queued_items_and_refuses_new_ones() -> None:
    started = threading.Event()
    release = threading.Event()

    def run(items: list[int]) -> list[int]:
        started.set()
        release.wait(5)
        return items

    worker: BatchingWorker[int, int] = BatchingWorker(run, key=lambda i: i, max_batch_size=1, batch_wait_ms=0)
    first = worker.submit([1])[0]
    started.wait(5)
    queued = worker.submit([2])[0]
    closer = threading.Thread(target=worker.close)
    closer.start()
    release.set()
    closer.join(5)
    assert first.result(5) == 1
    assert queued.result(5) == 2  # graceful: what was queued before close still runs
    with pytest.raises(RuntimeError, match="closed"):
        worker.submit([3])


def test_cancel_queued_fails_what_waits_at_once_and_lets_the_running_batch_finish() -> None:
    """A stopping server's queued calls are answered at once; without it, `close` decoded every one of them
    (minutes) for clients that uvicorn had already cut off."""
    started = threading.Event()
    release = threading.Event()
    ran: list[list[int]] = []

    def run(items: list[int]) -> list[int]:
        ran.append(items)
        started.set()
        release.wait(5)
        return items

    worker: BatchingWorker[int, int] = BatchingWorker(run, key=lambda i: i, max_batch_size=1, batch_wait_ms=0)
    running = worker.submit([1])[0]
    started.wait(5)
    queued = worker.submit([2, 3])
    stopping = RuntimeError("stopping")
    worker.cancel_queued(stopping)
    errors = [future.exception(0.5) for future in queued]  # before the running batch ends
    assert [(type(e), str(e)) for e in errors] == [(RuntimeError, "stopping")] * 2
    assert (
        errors[0] is not errors[1] is not stopping
    )  # one each: a shared instance's traceback grows per raise
    with pytest.raises(RuntimeError, match="stopping"):
        worker.submit([4])
    release.set()
    assert running.result(5) == 1
    worker.close()
    assert ran == [[1]]


def test_items_the_worker_already_holds_are_not_decoded_after_cancel_queued() -> None:
    """Items of another key the worker pulled into its own pending list (while it waited to fill a batch) are
    past the queue `cancel_queued` drains: the worker must fail them, not decode them after the batch."""
    started, release = threading.Event(), threading.Event()
    ran: list[list[int]] = []

    def run(items: list[int]) -> list[int]:
        ran.append(list(items))
        started.set()
        release.wait(5)
        return items

    # key = parity, batches of 2 filled for 300 ms: the worker takes 0, then holds 1 and 3 (the other key)
    worker: BatchingWorker[int, int] = BatchingWorker(
        run, key=lambda i: i % 2, max_batch_size=2, batch_wait_ms=300
    )
    futures = worker.submit([0, 1, 3])
    assert started.wait(5)
    worker.cancel_queued(RuntimeError("stopping"))
    release.set()
    assert futures[0].result(5) == 0
    assert [type(f.exception(5)) for f in futures[1:]] == [RuntimeError, RuntimeError]
    worker.close()
    assert ran == [[0]]


def test_max_batch_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_batch_size"):
        BatchingWorker(lambda items: items, key=lambda i: 0, max_batch_size=0, batch_wait_ms=0)


def test_a_program_that_ends_without_close_lets_the_running_batch_finish(tmp_path) -> None:
    """A daemon worker inside `run_batch` (a torch generate) when the interpreter finalises aborts the
    process (SIGABRT, `terminate called without an active exception`): the worker is not a daemon and
    ends on its own once the main thread has, after the batch it is running."""
    import subprocess
    import sys

    done = tmp_path / "done"
    script = f"""
import sys, time
from stagectl.engines.batching import BatchingWorker
def run(items):
    time.sleep(0.5)
    open({str(done)!r}, "w").write("finished")
    return items
worker = BatchingWorker(run, key=lambda i: 0, max_batch_size=1, batch_wait_ms=0)
worker.submit([1, 2])
time.sleep(0.1)  # the first batch is running; the main thread ends without close()
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert done.read_text() == "finished"  # the running batch ended before the interpreter did
    assert "Traceback" not in result.stderr
