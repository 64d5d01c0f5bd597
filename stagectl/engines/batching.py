"""The batching worker: one thread that groups concurrent requests into batches for one generate call.

Callers `submit` items and get futures. The worker takes the oldest pending item, waits up to
`batch_wait_ms` for more items with the same key (equal sampling parameters) until it has
`max_batch_size`, runs `run_batch` on them and resolves their futures (a result that is an `Exception`
fails that item alone: an engine that finds one bad request in a batch answers the others); an error in
`run_batch`
fails exactly that batch's futures. `take_batch` is the pure grouping rule.

The thread is not a daemon, and it ends by itself once the main thread has ended (after the batch it is
running; what is still queued fails): a daemon thread inside `run_batch` (a torch generate) when the
interpreter finalises is torn down mid C++ call, which aborts the process (`terminate called without an
active exception`, SIGABRT: what a Ctrl-C on `stagectl stage-b` used to end with). `close` is still the
orderly end; this is what makes a forgotten or interrupted `close` harmless.
"""

from __future__ import annotations

import copy
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")


def take_batch(keys: Sequence[Hashable], max_batch_size: int) -> list[int]:
    """Indices of the next batch: the oldest item plus the following items with its key, in order,
    at most `max_batch_size`. Items of other keys keep their place for later batches."""
    if not keys:
        return []
    first = keys[0]
    return [i for i, key in enumerate(keys) if key == first][:max_batch_size]


@dataclass
class _Pending(Generic[T, R]):
    item: T
    key: Hashable
    future: Future[R]


_STOP = object()
IDLE_POLL_S = 0.2  # how often an idle worker checks whether the main thread has ended


class BatchingWorker(Generic[T, R]):
    """Runs `run_batch(items) -> results` (same length, same order) on one background thread."""

    def __init__(
        self,
        run_batch: Callable[[list[T]], Sequence[R | Exception]],
        key: Callable[[T], Hashable],
        *,
        max_batch_size: int,
        batch_wait_ms: float,
        name: str = "batching-worker",
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self._run_batch = run_batch
        self._key = key
        self.max_batch_size = max_batch_size
        self.batch_wait_s = batch_wait_ms / 1000.0
        self._queue: queue.Queue[_Pending[T, R] | object] = queue.Queue()
        self._histogram: Counter[int] = Counter()
        self._histogram_lock = threading.Lock()
        self._closed = False
        self._cancelled: Exception | None = None  # set by `cancel_queued`: what every later item fails with
        self._thread = threading.Thread(target=self._loop, name=name, daemon=False)
        self._thread.start()

    def submit(self, items: Sequence[T]) -> list[Future[R]]:
        """Queue `items` together (they are seen by the worker at once, so they can share a batch)."""
        if self._closed:
            raise RuntimeError("the batching worker is closed")
        if self._cancelled is not None:
            raise copy.copy(self._cancelled)
        pending = [_Pending(item, self._key(item), Future[R]()) for item in items]
        for p in pending:
            self._queue.put(p)
        return [p.future for p in pending]

    def run(self, items: Sequence[T]) -> list[R]:
        """Submit and wait for every result (re-raises the batch's error)."""
        return [future.result() for future in self.submit(items)]

    def batch_sizes(self) -> dict[int, int]:
        with self._histogram_lock:
            return dict(self._histogram)

    def cancel_queued(self, error: Exception) -> None:
        """Fail every item not in the running batch with `error`, at once, and every item submitted later;
        the running batch finishes (a generate call cannot be cut). A stopping server calls this so its
        queued calls are answered now instead of being decoded for clients that are gone."""
        self._cancelled = error
        stop = False
        for got in self._take_queued():
            if isinstance(got, _Pending):  # an error each: a shared one's traceback grows with every raise
                got.future.set_exception(copy.copy(error))
            else:
                stop = True
        if stop:
            self._queue.put(_STOP)  # a `close` under way still ends the thread

    def close(self) -> None:
        """Refuse new items, finish everything queued so far, stop the thread."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(_STOP)
        self._thread.join()

    def _loop(self) -> None:
        pending: list[_Pending[T, R]] = []
        while True:
            if not pending:
                try:
                    got = self._queue.get(timeout=IDLE_POLL_S)
                except queue.Empty:
                    if threading.main_thread().is_alive():
                        continue
                    break  # the program is ending without close(): stop before the interpreter finalises
                if got is _STOP:
                    break
                assert isinstance(got, _Pending)
                pending.append(got)
            stopping = self._fill(pending)
            chosen = set(take_batch([p.key for p in pending], self.max_batch_size))
            batch = [p for i, p in enumerate(pending) if i in chosen]
            pending = [p for i, p in enumerate(pending) if i not in chosen]
            self._execute(batch)
            if stopping or not threading.main_thread().is_alive():
                break
        self._fail_rest(pending)

    def _fill(self, pending: list[_Pending[T, R]]) -> bool:
        """Move queued items into `pending` until the oldest item's batch is full or the wait is over.
        Returns True when a stop was requested (the current batch still runs)."""
        deadline = time.monotonic() + self.batch_wait_s
        first_key = pending[0].key
        while sum(p.key == first_key for p in pending) < self.max_batch_size:
            try:
                got = self._queue.get_nowait()
            except queue.Empty:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                try:
                    got = self._queue.get(timeout=remaining)
                except queue.Empty:
                    break
            if got is _STOP:
                return True
            assert isinstance(got, _Pending)
            pending.append(got)
        return False

    def _execute(self, batch: list[_Pending[T, R]]) -> None:
        if self._cancelled is not None:  # taken from the queue before `cancel_queued` drained it
            for p in batch:
                p.future.set_exception(copy.copy(self._cancelled))
            return
        with self._histogram_lock:
            self._histogram[len(batch)] += 1
        try:
            results = self._run_batch([p.item for p in batch])
            if len(results) != len(batch):
                raise RuntimeError(f"run_batch returned {len(results)} results for {len(batch)} items")
        except Exception as exc:  # handed to every waiting caller, which re-raises it
            for p in batch:
                p.future.set_exception(exc)
            return
        for p, result in zip(batch, results, strict=True):
            if isinstance(result, Exception):
                p.future.set_exception(result)
            else:
                p.future.set_result(result)

    def _take_queued(self) -> list[object]:
        """Everything queued now (items, and the stop marker), without waiting."""
        taken: list[object] = []
        while True:
            try:
                taken.append(self._queue.get_nowait())
            except queue.Empty:
                return taken

    def _fail_rest(self, pending: list[_Pending[T, R]]) -> None:
        pending += [got for got in self._take_queued() if isinstance(got, _Pending)]
        for p in pending:
            p.future.set_exception(RuntimeError("the engine was closed before this request ran"))
