"""When a committed weight sync is swapped in: between requests, never inside one.

Every `/infer/` call passes the gate (`admit`) around its generate call. A sync that commits while calls
are in progress does not wait for them: `apply` records it as pending and returns (the learner goes on
training), and the last call in progress swaps it in as it leaves. So a call is answered by one version
from its first token to its last, whatever its size, and a sync never waits for rollouts.

Calls that arrive while a swap is pending:
- an untagged call (swift's clients, step mode) waits for the swap: it sees the newest committed weights,
  as it would have before;
- a call tagged with the version serving now (`weight_version`, the async prefetcher's burst that began
  before the sync) is admitted and answered with it: the swap waits for it too;
- a call tagged with an older version than the serving one is refused (`WrongVersion`, HTTP 409): its
  burst began before a sync that has been swapped in since; the prefetcher takes its samples back and
  starts its next burst at the new version. A tag above the committed version is refused too (the
  learner thinks the server holds weights it never received).

`/version/` reports the committed version (what an untagged call will be answered with).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Protocol

from stagectl.wire.protocol import TensorSpec

if TYPE_CHECKING:
    import torch

log = logging.getLogger("stagectl.weightsync.gate")


class WeightTarget(Protocol):
    """What weight sync needs of an engine (every `engines.interface.Engine` is one): its serving version,
    the tensors a full sync must bring, and an atomic swap. Declared here so that weight sync imports no
    engine."""

    @property
    def version(self) -> int: ...

    def weight_specs(self) -> dict[str, TensorSpec]: ...

    def apply_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None: ...


class WrongVersion(Exception):
    """A tagged `/infer/` call names a version this server does not serve (HTTP 409)."""


class VersionGate:
    def __init__(self, engine: WeightTarget) -> None:
        self.engine = engine
        self._cond = threading.Condition()
        self._in_progress = 0
        self._pending: tuple[int, Callable[[], None]] | None = None  # (version, swap) waiting for calls
        self._swapping: int | None = None  # the version being swapped in now (every call waits)
        self.num_deferred = 0  # swaps that waited for calls in progress
        self.num_failed = 0  # swaps that raised (the serving weights stay)

    @property
    def committed_version(self) -> int:
        """The version an untagged call gets: a pending or running swap's, else the serving one."""
        with self._cond:
            if self._pending is not None:
                return self._pending[0]
            return self._swapping if self._swapping is not None else self.engine.version

    @contextmanager
    def admit(self, tag: int | None) -> Iterator[None]:
        """Hold a call in progress (see the module docstring for `tag`)."""
        with self._cond:
            while True:
                if self._swapping is None:
                    serving = self.engine.version
                    if tag is not None and tag < serving:
                        raise WrongVersion(
                            f"weight_version {tag} is no longer served (version {serving} is): request it "
                            "again at the current version"
                        )
                    if self._pending is None or tag == serving:
                        break
                self._cond.wait()  # a swap runs, or waits for the calls in progress: after it
            if tag is not None and tag != serving:
                raise WrongVersion(
                    f"weight_version {tag} was never committed to this server (it serves version {serving})"
                )
            self._in_progress += 1
        try:
            yield
        finally:
            with self._cond:
                self._in_progress -= 1
                swap = self._pending if self._in_progress == 0 else None
                if swap is not None:
                    self._pending, self._swapping = None, swap[0]
            if swap is not None:
                self._swap(*swap)

    def apply(self, version: int, swap: Callable[[], None]) -> bool:
        """Swap `version` in now when no call is in progress (True), else when the last one leaves
        (False: deferred, and this returns at once). Call it with no swap pending (`wait_swapped`)."""
        with self._cond:
            assert self._pending is None and self._swapping is None, "a swap is already pending"
            if self._in_progress:
                self._pending = (version, swap)
                self.num_deferred += 1
                return False
            self._swapping = version
        self._swap(version, swap, reraise=True)  # the commit's caller learns of a failed swap
        return True

    def wait_swapped(self, timeout_s: float | None = None) -> None:
        """Block until no swap is pending or running (the next sync writes into the buffers it reads)."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._pending is None and self._swapping is None, timeout_s):
                raise TimeoutError(
                    f"a committed weight sync has waited {timeout_s} s for {self._in_progress} rollout "
                    "call(s) in progress"
                )

    def _swap(self, version: int, swap: Callable[[], None], *, reraise: bool = False) -> None:
        try:
            swap()
        except Exception:  # the checks passed before the commit: this is the engine failing
            self.num_failed += 1
            log.exception(
                "swapping in weights version %d failed; still serving %d", version, self.engine.version
            )
            if reraise:
                raise
        finally:
            with self._cond:
                self._swapping = None
                self._cond.notify_all()
