"""Channel-B `async` mode, learner side: the rank's prefetcher and ready-pack queue, the collective
feasibility gate, and the versioned weight sync.

Per optimizer step: every rank reports its prefetcher status (one rank's error ends every rank with
that error); the policy gate (schedule) and the feasibility gate (every rank holds >= GAS packs of one
eligible version: all-reduce MIN) let rank 0 decide `{kind, ver}` and broadcast it. Every
`sync_every_steps` steps: each rank closes its fence (no rollout call in flight anywhere), rank 0
pushes the full weights as `ver + 1` and broadcasts the outcome, every rank advances `ver`.
"""

from __future__ import annotations

import sys
import time
import traceback
from typing import Any

import httpx
import torch

from stagectl import dist
from stagectl.config import StagectlConfig
from stagectl.learner.channel_b import RolloutStats, build_b_segment
from stagectl.learner.rollout_server import ServerRollouts
from stagectl.learner.setup import LearnerState
from stagectl.packing import Segment, collate_pack
from stagectl.prefetch.fence import SyncFence
from stagectl.prefetch.prefetcher import Prefetcher, ReadyPack
from stagectl.prefetch.queue import ReadyPackQueue
from stagectl.prefetch.staleness import decide_step
from stagectl.rollout.client import RolloutClient, WeightPushError


class AsyncChannelB:
    def __init__(
        self, cfg: StagectlConfig, state: LearnerState, client: RolloutClient, *, ver: int = 0
    ) -> None:
        assert cfg.stage2_ab is not None
        self.acfg = cfg.stage2_ab.channel_b.async_
        rm = cfg.custom.extra.rollout_matching
        self.state = state
        self.client = client
        self.world = state.world
        self.ver = ver
        self.fence = SyncFence()
        self.queue: ReadyPackQueue[ReadyPack] = ReadyPackQueue(
            self.acfg.queue_limit, self.acfg.version_window
        )
        self.queue.set_current_ver(ver)
        self.source = ServerRollouts(
            client, state.encoder, rm, state.resolved.rollout_decode_batch_size, self.fence
        )
        desc_w = cfg.stage2_ab.desc_ce_weight
        packing_length = cfg.packing_length
        model = state.bundle.model

        def build(index: int, generation: Any) -> tuple[Segment | None, RolloutStats]:
            return build_b_segment(
                index, generation, state.encoder, rm, desc_ce_weight=desc_w, packing_length=packing_length
            )

        self.prefetcher = Prefetcher(
            source=self.source,
            build_segment=build,
            collate=lambda segments: collate_pack(segments, model),
            sampler=state.b_sampler,
            queue=self.queue,
            current_ver=lambda: self.ver,
            chunk_size=state.resolved.rollout_decode_batch_size,
            packing_length=packing_length,
            target_packs=self.acfg.prefetch_target_packs,
            max_consecutive_failures=self.acfg.max_consecutive_failures,
            outage_timeout_s=rm.vllm.server.timeout_s,
            seed=cfg.training.seed,
            rank=self.world.rank,
            segments_per_pack=cfg.training.per_device_train_batch_size,
            num_chunks=int(state.extra_state.get("rank_state", {}).get("b_chunks", 0)),
        )
        infer_timeout = rm.vllm.server.infer_timeout_s
        self.fence_timeout_s = infer_timeout if infer_timeout is not None and infer_timeout > 0 else None
        self.num_b_steps = 0
        self.num_steps = 0
        self.num_skipped = 0
        self.num_syncs = 0
        self.num_sync_failures = 0
        self.sync_s_total = 0.0

    def start(self) -> None:
        self.prefetcher.start()

    def check_errors(self) -> None:
        """Every rank learns of any rank's prefetcher error and raises it (collective)."""
        errors = dist.all_gather_objects(self.prefetcher.error())
        for rank, error in enumerate(errors):
            if error is not None:  # every rank raises it; rank 0 reports it
                raise dist.SharedError(f"Channel-B prefetcher on rank {rank} failed: {error}")

    def decide(self, policy_wants_b: bool, gas: int) -> tuple[str, int | None]:
        """Policy gate then feasibility gate; rank 0's decision, broadcast (collective)."""
        versions, counts = self.queue.eligible_counts()
        min_counts = dist.all_reduce_ints(counts, "min")
        decision = decide_step(policy_wants_b, versions, min_counts, gas) if self.world.is_main else None
        kind, ver = dist.broadcast_object(decision) or ("A", None)
        self.num_steps += 1
        if kind == "B":
            self.num_b_steps += 1
        elif policy_wants_b:
            self.num_skipped += 1
        return kind, ver

    def pop_packs(self, ver: int, gas: int) -> list[ReadyPack]:
        return [self.queue.pop_for_ver(ver) for _ in range(gas)]

    def sync_weights(self) -> tuple[bool, float]:
        """Full weight push as `ver + 1` (collective). Returns (synced, seconds). An unreachable server
        skips this sync (counted; the next one retries); any other failure ends every rank."""
        started = time.perf_counter()
        with self.fence.sync(timeout_s=self.fence_timeout_s):
            dist.barrier()
            outcome: tuple[str, str] = ("ok", "")
            if self.world.is_main:
                outcome = self._push()
            outcome = dist.broadcast_object(outcome)
        seconds = time.perf_counter() - started
        self.sync_s_total += seconds
        status, message = outcome
        if status == "error":
            raise RuntimeError(f"weight sync to version {self.ver + 1} failed on rank 0: {message}")
        if status == "unreachable":
            self.num_sync_failures += 1
            return False, seconds
        self.ver += 1
        self.queue.set_current_ver(self.ver)
        self.num_syncs += 1
        return True, seconds

    def _push(self) -> tuple[str, str]:
        model = self.state.bundle.model
        state_dict = {name: t.detach().to("cpu") for name, t in model.state_dict().items()}
        try:
            with torch.no_grad():
                self.client.push_weights(state_dict, self.ver + 1)
        except WeightPushError as exc:
            kind = "unreachable" if isinstance(exc.__cause__, httpx.TransportError) else "error"
            return kind, str(exc)
        return "ok", ""

    def metrics(self) -> dict[str, float]:
        """`stage2_ab/async/*` summed over ranks (queue depth: the sum of every rank's depth)."""
        q = self.queue.counters()
        c = self.prefetcher.counters
        local = [
            q.depth,
            q.drop_stale_total,
            q.drop_oldest_total,
            c.success_total,
            c.fail_total,
            c.produced_packs,
        ]
        depth, stale, oldest, success, fail, produced = dist.all_reduce_ints(local, "sum")
        return {
            "stage2_ab/async/queue_depth": depth,
            "stage2_ab/async/ver_current": self.ver,
            "stage2_ab/async/drop_stale_total": stale,
            "stage2_ab/async/drop_oldest_total": oldest,
            "stage2_ab/async/prefetch_success_total": success,
            "stage2_ab/async/prefetch_fail_total": fail,
            "stage2_ab/async/produced_packs_total": produced,
            "stage2_ab/async/b_ratio_realized": self.num_b_steps / max(1, self.num_steps),
            "stage2_ab/async/sync_total": self.num_syncs,
            "stage2_ab/async/sync_fail_total": self.num_sync_failures,
            "stage2_ab/async/prefetch_busy_s": dist.all_reduce_floats([c.busy_s])[0],
        }

    def close(self, deadline_s: float = 30.0) -> None:
        """Stop event -> close the HTTP sessions (ends a rollout call in flight) -> join the prefetcher
        with a deadline. A prefetcher that does not stop is an error: a thread left running inside torch
        or an HTTP call at interpreter exit is what crashes a finished run."""
        self.prefetcher.request_stop()
        self.client.close()
        if not self.prefetcher.join(deadline_s):
            raise RuntimeError(
                f"the Channel-B prefetcher on rank {self.world.rank} did not stop within {deadline_s:g} s "
                f"of the shutdown; its stack:\n{thread_stack(self.prefetcher.thread_ident)}"
            )


def thread_stack(ident: int | None) -> str:
    """The current Python stack of thread `ident` (for an error about a thread that will not stop)."""
    frame = sys._current_frames().get(ident) if ident is not None else None
    return "".join(traceback.format_stack(frame)) if frame is not None else "(thread not running)"
