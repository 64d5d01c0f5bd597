"""`stage2_ab` section: the channel schedule, Channel-B mode and loss weights."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from stagectl.config.base import StrictModel
from stagectl.config.fractions import as_fraction


class ScheduleConfig(StrictModel):
    b_ratio: float | str | None = None
    """Fraction of optimizer steps that are Channel-B: a number in [0, 1] or a fraction text like
    `1/3` (0.0 = Channel-A only, 1.0 = Channel-B only). Required. Evaluated exactly (as a fraction)."""

    @field_validator("b_ratio")
    @classmethod
    def _check_ratio(cls, value: float | str | None) -> float | str | None:
        if value is None:
            return None
        ratio = as_fraction(value)
        if not 0 <= ratio <= 1:
            raise ValueError(f"b_ratio must be in [0, 1] (0.0 = A only, 1.0 = B only), got {value}")
        return value


class AsyncConfig(StrictModel):
    queue_limit: int = Field(8, ge=1)
    """Ready packs kept per rank; the oldest is dropped when full."""
    version_window: int = Field(1, ge=0)
    """Packs with `ver < current_ver - version_window` are stale: dropped, never trained."""
    prefetch_target_packs: int = Field(4, ge=1)
    """The prefetcher stops requesting rollouts while queued + in-flight packs reach this."""
    sync_every_steps: int = Field(1, ge=1)
    """Push full weights to the rollout servers every N optimizer steps (`ver += 1`)."""
    max_consecutive_failures: int = Field(3, ge=1)
    """The prefetcher's error reaches the learner after this many consecutive failed rollouts."""
    in_flight_sync: bool = True
    """A weight sync does not wait for the rollout calls in flight: the servers swap the new weights in
    between calls, the burst in flight finishes at its own version (still inside `version_window`), and a
    B step whose packs it is making waits for it there instead (`time/wait_packs_s`). Needs
    stagectl rollout servers (they answer `/version/` with `version_tags`). False: a sync closes the fence
    and waits for the burst in flight (docs/placement.md, "Where the learner's time goes")."""


class ChannelBMatchConfig(StrictModel):
    assignment: Literal["hungarian", "greedy_iou"] = "hungarian"
    """`hungarian`: the pairing of least total cost (sum of 1 - IoU, `fp_cost` per FP, `fn_cost` per miss).
    `greedy_iou`: the highest-IoU pair first, then the next among the free ones (COCO-style). The IoU gate
    and costs are `custom.extra.rollout_matching`'s for both."""
    desc_gated: bool = False
    """Only a prediction whose desc equals the GT's (exact text) can match it: a wrong-label prediction is
    an FP (masked / dropped from the target) and its GT a miss (appended with its desc). False: boxes alone
    decide, and a wrong label is left to `desc_ce_weight_matched`."""


class ChannelBConfig(StrictModel):
    mode: Literal["step", "async"] = "step"
    """`step`: rollouts inside the optimizer step (one learner rank). `async`: per-rank prefetcher."""
    rollouts_per_step: int | None = Field(None, ge=1)
    """Raw rollouts per B step (default per_device_train_batch_size x world_size x GAS)."""
    rollout_decode_batch_size: int | None = Field(None, ge=1)
    """Samples per generate call / rollout request (default `rollout_matching.decode_batch_size`)."""
    enable_pipeline: bool = False
    """Step mode with server rollouts: a producer thread overlaps rollout with learning in the step."""
    target: Literal["raw_prefix", "clean_prefix", "reordered_gt"] = "raw_prefix"
    """How a rollout becomes the B target (docs/training.md, "Channel-B targets"). `raw_prefix` (the
    step-mode seed's contract): the rollout's own token prefix, FP and invalid entries masked, missed GT
    appended. `clean_prefix`: the matched predictions re-serialised in canonical form (rollout order), FP,
    invalid and duplicate predictions dropped from the text, missed GT appended (or everything sorted, see
    `insertion_order`). `reordered_gt` (the async design seed's `y_train_ids`): the ground-truth objects the
    rollout found, in the order it found them, written with their GT desc and GT box, then the missed ones;
    all teacher-forced, matched descs weighted by `desc_ce_weight_matched`."""
    desc_ce_weight_matched: float = Field(0.0, ge=0)
    """CE weight toward the ground-truth desc of a matched object whose rollout desc differs from it (exact
    text). With `raw_prefix` / `clean_prefix` and a weight > 0 such an object is written with the GT desc in
    place of its own (its box stays the rollout's); 0 keeps the rollout's desc with CE 0 (the behaviour
    before this key). With `reordered_gt` every matched object is written with its GT desc and this is the
    weight of those descs."""
    mask_correct_matched_desc: bool = True
    """A matched object whose rollout desc already equals its GT desc gets desc CE 0 (upstream's gate);
    false: it gets `desc_ce_weight_matched` like a wrong one (a positive label signal for found objects)."""
    insertion_order: Literal["tail_append", "sorted"] = "tail_append"
    """`clean_prefix` only (`sorted` with `raw_prefix` is refused): `tail_append` puts the missed GT objects after the kept predictions; `sorted`
    writes kept and missed objects together in answer order (top-to-bottom, then left-to-right)."""
    duplicate_iou_threshold: float = Field(0.7, gt=0, le=1)
    """A valid prediction whose IoU with an earlier accepted prediction of the same desc is at least this
    is a duplicate: counted (`rollout/dup_total`, `rollout/dup_rate`) and, with `clean_prefix`, dropped."""
    match: ChannelBMatchConfig = Field(default_factory=ChannelBMatchConfig)
    """How a rollout's predictions are paired with the ground truth for the B target."""
    gallery_steps: int = Field(4, ge=0)
    """Channel-B gallery (step and async mode): record one rollout of this many B steps, spread over
    `training.max_steps`, into `{output_dir}/b_gallery/` (the image, the verdict per object, the appended
    misses, the target's CE and geometry tokens; `stagectl report` shows them); 0: none."""
    on_rollout_loss: Literal["stop", "continue_a_only"] = "stop"
    """What train-ab does when no rollout server can serve (down, or restarted and not yet re-synced) for
    longer than `rollout_loss_timeout_s` (server rollouts: `rollout_backend: vllm`). `stop`: a B step without
    queued packs waits for a server (one that restarted is re-synced in full and used again; an async B
    step trains the packs queued before the outage first), and past the timeout the run
    writes a checkpoint and exits non-zero naming the servers, the last error, the step and the checkpoint
    to resume from. `continue_a_only`: B steps without packs train as Channel-A meanwhile, each with a
    warning line, and the end-of-run summary counts them (`no_server`)."""
    rollout_loss_timeout_s: float = Field(300.0, gt=0)
    """How long no rollout server may be able to serve before `on_rollout_loss` applies (seconds). On
    several ranks a B step waits inside the step's watchdog phase: the wait then ends at 80% of
    `launch.watchdog.step_s` if that comes first."""
    b_ratio_tolerance: float = Field(0.05, ge=0, le=1)
    """The end of a run warns when its realized B ratio (B steps trained / steps) is further than this from
    the schedule's (B steps wanted / steps)."""
    async_: AsyncConfig = Field(default_factory=AsyncConfig, alias="async")
    """Async-mode queue and sync settings."""


class Stage2ABConfig(StrictModel):
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)
    """Which optimizer steps are Channel-B."""
    channel_b: ChannelBConfig = Field(default_factory=ChannelBConfig)
    """Channel-B rollout mode."""
    desc_ce_weight: float = Field(1.0, ge=0)
    """CE weight of desc tokens of the missed GT objects appended to a Channel-B target (Channel-A desc
    tokens use 1.0; matched objects' descs: `channel_b.desc_ce_weight_matched`)."""
    bbox_smoothl1_weight: float = Field(1.0, ge=0)
    """Weight of SmoothL1 between the expected box and the GT box (both in [0, 1])."""
    bbox_smoothl1_beta: float = Field(0.05, gt=0)
    """SmoothL1's `beta` in box units of [0, 1] (quadratic below it, linear above). 0.05 (about 50 bins)
    keeps a useful gradient on boxes a few bins off; torch's and upstream's default 1.0 is quadratic over
    the whole [0, 1] range, a gradient that vanishes as the box converges (docs/training.md, "Loss parity")."""
    bbox_ciou_weight: float = Field(1.0, ge=0)
    """Weight of (1 - CIoU) between the expected box and the GT box."""
    coord_ce_weight: float = Field(0.0, ge=0)
    """Weight of CE on coordinate tokens toward the exact GT bin (0 = geometry loss only)."""
    coord_ce_vocab: Literal["full", "coord"] = "full"
    """The softmax `coord_ce_weight`'s CE runs over: `full`, the whole vocabulary (equal to the `coord`
    CE plus the coordinate gate's -log P(any coordinate token)); `coord`, the 1000 coordinate tokens alone
    (upstream's; pair it with `coord_gate_weight: 0` for upstream's loss)."""
    coord_gate_weight: float = Field(1.0, ge=0)
    """Weight of -log P(any coordinate token) at coordinate slots: teaches the model to emit a coordinate
    token there at all (the geometry softmax is restricted to coordinate tokens and cannot)."""
