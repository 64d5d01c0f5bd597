"""The optimizer-step driver of `stagectl train-ab`: setup -> step ... -> close.

Per optimizer step `s`: rank 0 decides whether the schedule wants Channel-B and broadcasts it; Channel-B
(`ChannelB`: step or async mode) turns that into the step's decision (async: the feasibility gate); the
kind is fixed for the whole accumulation window; Channel-A runs one micro-batch per micro-step, a B step
runs Channel-B's forward/backward passes; then exactly one optimizer update, Channel-B's after-update work
(an async weight sync when due), and rank 0 appends one metrics row. Which Channel-B a run trains with
(with the rollout client and weight sync it owns) is `channel_b.build`.
"""

from __future__ import annotations

import json
import time
from typing import Any

import torch

from stagectl import dist
from stagectl import metric_keys as mk
from stagectl.config.plan_train import TrainPlan
from stagectl.console import say
from stagectl.files import atomic_write_text
from stagectl.learner import checkpoint as ckpt
from stagectl.learner import saving, sharding
from stagectl.learner.channel_a import ChannelA
from stagectl.learner.channel_b.build import build_channel_b
from stagectl.learner.channel_b.health import RolloutLossError
from stagectl.learner.channel_b.protocol import BStepLedger, SkipReason
from stagectl.learner.evaluate import EVAL_LOGGED, Evaluator
from stagectl.learner.metrics import MetricsWriter, ProgressBar
from stagectl.learner.packs import PackRunner, StepAccumulator
from stagectl.learner.parts import trainable_parameters
from stagectl.learner.precision import UpdateProbe
from stagectl.learner.samples import SampleRecord, SamplesWriter
from stagectl.learner.setup import LearnerState, build_learner
from stagectl.models.vision_attention import describe_attention
from stagectl.packing import packing_lower_bound
from stagectl.rundir.ending import FINAL_STATE, continue_command, mid_step_loss_note
from stagectl.schedule import channel_for_step
from stagectl.stopping import StopSignals
from stagectl.weightsync.errors import WeightPushError
from stagectl.wire.errors import RolloutServerError


class Trainer:
    def __init__(
        self,
        plan: TrainPlan,
        *,
        prefetcher_cpus: tuple[int, ...] | None = None,
        stop_notice: str | None = None,
    ) -> None:
        """`plan`: the run, resolved once by the launcher; `prefetcher_cpus`: the CPUs the async prefetcher
        thread runs on (None: the rank's own); `stop_notice`: the line a first stop signal prints."""
        self.plan = plan
        self.world = dist.read_world()
        self.state: LearnerState = build_learner(plan, self.world)
        st = self.state
        self.b_ratio = plan.b_ratio
        self.gas = st.resolved.gradient_accumulation_steps
        self.runner = PackRunner(
            ddp_model=st.ddp_model,
            base_model=st.bundle.model,
            loss_weights=plan.loss,
            coord_token_ids=st.coord_token_ids,
            packing_length=plan.packing_length,
            device=st.device,
            precision=st.precision,
            grad_scaler=st.grad_scaler,
            fused_linear_cross_entropy=plan.training.kernels.fused_linear_cross_entropy,
        )
        self.params = trainable_parameters(st.bundle.model)
        self.update_probe = UpdateProbe(self.params)
        training = plan.training
        say(
            "train-ab",
            f"{training.parallelism} over {self.world.world_size} rank(s), master weights "
            f"{st.precision.param_dtype_name}, compute {training.mixed_precision}, storage {plan.model.torch_dtype}, "
            f"attention {describe_attention(st.bundle.model)}; "
            f"trainable {st.freeze.num_trainable:,} of {st.freeze.num_trainable + st.freeze.num_frozen:,} parameters"
            + (f" (frozen: {', '.join(st.freeze.frozen_parts)})" if st.freeze.frozen_parts else ""),
        )
        self.num_updates = int(st.extra_state.get("num_updates", 0))
        saved_b_steps = st.extra_state.get("rank_state", {}).get("b_steps")
        # B steps wanted / trained (and why not) over the whole run; a checkpoint older than it: from here on
        self.b_steps = BStepLedger.from_dict(saved_b_steps) if saved_b_steps else BStepLedger()
        # the steps completed and their ledger (a failed run's final_state.json: not the step that failed)
        self.steps_done, self.b_steps_done = st.start_step, self.b_steps.as_dict()
        self.channel_a = ChannelA(st, self.runner)
        self.channel_b = build_channel_b(
            st.plan.channel_b, st, self.runner, num_updates=self.num_updates, prefetcher_cpus=prefetcher_cpus
        )
        self.metrics = (
            MetricsWriter.for_training(training, plan.run_config, resume_step=st.start_step)
            if self.world.is_main
            else None
        )
        resume_step = st.start_step if st.resumed_from is not None else None
        self.samples = (
            SamplesWriter(training.output_dir, resume_step=resume_step) if self.world.is_main else None
        )
        self._step_samples: tuple[int, list[list[SampleRecord]]] = (-1, [])  # rank 0: the last step's
        self.progress = ProgressBar(training.max_steps, st.start_step, enabled=self.world.is_main)
        self.evaluator = (
            Evaluator(plan.eval, training, st.bundle, st.encoder.vocab, resume_step=st.start_step)
            if self.world.is_main
            else None
        )
        self._stop = StopSignals(notice=stop_notice)  # SIGTERM/SIGINT: save after the step; a second: at once
        # why the last step trained as Channel-A where the schedule wanted B (its console line says so)
        self._b_skipped: SkipReason | None = None

    # ------------------------------------------------------------------ run

    def run(self) -> int:
        """Train to `max_steps` (or until SIGTERM/SIGINT, which saves first); returns the last step.
        Every collective runs inside a named watchdog phase; the end is orderly (see `close`)."""
        cfg = self.plan.training
        step = self.state.start_step
        finished = False
        try:
            with self._stop:  # the previous handlers are back before `close`
                self.channel_b.start()
                while step < cfg.max_steps:
                    try:
                        row = self.train_step(step)
                    except RolloutLossError as exc:  # every rank, between two steps: save, then stop
                        raise RolloutLossError(f"{exc}; {self._save_for_resume(step)}", exc.step) from None
                    except (WeightPushError, RolloutServerError) as exc:  # step mode: lost inside a B step
                        raise dist.SharedError(mid_step_loss_note(step, exc, self.plan.output_dir)) from None
                    step += 1
                    if step == self.state.start_step + 1 and self.world.is_main:  # a resumed run goes on:
                        (self.plan.output_dir / FINAL_STATE).unlink(missing_ok=True)  # its old end is past
                    row.update(self._maybe_evaluate(step))  # eval/AP, eval/AP50, eval/f1, ... on eval steps
                    # the step's row, then its samples' lines, then the count: a run killed or failed in the
                    # eval has none of them (samples.jsonl had the step's lines, metrics.jsonl no row)
                    if self.metrics is not None:
                        self.metrics.write(row)
                    if self.samples is not None:
                        self.samples.write(*self._step_samples)
                    self.steps_done, self.b_steps_done = step, self.b_steps.as_dict()
                    self.progress.update(
                        step - 1, row, log=step % cfg.logging_steps == 0, b_skipped=self._b_skipped
                    )
                    with dist.phase("stop-signal broadcast", "step_s"):
                        stop = dist.broadcast_object(self._stop.requested)
                    if cfg.saves_checkpoint(step) or stop:
                        self.save(step)
                    if stop:
                        break
                self._write_final_state(step)
                finished = True
                return step
        finally:
            self.close(finished=finished)

    def _maybe_evaluate(self, step: int) -> dict[str, float]:
        """Greedy eval on rank 0 when due (the other ranks wait at the barrier); its headline numbers as
        `eval/*` keys for the step's metrics row (empty when no eval ran here)."""
        logged: dict[str, float] = {}
        with dist.phase("held-out eval", "eval_s"):
            main_due = self.evaluator is not None and self.evaluator.due(step, self.plan.training.max_steps)
            if not dist.broadcast_object(main_due):
                return logged
            # fsdp: every rank unshards, so rank 0 generates with no collective per forward
            with sharding.gathered(self.state.bundle.model):
                if self.evaluator is not None:
                    row = self.evaluator.run(step)
                    logged = {f"eval/{k}": float(row[k]) for k in EVAL_LOGGED}
                    self.progress.note(
                        f"eval step {step}: AP={row['AP']:.3f} AP50={row['AP50']:.3f} "
                        f"f1={row['f1']:.3f} precision={row['precision']:.3f} "
                        f"recall={row['recall']:.3f} valid_json={row['valid_json_rate']:.2f}"
                    )
                dist.barrier()
        return logged

    @property
    def stopped_by_signal(self) -> int | None:
        """The first stop signal (the run saves after its step and ends), None when none came."""
        return self._stop.signum

    @property
    def aborted_by_signal(self) -> int | None:
        """A second signal: the run stopped at once, no checkpoint."""
        return self._stop.aborted_by

    # ------------------------------------------------------------------ one optimizer step

    def train_step(self, step: int) -> dict[str, Any]:
        started = time.perf_counter()
        self.runner.timer.reset()
        acc = StepAccumulator()
        # rank 0 decides, every rank follows (the schedule is pure, but one decider rules out drift)
        with dist.phase("step-kind broadcast", "step_s"):
            wants_b = bool(
                dist.broadcast_object(
                    channel_for_step(step, self.b_ratio) == "B" if self.world.is_main else False
                )
            )
        with dist.phase("Channel-B decision (prefetcher status, feasibility gate)", "step_s"):
            decision, extra = self.channel_b.decide(step, wants_b)
        self.b_steps.record(wants_b, decision.kind, decision.reason)
        self._b_skipped = decision.reason
        if decision.kind == "B":
            extra.update(self.channel_b.run(step, decision, acc))
        else:
            self.channel_a.run(self.gas, acc)
        with self.runner.timer.time("optimizer"):
            grad_norm, (changed, sampled) = self._optimizer_update()
        extra.update(self.channel_b.after_update(self.num_updates))
        with dist.phase("metrics reduction", "step_s"):
            extra.update(self.channel_b.metrics())
            self._log_samples(step, acc.samples)
            if self.state.grad_scaler is not None:
                extra["optim/loss_scale"] = float(self.state.grad_scaler.get_scale())
            return self._row(
                step,
                decision.kind,
                wants_b,
                acc,
                (changed, sampled),
                extra,
                grad_norm,
                time.perf_counter() - started,
            )

    def _log_samples(self, step: int, records: list[SampleRecord]) -> None:
        """Every rank's trained samples of the step, gathered to rank 0; `run` appends them to
        `samples.jsonl` right after the step's metrics row."""
        per_rank = dist.gather_objects(records)
        if self.samples is not None:
            assert per_rank is not None
            self._step_samples = (step, per_rank)

    def _optimizer_update(self) -> tuple[float, tuple[int, int]]:
        """Clip, step, schedule; returns the gradient norm (before clipping) and this rank's
        (changed, sampled) element counts of the update probe."""
        st = self.state
        scaler = st.grad_scaler
        if scaler is not None:
            scaler.unscale_(st.optimizer)  # clip and report the true gradient norm
        max_norm = self.plan.training.max_grad_norm
        # inf: the norm without clipping; a DTensor under fsdp (the norm over every rank's shard)
        total = torch.nn.utils.clip_grad_norm_(
            [p for p in self.params if p.grad is not None], max_norm if max_norm is not None else float("inf")
        )
        grad_norm = float(sharding.full_tensor(total))
        self.update_probe.before_step()
        if scaler is not None:
            scaler.step(st.optimizer)  # skipped when the scaled gradients overflowed
            scaler.update()
        else:
            st.optimizer.step()
        changed = self.update_probe.after_step()
        st.scheduler.step()
        st.optimizer.zero_grad(set_to_none=True)
        self.num_updates += 1
        return grad_norm, changed

    def _row(
        self,
        step: int,
        kind: str,
        wants_b: bool,
        acc: StepAccumulator,
        update_counts: tuple[int, int],
        extra: dict[str, Any],
        grad_norm: float,
        step_s: float,
    ) -> dict[str, Any]:
        """The step's metrics row. This rank's loss terms, token and pack counters and update-probe counts
        are reduced over ranks once, each by its declared reduction (`stagectl.metric_keys`); the ratios are
        computed from the reduced values."""
        st = self.state
        lower_bound = (
            packing_lower_bound(acc.segment_lengths, self.runner.packing_length) if acc.num_packs else 0
        )
        changed, sampled = update_counts
        r = dist.reduce_metrics(
            {
                **{k: acc.terms[k] for k in sorted(acc.terms)},  # loss terms: mean
                mk.TOKENS: acc.num_tokens,
                mk.PACKING_N_PACKS: acc.num_packs,
                mk.PACKING_LOWER_BOUND: lower_bound,
                mk.PACKING_N_SEGMENTS: acc.num_segments,
                mk.PACKING_FILL_MIN: acc.min_fill,
                mk.PACKING_CAPACITY: acc.capacity_tokens,
                mk.UPDATE_CHANGED: changed,
                mk.UPDATE_SAMPLED: sampled,
            }
        )
        tokens, n_packs, capacity = r[mk.TOKENS], r[mk.PACKING_N_PACKS], r[mk.PACKING_CAPACITY]
        changed_sum, sampled_sum = r[mk.UPDATE_CHANGED], r[mk.UPDATE_SAMPLED]
        row: dict[str, Any] = {
            mk.STEP: step,
            mk.KIND: kind,
            mk.POLICY_WANTS_B: wants_b,
            "lr": st.scheduler.get_last_lr()[0],
            **{k: r[k] for k in sorted(acc.terms)},
            mk.GRAD_NORM: grad_norm,
            mk.TOKENS: tokens,
            "micro_steps": self.gas,
            "num_backward": acc.num_backward,
            "optimizer_updates": self.num_updates,
            mk.STEP_S: step_s,
            "time/rollout_s": 0.0,
            mk.WAIT_S: 0.0,
            mk.PACKING_FILL: tokens / capacity if capacity else 0.0,
            mk.PACKING_FILL_MIN: r[mk.PACKING_FILL_MIN] if n_packs else 0.0,
            mk.PACKING_TOKENS_PER_FORWARD: tokens / n_packs if n_packs else 0.0,
            mk.PACKING_N_PACKS: n_packs,
            mk.PACKING_LOWER_BOUND: r[mk.PACKING_LOWER_BOUND],
            mk.PACKING_N_SEGMENTS: r[mk.PACKING_N_SEGMENTS],
            mk.UPDATE_NONZERO_FRAC: changed_sum / sampled_sum if sampled_sum else 0.0,
        }
        if kind == "B":
            row[mk.PACKING_B_FILL] = row[mk.PACKING_FILL]
        row.update(extra)
        row.update(self.runner.timer.row())  # time/<phase>_s; time/weight_sync_s: the learner's wall
        if (
            row.get("time/weight_sync_s", 0.0) > 0 and step_s > 0
        ):  # a step that synced (the catalog's "syncs")
            row[mk.SYNC_STEP_FRACTION] = row["time/weight_sync_s"] / step_s
        return row

    # ------------------------------------------------------------------ checkpoints and close

    def save(self, step: int) -> None:
        """Checkpoint `step`: rank 0 writes, with every rank's RNG state and stream positions."""
        st = self.state
        with dist.phase("checkpoint", "checkpoint_s"):
            gathered = dist.gather_objects((ckpt.rng_state(), self._rank_state()))
            model_state, sharded_dir = saving.model_state_to_save(st, step, is_main=self.world.is_main)
            if self.world.is_main:
                assert gathered is not None
                rank_states = [g[1] for g in gathered]
                extra: dict[str, Any] = {"num_updates": self.num_updates}
                extra.update(self.channel_b.saved_version())
                async_states = None
                if "async" in rank_states[0]:  # to async_state.pt, not the JSON
                    async_states = [r.pop("async") for r in rank_states]
                saving.write_checkpoint(
                    st,
                    step,
                    [g[0] for g in gathered],
                    rank_states,
                    world_size=self.world.world_size,
                    extra=extra,
                    async_states=async_states,
                    model_state=model_state,
                    sharded_dir=sharded_dir,
                )
            del model_state
            dist.barrier()

    def _rank_state(self) -> dict[str, Any]:
        """This rank's stream positions: what a resumed run continues from on this rank."""
        st = self.state
        return {
            "a_consumed": st.a_sampler.num_consumed,
            "b_consumed": st.b_sampler.num_consumed,
            **self.channel_a.buffer_state(),
            **self.channel_b.rank_state(),
            "b_steps": self.b_steps.as_dict(),
        }

    def _save_for_resume(self, step: int) -> str:
        """Every rank, a run that must stop between steps: a checkpoint of `step` (unless one is there or
        nothing was trained since the start); where to resume from."""
        out = self.plan.output_dir
        if step > self.state.start_step and not (out / f"checkpoint-{step}").is_dir():
            self.save(step)
        latest = ckpt.list_checkpoints(out)
        if not latest:
            return "no checkpoint was written yet (nothing to resume from)"
        return f"the latest checkpoint is {latest[-1]}; once a server answers, continue with: {continue_command(out)}"

    def _write_final_state(self, step: int) -> None:
        """How the run ended (steps done of `max_steps`, the stop signal) and per-rank weight digests (proof
        that DDP ranks end identical; under fsdp the digest of the gathered weights, the same on every
        rank) next to the metrics."""
        model = self.state.bundle.model
        with dist.phase("final weight digests", "step_s"):
            digest = saving.weights_digest(model)
        with dist.phase("final weight digests", "step_s"):
            digests = dist.gather_objects(digest)
        if self.world.is_main:
            summary = {
                "global_step": step,
                "max_steps": self.plan.training.max_steps,
                # a run stopped early by SIGTERM/SIGINT says so (rundir.ending.run_end: not "finished")
                "stopped_by_signal": self._stop.signum if step < self.plan.training.max_steps else None,
                "num_updates": self.num_updates,
                "rank_weight_digests": digests,
                "b_steps": self.b_steps.as_dict(),
            }
            atomic_write_text(self.plan.output_dir / FINAL_STATE, json.dumps(summary, indent=2))

    def close(self, *, finished: bool) -> None:
        """The orderly end of the run on this rank: stop and join the prefetcher (its HTTP sessions
        closed first), close the sinks, release the DDP wrapper, then meet every rank at one final
        barrier and destroy the process group (`dist.teardown`). After a failure the barrier is skipped:
        peers may be gone, and the launcher ends them."""
        try:
            with dist.phase("shutdown: stop the prefetcher", "shutdown_s"):
                # half the phase's deadline: a stuck thread is reported by name, not by the watchdog
                self.channel_b.close(deadline_s=self.plan.watchdog.shutdown_s / 2)
        finally:
            self.progress.close()
            if self.metrics is not None:
                self.metrics.close()
            if self.samples is not None:
                self.samples.close()
            self.state.ddp_model = None  # before the process group: see dist.teardown
            self.runner.ddp_model = None
            dist.teardown(final_barrier=finished)
