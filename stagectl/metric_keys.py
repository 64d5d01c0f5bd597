"""Every key `stagectl train-ab` writes to `metrics.jsonl` (one row per optimizer step), declared once: the key,
how ranks are combined into the one value rank 0 logs, its unit, when a row has it, and what it means.

`docs/reference/metrics.md` is generated from `METRICS` (`python -m stagectl.cli.docgen`); a test checks
that every key of a real async run and of the in-process sources (`RolloutStats`, `PhaseTimer`, the loss
terms, the eval keys) is declared here. The report reads its keys from the constants below.

The catalog drives the reduction across ranks: an emitter hands its own values to `stagectl.dist.reduce_metrics`
(one collective), which reduces each key by the reduction declared here (`reduce_ranks`). A `derived` key is
then computed from the reduced values; what it is computed from, where no written key carries it, is declared
in `INPUTS` (reduced, never written). `RolloutStats` sums its counters itself (every one is a sum).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from stagectl.timing import PHASES, phase_key

# How the value rank 0 logs comes from the ranks:
#   sum      summed over ranks            mean  averaged over ranks       min  the smallest rank's
#   derived  computed from summed values (a rate or ratio of sums)
#   none     rank 0's own value: the same on every rank (the schedule, the gradient norm after the
#            gradients were reduced), or measured on rank 0 only (timers, eval, the rollout client)
Reduction = Literal["sum", "mean", "min", "derived", "none"]
# Which rows have the key.
When = Literal["every step", "B steps", "async", "async B steps", "syncs", "eval steps", "optional", "never"]
Number = int | float


@dataclass(frozen=True)
class Metric:
    """One metrics.jsonl key."""

    key: str
    reduction: Reduction
    unit: str  # "" for a label or a count of things named in the doc
    when: When
    doc: str


# ------------------------------------------------------------------ keys the report reads by name

STEP = "step"
KIND = "kind"
POLICY_WANTS_B = "policy_wants_b"
LOSS = "loss"
LOSS_PREFIX = "loss/"
LOSS_CE = "loss/ce"
LOSS_COORD_CE = "loss/coord_ce"
LOSS_BBOX_SMOOTHL1 = "loss/bbox_smoothl1"
LOSS_BBOX_CIOU = "loss/bbox_ciou"
GRAD_NORM = "grad_norm"
TOKENS = "tokens"
UPDATE_NONZERO_FRAC = "optim/update_nonzero_frac"
PACKING_FILL = "packing/fill"
PACKING_FILL_MIN = "packing/fill_min"
PACKING_B_FILL = "packing/b_fill"
PACKING_TOKENS_PER_FORWARD = "packing/tokens_per_forward"
PACKING_N_PACKS = "packing/n_packs"
PACKING_LOWER_BOUND = "packing/lower_bound"
PACKING_N_SEGMENTS = "packing/n_segments"
STEP_S = "time/step_s"
WAIT_S = "time/wait_s"
WEIGHT_SYNC_S = phase_key("weight_sync")
ROLLOUT_F1 = "rollout/f1"
ROLLOUT_PRECISION = "rollout/precision"
ROLLOUT_RECALL = "rollout/recall"
SYNC_BYTES = "weight_sync/bytes"
SYNC_STATE_BYTES = "weight_sync/state_bytes"
SYNC_DELTA = "weight_sync/delta"
SYNC_MB_PER_S = "weight_sync/mb_per_s"
SYNC_STEP_FRACTION = "weight_sync/step_fraction"
ASYNC_PREFIX = "stage2_ab/async/"
B_STEP_SKIPPED = ASYNC_PREFIX + "b_step_skipped_due_to_queue"
EVAL_PREFIX = "eval/"

# ------------------------------------------------------------------ the catalog

_STEP = [
    Metric(
        STEP,
        "none",
        "",
        "every step",
        "The optimizer step this row is for (0-based: row N is the (N+1)-th update). The eval files "
        "(`eval.jsonl`, `eval_samples.jsonl`, `eval_predictions.jsonl`) count updates done, so their step "
        "N+1 is this file's row N, the row that carries that eval's `eval/*` keys.",
    ),
    Metric(KIND, "none", "", "every step", "`A` or `B`: the channel the step trained."),
    Metric(POLICY_WANTS_B, "none", "", "every step", "The schedule asked for a Channel-B step."),
    Metric("lr", "none", "", "every step", "Learning rate after the scheduler's step."),
    Metric(LOSS, "mean", "", "every step", "Total loss of the step (the weighted sum of the terms)."),
    Metric(LOSS_CE, "mean", "nats/token", "every step", "Token cross-entropy."),
    Metric(LOSS_BBOX_SMOOTHL1, "mean", "", "every step", "Box SmoothL1 of the expected coordinates."),
    Metric(LOSS_BBOX_CIOU, "mean", "", "every step", "Box 1 − CIoU (0–2)."),
    Metric(LOSS_COORD_CE, "mean", "nats/token", "every step", "Coordinate-token cross-entropy."),
    Metric(
        "loss/coord_gate",
        "mean",
        "",
        "every step",
        "Coordinate gate: −log P(any coordinate token) in a coordinate slot.",
    ),
    Metric(GRAD_NORM, "none", "", "every step", "Gradient norm before clipping (over every rank's shard)."),
    Metric(TOKENS, "sum", "tokens", "every step", "Tokens trained in the step."),
    Metric("micro_steps", "none", "", "every step", "Gradient-accumulation micro-steps per optimizer step."),
    Metric("num_backward", "none", "", "every step", "Backward passes rank 0 ran in the step."),
    Metric("optimizer_updates", "none", "", "every step", "Optimizer updates made so far."),
    Metric(
        UPDATE_NONZERO_FRAC,
        "derived",
        "",
        "every step",
        "Share of the sampled parameter elements the update changed (0 means the update did nothing).",
    ),
    Metric("optim/loss_scale", "none", "", "optional", "fp16 gradient scaler's scale (fp16 runs only)."),
    Metric(PACKING_FILL, "derived", "", "every step", "Trained tokens / pack capacity."),
    Metric(PACKING_FILL_MIN, "min", "", "every step", "Fill of the emptiest pack on any rank."),
    Metric(
        PACKING_B_FILL,
        "derived",
        "",
        "B steps",
        "Channel-B pack fill: `packing/fill` of a B step, under its own key so that B fill reads without a "
        "row filter (async B packs are built to `training.packing_min_fill_ratio`; `stagectl report` shows "
        "its mean and min).",
    ),
    Metric(PACKING_TOKENS_PER_FORWARD, "derived", "tokens", "every step", "Tokens per packed forward."),
    Metric(PACKING_N_PACKS, "sum", "", "every step", "Packs (forward passes) in the step."),
    Metric(PACKING_LOWER_BOUND, "sum", "", "every step", "Fewest packs the segments could fit in."),
    Metric(PACKING_N_SEGMENTS, "sum", "", "every step", "Samples (segments) packed in the step."),
]

_TIME = [
    Metric(STEP_S, "none", "s", "every step", "Wall seconds of the step on rank 0."),
    Metric(
        "time/rollout_s", "none", "s", "every step", "Rollout generation seconds (step mode; 0 otherwise)."
    ),
    Metric(
        WAIT_S,
        "none",
        "s",
        "every step",
        "Seconds the learner waited for rollouts (step mode) or for the Channel-B decision (async).",
    ),
]
_PHASE_DOCS = {
    "wait_packs": "waiting for Channel-B work (rollouts; async: the prefetcher status and feasibility gate)",
    "collate": "turning rollouts into micro-batches on the learner's thread",
    "forward_backward": "forward and backward passes",
    "optimizer": "clipping, the optimizer and scheduler step",
    "fence": "async weight sync: waiting for the rollout calls in flight",
    "weight_sync": "pushing the weights to the servers",
}
_TIME += [
    Metric(
        phase_key(p),
        "none",
        "s",
        "every step",
        f"Phase seconds of rank 0's learner thread: {_PHASE_DOCS[p]}.",
    )
    for p in PHASES
]
_TIME += [
    Metric("time/learner_thread_cpu_s", "none", "s", "every step", "CPU seconds of the learner's thread."),
    Metric(
        "time/other_threads_cpu_s",
        "none",
        "s",
        "every step",
        "CPU seconds of every other thread of rank 0's process (prefetcher, HTTP, weight push).",
    ),
    Metric("time/prefetch_build_s", "none", "s", "async", "Rank 0's prefetcher seconds building packs."),
    Metric("time/prefetch_collate_s", "none", "s", "async", "Rank 0's prefetcher seconds collating packs."),
    Metric("time/b_gallery_s", "none", "s", "optional", "Seconds writing a Channel-B gallery record."),
]

# `RolloutStats.metrics()`: summed over ranks in async mode; step mode logs rank 0's rollouts
_ROLLOUT = [
    Metric(ROLLOUT_PRECISION, "derived", "", "B steps", "Matched / valid predicted objects."),
    Metric(ROLLOUT_RECALL, "derived", "", "B steps", "Matched / ground-truth objects."),
    Metric(ROLLOUT_F1, "derived", "", "B steps", "F1 of rollout precision and recall."),
    Metric("rollout/n_valid", "sum", "", "B steps", "Valid predicted objects."),
    Metric("rollout/n_dropped", "sum", "", "B steps", "Predicted objects the parser dropped (malformed)."),
    Metric("rollout/n_samples", "sum", "", "B steps", "Rollouts in the step."),
    Metric(
        "rollout/parse_truncated_rate",
        "derived",
        "",
        "B steps",
        "Share of rollouts that ended (token limit or a stop token) before the top-level JSON object closed.",
    ),
    Metric(
        "rollout/invalid_rate",
        "derived",
        "",
        "B steps",
        "Share of rollouts that can never be the answer's JSON object: no opening `{`, or a syntax error "
        "(1 − this − `rollout/parse_truncated_rate` closed as one JSON object).",
    ),
    Metric("rollout/n_too_long", "sum", "", "B steps", "Rollouts too long to pack."),
    Metric("rollout/mean_tokens", "derived", "tokens", "B steps", "Mean rollout length."),
    Metric("rollout/dup_total", "sum", "", "B steps", "Valid predictions duplicating an earlier one."),
    Metric("rollout/dup_rate", "derived", "", "B steps", "Duplicates / valid predictions."),
    Metric("rollout/seed", "none", "", "optional", "Step mode: the rollout seed of the step."),
    Metric("rollout/num_generate_calls", "none", "", "optional", "Step mode: generate calls of the step."),
]

# the rollout client's cumulative counters (rank 0's client)
_CLIENT = [
    Metric("rollout_client/infer_calls", "none", "", "optional", "HTTP inference calls so far."),
    Metric("rollout_client/retries", "none", "", "optional", "Retried calls so far."),
    Metric(
        "rollout_client/splits", "none", "", "optional", "Calls split in halves after failing twice, so far."
    ),
    Metric("rollout_client/failed_calls", "none", "", "optional", "Calls that failed for good so far."),
    Metric("rollout_client/failovers", "none", "", "optional", "A gone server's share re-sent elsewhere."),
]

_SYNC = [
    Metric("weight_sync/total", "none", "", "optional", "Weight syncs so far."),
    Metric("weight_sync/fail_total", "none", "", "optional", "Failed weight syncs so far."),
    Metric("weight_sync/bytes_total", "none", "bytes", "optional", "Bytes pushed so far."),
    Metric(SYNC_BYTES, "none", "bytes", "syncs", "Bytes pushed by this step's sync."),
    Metric(SYNC_STATE_BYTES, "none", "bytes", "syncs", "Size of the full weight state."),
    Metric(SYNC_DELTA, "none", "", "syncs", "1 when the sync sent a delta, 0 when full."),
    Metric(SYNC_MB_PER_S, "derived", "MB/s", "syncs", "Push throughput of this step's sync."),
    Metric(SYNC_STEP_FRACTION, "derived", "", "syncs", "`time/weight_sync_s` / `time/step_s`."),
    Metric(
        "weight_sync/delta_fallbacks", "none", "", "optional", "Delta syncs a server refused (sent full)."
    ),
]


def _async(name: str, reduction: Reduction, unit: str, when: When, doc: str) -> Metric:
    return Metric(ASYNC_PREFIX + name, reduction, unit, when, doc)


_ASYNC = [
    _async("servers_serving", "none", "", "async", "Rollout servers serving the current version."),
    _async("policy_wants_b", "none", "", "async", "1 when the schedule asked for a B step."),
    _async(
        "b_step_skipped_due_to_queue",
        "none",
        "",
        "async",
        "1 when a wanted B step trained A, for any reason (the ledger names it).",
    ),
    _async(
        "ver_lag", "none", "", "async B steps", "Policy versions between the trained packs and the learner."
    ),
    _async(
        "ver_trained", "none", "", "async B steps", "Policy version the trained packs were rolled out with."
    ),
    _async("synced", "none", "", "optional", "1 when the step's weight sync succeeded."),
    _async("queue_depth", "sum", "", "async", "Ready packs queued (summed over ranks)."),
    _async("ver_current", "none", "", "async", "Policy version the learner is at."),
    _async("drop_stale_total", "sum", "", "async", "Packs dropped as too stale so far."),
    _async("drop_oldest_total", "sum", "", "async", "Packs dropped because the queue was full so far."),
    _async("prefetch_success_total", "sum", "", "async", "Prefetch bursts that succeeded so far."),
    _async("prefetch_fail_total", "sum", "", "async", "Prefetch bursts that failed so far."),
    _async("produced_packs_total", "sum", "", "async", "Packs the prefetchers produced so far."),
    _async(
        "rollouts_requested_total",
        "sum",
        "",
        "async",
        "Rollouts the servers answered so far (those of a failed request are asked again or counted in "
        "`stage2_ab/async/rollouts_lost_total`).",
    ),
    _async("rollouts_trained_total", "sum", "", "async", "Rollouts trained so far."),
    _async("rollouts_dropped_total", "sum", "", "async", "Rollouts dropped so far (stale, too long, carry)."),
    _async("drop_rate", "derived", "", "async", "Dropped / answered rollouts (`rollouts_requested_total`)."),
    _async("rollouts_lost_total", "sum", "", "async", "Samples lost to failed bursts so far."),
    _async("bursts_cut_short_total", "sum", "", "async", "Bursts cut short by a waiting sync so far."),
    _async("b_ratio_realized", "none", "", "async", "B steps / steps so far."),
    _async("sync_total", "none", "", "async", "Weight syncs so far."),
    _async("sync_fail_total", "none", "", "async", "Failed weight syncs so far."),
    _async("server_resync_total", "none", "", "async", "Re-syncs of a restarted server so far."),
    _async(
        "rollout_requests_total",
        "sum",
        "",
        "async",
        "Rollout HTTP requests of the prefetchers that the servers answered so far (a failed one counts in "
        "`stage2_ab/async/prefetch_fail_total` and `rollout_client/failed_calls`).",
    ),
    _async("requests_refused_total", "sum", "", "async", "Rollout requests a server refused so far."),
    _async("prefetch_busy_s", "sum", "s", "async", "Prefetcher busy seconds so far."),
    _async("rollout_request_s", "sum", "s", "async", "Seconds in rollout requests so far."),
]

# the evaluator's headline numbers (rank 0), as eval/<name> (stagectl.learner.evaluate.EVAL_LOGGED)
_EVAL = [
    Metric(EVAL_PREFIX + name, "none", "", "eval steps", doc)
    for name, doc in (
        ("AP", "COCO AP (IoU 0.50:0.95)."),
        ("AP50", "COCO AP at IoU 0.50."),
        ("AP75", "COCO AP at IoU 0.75."),
        ("f1", "Detection F1 at the match gate."),
        ("precision", "Detection precision."),
        ("recall", "Detection recall."),
        ("AP_agnostic", "Class-agnostic AP (boxes only)."),
        ("AP_constant_score", "AP with every prediction scored the same."),
        ("f1_desc", "F1 counting a match only when the description is right."),
        ("desc_accuracy", "Share of matched boxes with the right description."),
        ("pred_desc_top_share", "Share of predictions with the most frequent description."),
    )
]

SECTIONS: dict[str, list[Metric]] = {
    "Step": _STEP,
    "Time": _TIME,
    "Channel-B rollouts": _ROLLOUT,
    "Rollout client": _CLIENT,
    "Weight sync": _SYNC,
    "Async Channel-B": _ASYNC,
    "Held-out eval": _EVAL,
}
METRICS: dict[str, Metric] = {m.key: m for section in SECTIONS.values() for m in section}
assert len(METRICS) == sum(len(s) for s in SECTIONS.values()), "a metric key is declared twice"


def undeclared(keys: Iterable[str]) -> list[str]:
    """The keys among `keys` that `METRICS` does not declare, sorted."""
    return sorted(set(keys) - METRICS.keys())


# ------------------------------------------------------------------ reduced across ranks, never written

# what a `derived` key is computed from, where no written key carries it
PACKING_CAPACITY = "packing/capacity_tokens"
UPDATE_CHANGED = "optim/update_changed"
UPDATE_SAMPLED = "optim/update_sampled"
INPUTS: dict[str, Metric] = {
    m.key: m
    for m in (
        Metric(
            PACKING_CAPACITY, "sum", "tokens", "never", "Token capacity of the step's packs (`packing/fill`)."
        ),
        Metric(UPDATE_CHANGED, "sum", "", "never", "Sampled parameter elements the update changed."),
        Metric(UPDATE_SAMPLED, "sum", "", "never", "Parameter elements the update probe sampled."),
    )
}
assert not INPUTS.keys() & METRICS.keys(), "an input is also a written key"


def reduce_ranks(per_rank: Sequence[Mapping[str, Number]]) -> dict[str, Number]:
    """The one value per key from every rank's own values (in rank order), by the key's declared reduction:
    `sum`, `mean`, `min`, or `none` (rank 0's). A sum or minimum of ints stays an int. Every rank must
    hand in the same keys; a `derived` key is computed from reduced values, never reduced itself."""
    if not per_rank:
        raise ValueError("reduce_ranks: no ranks' values")
    keys = list(per_rank[0])
    for rank, rank_values in enumerate(per_rank):
        if rank_values.keys() != set(keys):
            differ = sorted(rank_values.keys() ^ set(keys))
            raise ValueError(f"rank {rank} reduces other metric keys than rank 0: {differ}")
    out: dict[str, Number] = {}
    for key in keys:
        metric = METRICS.get(key) or INPUTS.get(key)
        if metric is None:
            raise ValueError(
                f"metric {key!r} is not declared: add it with its reduction to stagectl/metric_keys.py"
            )
        values = [r[key] for r in per_rank]
        if metric.reduction == "sum":
            out[key] = sum(values)
        elif metric.reduction == "mean":
            out[key] = sum(values) / len(values)
        elif metric.reduction == "min":
            out[key] = min(values)
        elif metric.reduction == "none":
            out[key] = values[0]
        else:
            raise ValueError(f"metric {key!r} is derived: reduce what it is computed from, then compute it")
    return out
