"""The optimizer-step driver of `stagectl train-ab`: setup -> step ... -> close.

Per optimizer step `s`: rank 0 decides the channel from the schedule and broadcasts it; the kind is
fixed for the whole accumulation window; Channel-A runs one pack per micro-step, Channel-B (step
mode) buffers raw samples and runs the rollout -> targets -> packs loop on the last micro-step;
then exactly one optimizer update, and rank 0 appends one metrics row.
"""

from __future__ import annotations

import hashlib
import json
import signal
import time
from types import FrameType
from typing import Any

import torch

from stagectl import dist
from stagectl.config import StagectlConfig
from stagectl.learner import checkpoint as ckpt
from stagectl.learner.channel_b import build_b_segments
from stagectl.learner.loss import LossWeights
from stagectl.learner.metrics import MetricsWriter, ProgressBar
from stagectl.learner.packs import StepAccumulator, make_packs, run_packs
from stagectl.learner.rollout_hf import HFRollouts
from stagectl.learner.setup import LearnerState, build_learner
from stagectl.schedule import channel_for_step


def rollout_seed(seed: int, step: int) -> int:
    """Seed of step `step`'s rollouts: a stable function of (training seed, step)."""
    digest = hashlib.sha256(f"{seed}:{step}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


class Trainer:
    def __init__(self, cfg: StagectlConfig) -> None:
        self.cfg = cfg
        self.world = dist.read_world()
        self.state: LearnerState = build_learner(cfg, self.world)
        s2 = cfg.stage2_ab
        assert s2 is not None and s2.schedule.b_ratio is not None  # validated by the config
        self.b_ratio = s2.schedule.b_ratio
        self.loss_weights = LossWeights(s2.bbox_smoothl1_weight, s2.bbox_ciou_weight, s2.coord_ce_weight)
        self.desc_ce_weight = s2.desc_ce_weight
        self.gas = self.state.resolved.gradient_accumulation_steps
        self.rollouts = HFRollouts(
            self.state.bundle.model,
            self.state.encoder,
            cfg.custom.extra.rollout_matching,
            self.state.resolved.rollout_decode_batch_size,
        )
        self.num_updates = int(self.state.extra_state.get("num_updates", 0))
        self.metrics = (
            MetricsWriter(
                cfg.training.output_dir,
                tensorboard="tensorboard" in cfg.training.report_to,
                resume_step=self.state.start_step,
            )
            if self.world.is_main
            else None
        )
        self.progress = ProgressBar(cfg.training.max_steps, self.state.start_step, enabled=self.world.is_main)
        self._stop_signal: int | None = None

    # ------------------------------------------------------------------ run

    def run(self) -> int:
        """Train to `max_steps` (or until SIGTERM/SIGINT, which saves first); returns the last step."""
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        cfg = self.cfg.training
        step = self.state.start_step
        try:
            while step < cfg.max_steps:
                row = self.train_step(step)
                step += 1
                if self.metrics is not None:
                    self.metrics.write(row)
                self.progress.update(step - 1, row, log=step % cfg.logging_steps == 0)
                stop = dist.broadcast_object(self._stop_signal is not None)
                if (cfg.save_steps and step % cfg.save_steps == 0) or step == cfg.max_steps or stop:
                    self.save(step)
                if stop:
                    break
            self._write_final_state(step)
            return step
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self.close()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self._stop_signal is not None:
            raise KeyboardInterrupt  # second signal: stop now
        self._stop_signal = signum

    @property
    def stopped_by_signal(self) -> int | None:
        return self._stop_signal

    # ------------------------------------------------------------------ one optimizer step

    def train_step(self, step: int) -> dict[str, Any]:
        started = time.perf_counter()
        # rank 0 decides, every rank follows (the schedule is pure, but one decider rules out drift)
        kind: str = dist.broadcast_object(channel_for_step(step, self.b_ratio) if self.world.is_main else "")
        acc = StepAccumulator()
        extra: dict[str, Any] = {}
        if kind == "A":
            self._channel_a(acc)
        else:
            extra = self._channel_b_step(step, acc)
        grad_norm = self._optimizer_update()
        return self._row(step, kind, acc, extra, grad_norm, time.perf_counter() - started)

    def _channel_a(self, acc: StepAccumulator) -> None:
        st = self.state
        per_device = self.cfg.training.per_device_train_batch_size
        for micro in range(self.gas):
            segments = [st.encoder.channel_a_segment(i) for i in st.a_sampler.take(per_device)]
            packs = make_packs(segments, self.cfg.packing_length)
            self._run(packs, segments_in_step=per_device * self.gas, acc=acc, sync_last=micro == self.gas - 1)

    def _channel_b_step(self, step: int, acc: StepAccumulator) -> dict[str, Any]:
        """Step mode: buffer raw samples over the first GAS-1 micro-steps, run the whole B loop on the
        last one (rollout in chunks -> segments -> a variable number of packs), one update after."""
        st = self.state
        budget = st.resolved.rollouts_per_step
        buffered: list[int] = []
        extra: dict[str, Any] = {}
        for micro in range(self.gas):
            share = budget // self.gas + (1 if micro < budget % self.gas else 0)
            buffered += st.b_sampler.take(share)
            if micro < self.gas - 1:
                continue
            seed = rollout_seed(self.cfg.training.seed, step)
            calls_before = self.rollouts.num_generate_calls
            t0 = time.perf_counter()
            generations = self.rollouts.rollout(buffered, seed)
            rollout_s = time.perf_counter() - t0
            segments, stats = build_b_segments(
                buffered,
                generations,
                st.encoder,
                self.cfg.custom.extra.rollout_matching,
                desc_ce_weight=self.desc_ce_weight,
                packing_length=self.cfg.packing_length,
            )
            packs = make_packs(segments, self.cfg.packing_length) if segments else []
            self._run(packs, segments_in_step=max(1, len(segments)), acc=acc, sync_last=True)
            extra = {
                **stats.metrics(),
                "rollout/seed": seed,
                "rollout/num_generate_calls": self.rollouts.num_generate_calls - calls_before,
                "rollout/b_loop_micro_step": micro,
                "time/rollout_s": rollout_s,
            }
        return extra

    def _run(self, packs: list, *, segments_in_step: int, acc: StepAccumulator, sync_last: bool) -> None:
        st = self.state
        run_packs(
            st.ddp_model,
            packs,
            base_model=st.bundle.model,
            segments_in_step=segments_in_step,
            loss_weights=self.loss_weights,
            coord_token_ids=st.coord_token_ids,
            packing_length=self.cfg.packing_length,
            acc=acc,
            sync_last=sync_last,
            device=st.device,
        )

    def _optimizer_update(self) -> float:
        st = self.state
        params = [p for p in st.bundle.model.parameters() if p.requires_grad]
        max_norm = self.cfg.training.max_grad_norm
        if max_norm is not None:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        else:
            grads = [p.grad.detach().norm() for p in params if p.grad is not None]
            grad_norm = float(torch.stack(grads).norm()) if grads else 0.0
        st.optimizer.step()
        st.scheduler.step()
        st.optimizer.zero_grad(set_to_none=True)
        self.num_updates += 1
        return grad_norm

    def _row(
        self,
        step: int,
        kind: str,
        acc: StepAccumulator,
        extra: dict[str, Any],
        grad_norm: float,
        step_s: float,
    ) -> dict[str, Any]:
        st = self.state
        # loss terms: mean over ranks; token/pack counters: sums over ranks
        term_keys = sorted(acc.terms)
        counters = [acc.num_tokens, acc.num_packs, acc.lower_bound, acc.capacity_tokens, acc.num_segments]
        summed = dist.all_reduce_floats([acc.terms[k] for k in term_keys] + [float(c) for c in counters])
        world = self.world.world_size
        terms = {k: v / world for k, v in zip(term_keys, summed[: len(term_keys)], strict=True)}
        tokens, n_packs, lower, capacity, n_segments = (int(v) for v in summed[len(term_keys) :])
        row: dict[str, Any] = {
            "step": step,
            "kind": kind,
            "policy_wants_b": kind == "B",
            "lr": st.scheduler.get_last_lr()[0],
            **terms,
            "grad_norm": grad_norm,
            "tokens": tokens,
            "micro_steps": self.gas,
            "num_backward": acc.num_backward,
            "optimizer_updates": self.num_updates,
            "time/step_s": step_s,
            "time/rollout_s": 0.0,
            "time/wait_s": 0.0,
            "packing/fill": tokens / capacity if capacity else 0.0,
            "packing/n_packs": n_packs,
            "packing/lower_bound": lower,
            "packing/n_segments": n_segments,
        }
        row.update(extra)
        return row

    # ------------------------------------------------------------------ checkpoints and close

    def save(self, step: int) -> None:
        st = self.state
        rng_states = dist.gather_objects(ckpt.rng_state())
        if self.world.is_main:
            assert rng_states is not None

            def save_processors(path: Any) -> None:
                st.bundle.tokenizer.save_pretrained(path)
                st.bundle.image_processor.save_pretrained(path)

            ckpt.save_checkpoint(
                self.cfg.training.output_dir,
                step,
                model=st.bundle.model,
                save_tokenizer=save_processors,
                optimizer=st.optimizer,
                scheduler=st.scheduler,
                rng_states=rng_states,
                trainer_state=ckpt.TrainerState(
                    global_step=step,
                    data_state={
                        "a_consumed": st.a_sampler.num_consumed,
                        "b_consumed": st.b_sampler.num_consumed,
                    },
                    extra={"num_updates": self.num_updates},
                ),
                total_limit=self.cfg.training.save_total_limit,
            )
        dist.barrier()

    def _write_final_state(self, step: int) -> None:
        """Per-rank weight digests (proof that DDP ranks end identical) next to the metrics."""
        digest = weights_digest(self.state.bundle.model)
        digests = dist.gather_objects(digest)
        if self.world.is_main:
            summary = {"global_step": step, "num_updates": self.num_updates, "rank_weight_digests": digests}
            (self.cfg.training.output_dir / "final_state.json").write_text(json.dumps(summary, indent=2))

    def close(self) -> None:
        self.progress.close()
        if self.metrics is not None:
            self.metrics.close()
        dist.teardown()


def weights_digest(model: torch.nn.Module) -> str:
    """sha256 over every parameter's bytes, in name order."""
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
