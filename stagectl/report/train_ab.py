"""Summary of a train-ab run from its metrics rows (pure): step counts, B ratio, losses, rollout F1,
async queue health and throughput.

Rows are those of `metrics.jsonl` (one per optimizer step). Keys that only some runs have
(`rollout/*` on B steps, `stage2_ab/async/*` in async mode) are optional everywhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from stagectl.metric_keys import (
    ASYNC_PREFIX,
    B_STEP_SKIPPED,
    KIND,
    LOSS,
    LOSS_PREFIX,
    PACKING_B_FILL,
    POLICY_WANTS_B,
    ROLLOUT_F1,
    ROLLOUT_PRECISION,
    ROLLOUT_RECALL,
    STEP_S,
    SYNC_BYTES,
    SYNC_DELTA,
    SYNC_MB_PER_S,
    SYNC_STATE_BYTES,
    SYNC_STEP_FRACTION,
    TOKENS,
    WAIT_S,
    WEIGHT_SYNC_S,
)
from stagectl.report.values import Row, last_number, mean, number, ratio, series
from stagectl.schedule import as_fraction

ASYNC = ASYNC_PREFIX
SKIPPED_KEY = B_STEP_SKIPPED


@dataclass(frozen=True)
class TermChange:
    term: str  # "loss" or "loss/<term>"
    first_step: int
    first: float
    last_step: int
    last: float
    min: float


@dataclass(frozen=True)
class Best:
    step: int
    value: float


@dataclass
class TrainAbSummary:
    num_steps: int
    first_step: int
    last_step: int
    num_a: int
    num_b: int
    num_wanted_b: int  # steps the schedule (policy gate) asked to be Channel-B
    skip_steps: list[int]  # wanted B, trained A (async queue not ready)
    target_b_ratio: Fraction | None
    realised_b_ratio: float
    is_async: bool
    terms: list[TermChange] = field(default_factory=list)
    f1_last: Best | None = None
    f1_best: Best | None = None
    precision_last: float | None = None
    recall_last: float | None = None
    drop_stale_total: float | None = None
    drop_oldest_total: float | None = None
    prefetch_success_total: float | None = None
    prefetch_fail_total: float | None = None
    sync_total: float | None = None
    sync_fail_total: float | None = None
    # `final_state.json`'s "b_steps" of a finished run (`learner.channel_b.protocol`): B steps wanted / trained over the
    # whole run and why each other wanted one trained as A; None when the file or the key is absent
    b_steps: dict[str, Any] | None = None
    num_weight_syncs: int = 0  # rows with a successful sync (`weight_sync/bytes` and its time), any mode
    num_delta_syncs: int = 0
    sync_s_total: float = 0.0
    sync_mb_sent: float = 0.0
    sync_mb_state: float = 0.0
    sync_mb_per_s_mean: float | None = None
    sync_step_fraction_mean: float | None = None
    sync_step_fraction_max: float | None = None
    ver_lag_mean: float | None = None
    ver_lag_max: float | None = None
    tokens_total: int = 0
    step_time_total_s: float = 0.0
    tokens_per_s: float | None = None
    mean_step_s_a: float | None = None
    mean_step_s_b: float | None = None
    wait_total_s: float = 0.0
    # Channel-B pack fill (`packing/b_fill`) over the B steps that logged it; None without any
    b_fill_mean: float | None = None
    b_fill_min: float | None = None
    b_fill_min_step: int | None = None


def last_run(rows: Sequence[Row]) -> tuple[list[Row], int]:
    """The rows of the last run in the file and how many earlier rows were left out.

    A fresh run in an existing output_dir appends to metrics.jsonl, so the file can hold several
    runs; a new one starts where `step` stops increasing.
    """
    start = 0
    previous: float | None = None
    for i, row in enumerate(rows):
        step = number(row, "step")
        if step is None:
            continue
        if previous is not None and step <= previous:
            start = i
        previous = step
    return list(rows[start:]), start


def step_rows(rows: Sequence[Row]) -> list[Row]:
    """Only rows that carry an integer-like `step` (anything else is not a step row)."""
    return [row for row in rows if number(row, "step") is not None]


def is_b(row: Row) -> bool:
    return row.get(KIND) == "B"


def wants_b(row: Row) -> bool:
    return bool(row.get(POLICY_WANTS_B)) or number(row, ASYNC + POLICY_WANTS_B) == 1


def is_skip_to_a(row: Row) -> bool:
    """The schedule wanted Channel-B but the step trained Channel-A."""
    return number(row, SKIPPED_KEY) == 1 or (wants_b(row) and row.get(KIND) == "A")


def is_async(rows: Sequence[Row]) -> bool:
    return any(key.startswith(ASYNC) for row in rows for key in row)


def loss_terms(rows: Sequence[Row]) -> list[str]:
    """`loss` first (when logged), then every `loss/<term>` in name order."""
    keys = {
        key for row in rows for key in row if key.startswith(LOSS_PREFIX) and number(row, key) is not None
    }
    total = [LOSS] if any(number(row, LOSS) is not None for row in rows) else []
    return total + sorted(keys)


def realised_b_ratio(rows: Sequence[Row]) -> list[float]:
    """Cumulative share of Channel-B steps after each row (the async logger's `b_ratio_realized`)."""
    out: list[float] = []
    num_b = 0
    for n, row in enumerate(rows, start=1):
        num_b += is_b(row)
        out.append(num_b / n)
    return out


def target_b_ratio(config: dict[str, Any] | None) -> Fraction | None:
    """`stage2_ab.schedule.b_ratio` of the resolved config, exact; None when absent or unreadable."""
    value = config_value(config, "stage2_ab.schedule.b_ratio")
    if not isinstance(value, int | float | str):
        return None
    try:
        return as_fraction(value)
    except ValueError:
        return None


def config_value(config: dict[str, Any] | None, dotted: str) -> Any:
    """`config["a"]["b"]` for "a.b", None anywhere along the way."""
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, dict):
            return None
        node = node.get(part)
    return node


def term_changes(rows: Sequence[Row]) -> list[TermChange]:
    out = []
    for term in loss_terms(rows):
        xs, ys = series(rows, term)
        out.append(TermChange(term, int(xs[0]), ys[0], int(xs[-1]), ys[-1], min(ys)))
    return out


def summarize_train_ab(rows: Sequence[Row], target: Fraction | None) -> TrainAbSummary:
    """Everything report.md states about a train-ab run; `rows` non-empty step rows."""
    if not rows:
        raise ValueError("no metrics rows to summarise")
    steps = [int(number(row, "step") or 0) for row in rows]
    b_rows = [row for row in rows if is_b(row)]
    summary = TrainAbSummary(
        num_steps=len(rows),
        first_step=steps[0],
        last_step=steps[-1],
        num_a=sum(row.get(KIND) == "A" for row in rows),
        num_b=len(b_rows),
        num_wanted_b=sum(wants_b(row) for row in rows),
        skip_steps=[s for s, row in zip(steps, rows, strict=True) if is_skip_to_a(row)],
        target_b_ratio=target,
        realised_b_ratio=len(b_rows) / len(rows),
        is_async=is_async(rows),
        terms=term_changes(rows),
    )
    _add_rollout(summary, rows)
    _add_async(summary, rows)
    _add_weight_syncs(summary, rows)
    _add_throughput(summary, rows)
    _add_b_fill(summary, rows)
    return summary


def _add_rollout(summary: TrainAbSummary, rows: Sequence[Row]) -> None:
    xs, f1 = series(rows, ROLLOUT_F1)
    if not f1:
        return
    summary.f1_last = Best(int(xs[-1]), f1[-1])
    best = max(range(len(f1)), key=lambda i: (f1[i], -i))  # the earliest of equal bests
    summary.f1_best = Best(int(xs[best]), f1[best])
    summary.precision_last = last_number(rows, ROLLOUT_PRECISION)
    summary.recall_last = last_number(rows, ROLLOUT_RECALL)


def _add_async(summary: TrainAbSummary, rows: Sequence[Row]) -> None:
    summary.drop_stale_total = last_number(rows, ASYNC + "drop_stale_total")
    summary.drop_oldest_total = last_number(rows, ASYNC + "drop_oldest_total")
    summary.prefetch_success_total = last_number(rows, ASYNC + "prefetch_success_total")
    summary.prefetch_fail_total = last_number(rows, ASYNC + "prefetch_fail_total")
    summary.sync_total = last_number(rows, ASYNC + "sync_total")
    summary.sync_fail_total = last_number(rows, ASYNC + "sync_fail_total")
    _, lags = series(rows, ASYNC + "ver_lag")
    summary.ver_lag_mean = mean(lags)
    summary.ver_lag_max = max(lags) if lags else None


def _add_weight_syncs(summary: TrainAbSummary, rows: Sequence[Row]) -> None:
    # every row has time/weight_sync_s (0 without a sync); a successful push also logs its bytes
    synced = [
        row for row in rows if number(row, SYNC_BYTES) is not None and number(row, WEIGHT_SYNC_S) is not None
    ]
    summary.num_weight_syncs = len(synced)
    summary.num_delta_syncs = sum(1 for row in synced if number(row, SYNC_DELTA))
    summary.sync_s_total = sum(number(row, WEIGHT_SYNC_S) or 0.0 for row in synced)
    summary.sync_mb_sent = sum(number(row, SYNC_BYTES) or 0.0 for row in synced) / 1e6
    summary.sync_mb_state = sum(number(row, SYNC_STATE_BYTES) or 0.0 for row in synced) / 1e6
    summary.sync_mb_per_s_mean = mean([v for row in synced if (v := number(row, SYNC_MB_PER_S)) is not None])
    fractions = [v for row in synced if (v := number(row, SYNC_STEP_FRACTION)) is not None]
    summary.sync_step_fraction_mean = mean(fractions)
    summary.sync_step_fraction_max = max(fractions) if fractions else None


def _add_throughput(summary: TrainAbSummary, rows: Sequence[Row]) -> None:
    summary.tokens_total = int(sum(number(row, TOKENS) or 0 for row in rows))
    summary.step_time_total_s = sum(number(row, STEP_S) or 0.0 for row in rows)
    summary.wait_total_s = sum(number(row, WAIT_S) or 0.0 for row in rows)
    summary.tokens_per_s = ratio(summary.tokens_total, summary.step_time_total_s)
    a_times = [t for row in rows if row.get(KIND) == "A" and (t := number(row, STEP_S)) is not None]
    b_times = [t for row in rows if is_b(row) and (t := number(row, STEP_S)) is not None]
    summary.mean_step_s_a = mean(a_times)
    summary.mean_step_s_b = mean(b_times)


def _add_b_fill(summary: TrainAbSummary, rows: Sequence[Row]) -> None:
    steps, fills = series(rows, PACKING_B_FILL)
    if not fills:
        return
    summary.b_fill_mean = mean(fills)
    lowest = min(range(len(fills)), key=lambda i: (fills[i], i))  # the earliest of equal lows
    summary.b_fill_min, summary.b_fill_min_step = fills[lowest], int(steps[lowest])


@dataclass(frozen=True)
class EvalSummary:
    num_evals: int
    f1_last: Best
    f1_best: Best
    precision_last: float | None
    recall_last: float | None
    ap_last: Best | None = None  # COCO AP (rows written before it have none)
    ap_best: Best | None = None
    # box vs label at the last eval that has them (older rows have none; docs/evaluation.md)
    ap_agnostic_last: float | None = None
    ap_constant_score_last: float | None = None
    f1_desc_last: float | None = None
    desc_accuracy_last: float | None = None
    pred_desc_top_share_last: float | None = None


def summarize_eval(rows: Sequence[Row]) -> EvalSummary | None:
    """Held-out eval rows `{step, precision, recall, f1, ...}`; None without any F1."""
    xs, f1 = series(rows, "f1")
    if not f1:
        return None
    best = max(range(len(f1)), key=lambda i: (f1[i], -i))
    ap_steps, ap = series(rows, "AP")
    ap_best = max(range(len(ap)), key=lambda i: (ap[i], -i)) if ap else None
    return EvalSummary(
        num_evals=len(f1),
        f1_last=Best(int(xs[-1]), f1[-1]),
        f1_best=Best(int(xs[best]), f1[best]),
        precision_last=last_number(rows, "precision"),
        recall_last=last_number(rows, "recall"),
        ap_last=Best(int(ap_steps[-1]), ap[-1]) if ap else None,
        ap_best=Best(int(ap_steps[ap_best]), ap[ap_best]) if ap_best is not None else None,
        ap_agnostic_last=last_number(rows, "AP_agnostic"),
        ap_constant_score_last=last_number(rows, "AP_constant_score"),
        f1_desc_last=last_number(rows, "f1_desc"),
        desc_accuracy_last=last_number(rows, "desc_accuracy"),
        pred_desc_top_share_last=last_number(rows, "pred_desc_top_share"),
    )
