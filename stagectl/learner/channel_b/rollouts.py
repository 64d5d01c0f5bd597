"""Where Channel-B rollouts come from, for the learner: its own model (`rollout_backend: hf`, one
process) or rollout servers (`rollout_backend: vllm`, `vllm.mode: server`, the section-6 protocol).

Server rollouts run inside fenced sections: the samples are split into requests of
`rollout_decode_batch_size`, sent together (the servers batch them); no weight sync can start while a
section is open, so every rollout of a section comes from one policy version: the learner's counter
captured when the section passed the fence (a server that reports its version must agree). The section
stays closed until the caller's `with` block ends (the prefetcher tops its burst up and queues the
burst's packs there, so the next step's gate always sees them).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Protocol, TypeVar

from stagectl.config.sampling import SamplingSpec
from stagectl.inference.client import RolloutClient
from stagectl.inference.requests import detection_infer_request, request_config, to_generation
from stagectl.learner.channel_b.clock import VersionClock
from stagectl.learner.segments import SampleEncoder
from stagectl.models.generate import Generation, generate_batch
from stagectl.wire.errors import RolloutServerError
from stagectl.wire.protocol import InferRequest, InferResponse

T = TypeVar("T")


class RolloutSource(Protocol):
    """What step-mode Channel-B needs: one generation per sample index, in order, seeded by `seed`."""

    num_calls: int  # generate calls (hf) or /infer/ requests (server) made so far

    def rollout(self, indices: Sequence[int], seed: int) -> list[Generation]: ...


class HFRollouts:
    """Generates with the (unwrapped) policy in eval mode, `chunk_size` samples per `generate` call."""

    def __init__(
        self,
        model: Any,
        encoder: SampleEncoder,
        spec: SamplingSpec,
        chunk_size: int,
    ) -> None:
        """`spec.logprobs`: each generation also carries its tokens' log-probabilities."""
        self.model = model
        self.encoder = encoder
        self.chunk_size = chunk_size
        self.spec = spec
        self.num_calls = 0

    def rollout(self, indices: Sequence[int], seed: int) -> list[Generation]:
        was_training = self.model.training
        self.model.eval()
        try:
            out: list[Generation] = []
            for chunk_index, start in enumerate(range(0, len(indices), self.chunk_size)):
                chunk = indices[start : start + self.chunk_size]
                prompts = [self.encoder.prompt_inputs(i) for i in chunk]
                out += generate_batch(
                    self.model,
                    prompts,
                    self.spec,
                    stop_token_ids=sorted(self.encoder.vocab.stop_ids),
                    pad_token_id=self.encoder.pad_token_id,
                    seed=seed + chunk_index,
                )
                self.num_calls += 1
            return out
        finally:
            self.model.train(was_training)


class ServerRollouts:
    def __init__(
        self,
        client: RolloutClient,
        encoder: SampleEncoder,
        spec: SamplingSpec,
        chunk_size: int,
        clock: VersionClock,
        *,
        tag_versions: bool = False,
    ) -> None:
        """`clock`: the shared version clock (a section's version is its `ver` on entry; its fence keeps
        syncs out of a section). `tag_versions` (async `in_flight_sync`): a section does not hold the fence;
        its calls carry its version (`weight_version`), which the servers answer with or refuse
        (`WrongVersionError`)."""
        self.client = client
        self.tag_versions = tag_versions
        self.encoder = encoder
        self.chunk_size = chunk_size
        self.clock = clock
        self.base_config = request_config(spec, seed=None)
        self.num_calls = 0
        self._stop = threading.Event()

    def request_for(self, index: int) -> InferRequest:
        return detection_infer_request(self.encoder.samples[index])

    @contextmanager
    def section(self) -> Iterator[RolloutSection]:
        """One fenced section: no weight sync can start until the `with` block ends, so every rollout
        asked for inside it (`section.rollout`, any number of times) comes from one policy version,
        the learner's counter captured on entry (`section.ver`). With `tag_versions` the servers keep
        that promise instead (a sync goes ahead; the section's calls are answered at its version or refused)."""
        if self.tag_versions:
            yield RolloutSection(self, self.clock.ver)
            return
        with self.clock.call():
            yield RolloutSection(self, self.clock.ver)

    def rollout(self, indices: Sequence[int], seed: int) -> list[Generation]:
        with self.section() as section:
            return section.rollout(indices, seed)

    def _request(self, chunk: Sequence[int], seed: int, ver: int) -> list[InferResponse]:
        config = self.base_config.model_copy(update={"seed": seed % 2**31})
        tag = ver if self.tag_versions else None
        return self.client.infer([self.request_for(i) for i in chunk], config, weight_version=tag)

    def stop(self) -> None:
        """End the requests in flight (they raise `RolloutServerError`) and refuse new ones: the shutdown."""
        self._stop.set()


class RolloutSection:
    """Rollouts inside one fenced section of `ServerRollouts` (see `ServerRollouts.section`)."""

    def __init__(self, source: ServerRollouts, ver: int) -> None:
        self.source = source
        self.ver = ver

    def rollout(self, indices: Sequence[int], seed: int) -> list[Generation]:
        """One generation per index, in order: requests of `rollout_decode_batch_size` sent together
        (request k seeded `seed + its offset`); every server must report this section's version."""
        src = self.source
        calls = [
            functools.partial(src._request, indices[s : s + src.chunk_size], seed + s, self.ver)
            for s in range(0, len(indices), src.chunk_size)
        ]
        src.num_calls += len(calls)
        responses = [r for part in run_together(calls, src._stop) for r in part]
        reported = {r.version for r in responses if r.version is not None}
        if reported - {self.ver}:
            raise RolloutServerError(
                f"rollout servers answered with weight versions {sorted(reported)} inside a section of "
                f"version {self.ver}: a sync left them on other weights than the learner's"
            )
        return [to_generation(r) for r in responses]


def run_together(calls: Sequence[Callable[[], T]], stop: threading.Event) -> list[T]:
    """Run `calls` at once, each on its own daemon thread, and return their results in order; the first
    error is raised once every call has ended. If `stop` is set first, raise at once and leave the calls
    behind: they are plain HTTP calls on daemon threads, so nothing waits for them at exit."""
    if stop.is_set():
        raise RolloutServerError("rollouts stopped (shutdown)")
    results: list[Any] = [None] * len(calls)
    errors: list[BaseException | None] = [None] * len(calls)

    def call(k: int) -> None:
        try:
            results[k] = calls[k]()
        except BaseException as exc:  # re-raised by the caller below
            errors[k] = exc

    threads = [
        threading.Thread(target=call, args=(k,), name="rollout-request", daemon=True)
        for k in range(len(calls))
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        while thread.is_alive():
            thread.join(0.05)
            if stop.is_set():
                raise RolloutServerError("rollouts stopped (shutdown) with requests in flight")
    for error in errors:
        if error is not None:
            raise error
    return results
