"""Channel-B `step` mode (one learner rank): the whole loop inside the optimizer step.

A B step takes `rollouts_per_step` raw samples of the B stream (default per-device batch x world size x
GAS), rolls them out (the learner's own model, or a rollout server after the weights were pushed when
they changed), builds one segment per rollout, packs the kept segments into the fewest sequences of
`packing_length` (a variable number of packs), and runs one forward/backward per pack; the trainer then
makes exactly one optimizer update.

Loss scaling is the rule of every channel (see `channel_a`): each pack's loss is scaled by its share of
the step's kept segments. `enable_pipeline` (server rollouts) trains on chunk k while chunk k + 1 is
generated; since the kept total is known only at the end, its packs are scaled by their share of the
requested rollouts and the gradients (and logged terms) are rescaled by requested / kept afterwards, so
both paths give the same update.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from stagectl.collate import Segment
from stagectl.config.plan import ChannelBPlan, ServerStep
from stagectl.detection.stats import RolloutStats
from stagectl.inference.client import RolloutClient
from stagectl.learner.channel_b.gallery import make_b_gallery
from stagectl.learner.channel_b.health import ServerHealth
from stagectl.learner.channel_b.packs import PackBuilder, rollout_seed
from stagectl.learner.channel_b.protocol import Decision
from stagectl.learner.channel_b.publisher import WeightPublisher, connection_metrics
from stagectl.learner.channel_b.rollouts import RolloutSource
from stagectl.learner.packs import PackRunner, StepAccumulator
from stagectl.learner.setup import LearnerState


class StepChannelB:
    def __init__(
        self,
        plan: ChannelBPlan,
        state: LearnerState,
        runner: PackRunner,
        source: RolloutSource,
        *,
        client: RolloutClient | None = None,
        publisher: WeightPublisher | None = None,
        health: ServerHealth | None = None,
    ) -> None:
        """Server rollouts (`plan.source` is `ServerStep`): `client` and `publisher` (with its weight sync)
        are this Channel-B's to report and close; `health`: restart detection and re-sync."""
        self.state = state
        self.runner = runner
        self.source = source
        self.client = client
        self.publisher = publisher
        self.pipeline = isinstance(plan.source, ServerStep) and plan.source.pipeline
        self.health = health
        self.packs = PackBuilder.of_state(state)
        self.seed = state.plan.training.seed
        self.rollouts_per_step = plan.rollouts_per_step
        self.chunk_size = plan.decode_batch_size
        self.num_updates = 0  # set by the trainer before each step
        self.gallery = make_b_gallery(state) if state.world.is_main else None
        self._step = 0

    def start(self) -> None:
        pass

    def decide(self, step: int, policy_wants_b: bool) -> tuple[Decision, dict[str, Any]]:
        if self.health is None or not policy_wants_b:
            return Decision("B" if policy_wants_b else "A"), {}
        return self.health.step_mode_decision(step, self.num_updates), {}

    def run(self, step: int, decision: Decision, acc: StepAccumulator) -> dict[str, Any]:
        first_pos = self.state.b_sampler.num_consumed
        indices = self.state.b_sampler.take(self.rollouts_per_step)
        extra: dict[str, Any] = {}
        if self.publisher is not None:
            with self.runner.timer.time("weight_sync"):
                outcome = self.publisher.ensure_current(self.num_updates)
            extra.update(self.publisher.metrics(outcome))
        seed = rollout_seed(self.seed, step)
        self._step = step
        calls_before = self.source.num_calls
        if self.pipeline:
            stats, rollout_s, wait_s, kept = self._pipelined(indices, seed, acc)
        else:
            stats, rollout_s, wait_s, kept = self._sequential(indices, seed, acc)
        # step mode rolls out with the weights it trains: both versions are the updates made so far
        ver = self.num_updates
        acc.samples += [("B", indices[k], first_pos + k, ver, ver) for k in kept]
        return {
            **extra,
            **stats.metrics(),
            "rollout/seed": seed,
            "rollout/num_generate_calls": self.source.num_calls - calls_before,
            "time/rollout_s": rollout_s,
            "time/wait_s": wait_s,
        }

    def after_update(self, num_updates: int) -> dict[str, Any]:
        self.num_updates = num_updates
        if self.gallery is not None and self.gallery.flush() is not None:
            # a sampled step's record, built and written after its update (off the forward/backward)
            return {"time/b_gallery_s": self.gallery.last_write_s}
        return {}

    def metrics(self) -> dict[str, Any]:
        if self.client is None or self.publisher is None:
            return {}
        return connection_metrics(self.client, self.publisher)

    def rank_state(self) -> dict[str, Any]:
        """Server rollouts: the run's weight-sync totals (a resumed run's go on from them)."""
        return {} if self.publisher is None else {"weight_syncs": self.publisher.totals()}

    def saved_version(self) -> dict[str, Any]:
        return {}

    def close(self, deadline_s: float = 30.0) -> None:
        """Close the rollout client and the weight sync (no thread outlives a step here)."""
        try:
            if self.client is not None:
                self.client.close()
        finally:
            if self.publisher is not None:
                self.publisher.client.close()

    # ------------------------------------------------------------------ the two paths

    def _segments(
        self, indices: Sequence[int], seed: int, *, on_learner: bool = True
    ) -> tuple[list[Segment], RolloutStats, list[int]]:
        """The kept segments, the counters of every rollout, and the kept ones' offsets in `indices`;
        `on_learner`: this is the learner's thread, whose phases are timed."""
        started = time.perf_counter()
        generations = self.source.rollout(indices, seed)
        rolled = time.perf_counter()
        if self.gallery is not None:
            self.gallery.offer(self._step, indices, generations)  # a reference; built after the update
        kept, dropped = self.packs.segments(indices, generations)
        stats = RolloutStats()
        stats.add(dropped)
        for _, _, s in kept:
            stats.add(s)
        if on_learner:
            self.runner.timer.add("wait_packs", rolled - started)
            self.runner.timer.add("collate", time.perf_counter() - rolled)
        return [segment for _, segment, _ in kept], stats, [offset for offset, _, _ in kept]

    def _train(self, segments: Sequence[Segment], denominator: int, acc: StepAccumulator) -> None:
        """The fewest packs of `segments` (`packing: false`: padded batches of the per-device size), one
        forward/backward each, scaled by their share of `denominator` segments."""
        with self.runner.timer.time("collate"):
            groups = self.packs.step_groups([len(s) for s in segments])
        for group in groups:
            with self.runner.timer.time("collate"):
                batch = self.packs.collate([segments[i] for i in group])
            self.runner.run_batch(batch, scale=len(group) / denominator, sync=True, acc=acc)

    def _sequential(
        self, indices: list[int], seed: int, acc: StepAccumulator
    ) -> tuple[RolloutStats, float, float, list[int]]:
        started = time.perf_counter()
        segments, stats, kept = self._segments(indices, seed)
        rollout_s = time.perf_counter() - started
        self._train(segments, max(1, len(segments)), acc)
        return stats, rollout_s, rollout_s, kept

    def _pipelined(
        self, indices: list[int], seed: int, acc: StepAccumulator
    ) -> tuple[RolloutStats, float, float, list[int]]:
        """A producer thread rolls out chunk k+1 while the learner trains on chunk k (queue of 1). The
        producer stops at its next chunk when the learner fails."""
        handoff: queue.Queue[tuple[list[Segment], RolloutStats, list[int]] | BaseException | None] = (
            queue.Queue(maxsize=1)
        )
        stop = threading.Event()
        busy = [0.0]

        def produce() -> None:
            try:
                for start in range(0, len(indices), self.chunk_size):
                    if stop.is_set():
                        return
                    t0 = time.perf_counter()
                    segments, chunk_stats, offsets = self._segments(
                        indices[start : start + self.chunk_size], seed + start, on_learner=False
                    )
                    item = (segments, chunk_stats, [start + k for k in offsets])
                    busy[0] += time.perf_counter() - t0
                    _put(handoff, item, stop)
                _put(handoff, None, stop)
            except BaseException as exc:  # handed to the consumer, which re-raises it
                _put(handoff, exc, stop)

        producer = threading.Thread(target=produce, name="channel-b-pipeline", daemon=True)
        producer.start()
        stats = RolloutStats()
        kept = 0
        kept_offsets: list[int] = []
        wait_s = 0.0
        try:
            while True:
                t0 = time.perf_counter()
                item = handoff.get()
                wait_s += time.perf_counter() - t0
                self.runner.timer.add("wait_packs", time.perf_counter() - t0)
                if item is None:
                    break
                if isinstance(item, BaseException):
                    raise item
                segments, chunk_stats, offsets = item
                kept_offsets += offsets
                stats.add(chunk_stats)
                kept += len(segments)
                self._train(segments, len(indices), acc)
        finally:
            stop.set()
            while producer.is_alive():  # unblock a producer waiting to hand over, then let it end
                try:
                    handoff.get_nowait()
                except queue.Empty:
                    producer.join(0.05)
        if kept:  # from shares of the requested rollouts to shares of the kept ones (the step's rule)
            _rescale(self.runner.base_model, acc, len(indices) / kept)
        return stats, busy[0], wait_s, kept_offsets


def _put(handoff: queue.Queue[Any], item: Any, stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            handoff.put(item, timeout=0.05)
            return
        except queue.Full:
            continue


def _rescale(model: Any, acc: StepAccumulator, factor: float) -> None:
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(factor)
    for key in acc.terms:
        acc.terms[key] *= factor
