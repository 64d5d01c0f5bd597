"""Channel-B `step` mode (one learner rank): raw samples are buffered over the first GAS-1 micro-steps;
on the last one the whole loop runs: rollouts in chunks -> segments -> a variable number of packs ->
one forward/backward per pack -> (the caller makes) exactly one optimizer update.

Rollouts come from the learner's own model (`hf`) or a rollout server; with a server the current
weights are pushed before the rollouts whenever the policy changed since the last push, and
`enable_pipeline` overlaps rollout chunks with learning through a bounded queue of size 1.
"""

from __future__ import annotations

import hashlib
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

from stagectl.config import StagectlConfig
from stagectl.learner.channel_b import RolloutSource, RolloutStats, build_b_segments
from stagectl.learner.packs import PackRunner, StepAccumulator, make_packs
from stagectl.learner.setup import LearnerState
from stagectl.packing import Segment
from stagectl.rollout.client import RolloutClient


def rollout_seed(seed: int, step: int) -> int:
    """Seed of step `step`'s rollouts: a stable function of (training seed, step)."""
    digest = hashlib.sha256(f"{seed}:{step}".encode()).digest()
    return int.from_bytes(digest[:4], "little") % 2**31


class StepWeightSync:
    """Keeps a rollout server on the learner's current weights (step mode, one rank)."""

    def __init__(self, client: RolloutClient, num_updates: int) -> None:
        self.client = client
        self.server_ver = max(v.version for v in client.versions())
        # a fresh server already serves the base weights; anything else gets a push first
        self.synced_updates = 0 if self.server_ver == 0 and num_updates == 0 else -1
        self.num_pushes = 0

    def ensure_current(self, model: Any, num_updates: int) -> float:
        """Push the weights if they changed since the last push; returns seconds spent."""
        if self.synced_updates == num_updates:
            return 0.0
        started = time.perf_counter()
        state_dict = {name: t.detach().to("cpu") for name, t in model.state_dict().items()}
        self.client.push_weights(state_dict, self.server_ver + 1)
        self.server_ver += 1
        self.synced_updates = num_updates
        self.num_pushes += 1
        return time.perf_counter() - started


class StepModeB:
    def __init__(
        self,
        cfg: StagectlConfig,
        state: LearnerState,
        runner: PackRunner,
        source: RolloutSource,
        *,
        weight_sync: StepWeightSync | None = None,
        pipeline: bool = False,
    ) -> None:
        assert cfg.stage2_ab is not None
        self.cfg = cfg
        self.state = state
        self.runner = runner
        self.source = source
        self.weight_sync = weight_sync
        self.pipeline = pipeline
        self.desc_ce_weight = cfg.stage2_ab.desc_ce_weight
        self.chunk_size = state.resolved.rollout_decode_batch_size

    def run(self, step: int, gas: int, num_updates: int, acc: StepAccumulator) -> dict[str, Any]:
        budget = self.state.resolved.rollouts_per_step
        buffered: list[int] = []
        extra: dict[str, Any] = {}
        for micro in range(gas):
            share = budget // gas + (1 if micro < budget % gas else 0)
            buffered += self.state.b_sampler.take(share)
            if micro < gas - 1:
                continue  # raw samples only: the B loop runs once, on the last micro-step
            sync_s = 0.0
            if self.weight_sync is not None:
                sync_s = self.weight_sync.ensure_current(self.state.bundle.model, num_updates)
            seed = rollout_seed(self.cfg.training.seed, step)
            calls_before = self.source.num_calls
            if self.pipeline:
                stats, rollout_s, wait_s = self._pipelined(buffered, seed, acc)
            else:
                stats, rollout_s, wait_s = self._sequential(buffered, seed, acc)
            extra = {
                **stats.metrics(),
                "rollout/seed": seed,
                "rollout/b_loop_micro_step": micro,
                "rollout/num_generate_calls": self.source.num_calls - calls_before,
                "time/rollout_s": rollout_s,
                "time/wait_s": wait_s,
                "time/weight_sync_s": sync_s,
            }
        return extra

    def _segments(self, indices: Sequence[int], seed: int) -> tuple[list[Segment], RolloutStats]:
        generations = self.source.rollout(indices, seed)
        return build_b_segments(
            indices,
            generations,
            self.state.encoder,
            self.cfg.custom.extra.rollout_matching,
            desc_ce_weight=self.desc_ce_weight,
            packing_length=self.runner.packing_length,
        )

    def _sequential(
        self, indices: list[int], seed: int, acc: StepAccumulator
    ) -> tuple[RolloutStats, float, float]:
        started = time.perf_counter()
        segments, stats = self._segments(indices, seed)
        rollout_s = time.perf_counter() - started
        packs = make_packs(segments, self.runner.packing_length) if segments else []
        self.runner.run_packs(packs, segments_in_step=max(1, len(segments)), acc=acc, sync_last=True)
        return stats, rollout_s, rollout_s

    def _pipelined(
        self, indices: list[int], seed: int, acc: StepAccumulator
    ) -> tuple[RolloutStats, float, float]:
        """A producer thread rolls out chunk k+1 while the learner trains on chunk k (queue size 1)."""
        handoff: queue.Queue[tuple[list[Segment], RolloutStats] | BaseException | None] = queue.Queue(
            maxsize=1
        )
        busy = [0.0]

        def produce() -> None:
            try:
                for start in range(0, len(indices), self.chunk_size):
                    t0 = time.perf_counter()
                    item = self._segments(indices[start : start + self.chunk_size], seed + start)
                    busy[0] += time.perf_counter() - t0
                    handoff.put(item)
                handoff.put(None)
            except BaseException as exc:  # handed to the consumer, which re-raises it
                handoff.put(exc)

        producer = threading.Thread(target=produce, name="channel-b-pipeline", daemon=True)
        producer.start()
        stats = RolloutStats()
        wait_s = 0.0
        while True:
            t0 = time.perf_counter()
            item = handoff.get()
            wait_s += time.perf_counter() - t0
            if item is None:
                break
            if isinstance(item, BaseException):
                producer.join(5.0)
                raise item
            segments, chunk_stats = item
            stats.add(chunk_stats)
            packs = make_packs(segments, self.runner.packing_length) if segments else []
            # one rank only in step mode: there is no DDP all-reduce to defer
            self.runner.run_packs(packs, segments_in_step=len(indices), acc=acc, sync_last=True)
        producer.join()
        return stats, busy[0], wait_s
