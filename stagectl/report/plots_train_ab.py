"""The PNG plots of a train-ab run. Each function draws one file, or says why it cannot."""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction
from pathlib import Path

from matplotlib.ticker import AutoLocator

from stagectl.metric_keys import (
    GRAD_NORM,
    LOSS,
    LOSS_BBOX_CIOU,
    LOSS_BBOX_SMOOTHL1,
    LOSS_CE,
    LOSS_COORD_CE,
    ROLLOUT_F1,
    STEP_S,
    TOKENS,
    UPDATE_NONZERO_FRAC,
    WAIT_S,
)
from stagectl.report.markdown import fmt_ratio
from stagectl.report.plots_phases import phase_plot
from stagectl.report.plotting import (
    B_COLOR,
    count_axis,
    fraction_axis,
    label_axes,
    line_marker_size,
    mark_x,
    new_figure,
    note_empty,
    point_size,
    save,
)
from stagectl.report.sections import Figures, Plot, Skipped
from stagectl.report.train_ab import (
    ASYNC,
    is_async,
    is_b,
    is_skip_to_a,
    loss_terms,
    realised_b_ratio,
    wants_b,
)
from stagectl.report.values import Row, number, series

STEP = "optimizer step"
SKIP_LABEL = "skip-to-A (wanted B, queue not ready)"
NOT_ASYNC = "step-mode run (no `stage2_ab/async/*` metrics)"
# precision / recall / F1: distinct line styles, so equal values (often all 0 early on) stay visible
PRF = (("precision", "precision", "s", "--"), ("recall", "recall", "^", ":"), ("f1", "F1", "o", "-"))
AP_LINES = (("AP", "AP (.50:.95)", "D", "-"), ("AP50", "AP50", "v", "-."))  # COCO, from the same eval rows
# box vs label (rows written before them have none): class-agnostic AP, desc accuracy, the desc-aware F1
LABEL_LINES = (
    ("AP_agnostic", "AP class-agnostic", "d", ":"),
    ("desc_accuracy", "desc accuracy (matched)", "x", "--"),
    ("f1_desc", "F1 desc-aware", "P", "-"),
)
TERM_LABELS = {
    LOSS: ("total loss (weighted sum of terms)", "loss (unitless)"),
    LOSS_CE: ("token cross-entropy", "CE (nats/token)"),
    LOSS_COORD_CE: ("coordinate-token cross-entropy", "CE (nats/token)"),
    LOSS_BBOX_SMOOTHL1: ("box SmoothL1 (expected coordinates)", "SmoothL1 (unitless)"),
    LOSS_BBOX_CIOU: ("box 1 − CIoU", "1 − CIoU (unitless, 0–2)"),
}


def write_train_ab_plots(
    rows: Sequence[Row], eval_rows: Sequence[Row], target: Fraction | None, out_dir: Path
) -> Figures:
    figures = Figures()
    skips = [number(r, "step") or 0.0 for r in rows if is_skip_to_a(r)]
    figures.add(loss_plot(rows, skips, out_dir))
    figures.add(rollout_plot(rows, out_dir))
    if eval_rows:
        figures.add(eval_plot(eval_rows, out_dir))
        last = eval_rows[-1]
        figures.add(pr_curve_plot(last, f"Last held-out eval (step {last.get('step')})", out_dir))
    else:  # listed with its reason like every plot that does not apply
        figures.add(
            Skipped(
                "held-out eval and its precision-recall curve",
                "no eval.jsonl rows: the run had no held-out eval (set data.eval; `stagectl eval` scores a "
                "checkpoint afterwards)",
            )
        )
    figures.add(b_ratio_plot(rows, target, skips, out_dir))
    figures.add(queue_plot(rows, out_dir))
    figures.add(drops_plot(rows, skips, out_dir))
    figures.add(timing_plot(rows, out_dir))
    figures.add(phase_plot(rows, out_dir))
    figures.add(optimizer_plot(rows, out_dir))
    return figures


def loss_plot(rows: Sequence[Row], skips: list[float], out_dir: Path) -> Plot | Skipped:
    terms = loss_terms(rows)
    if not terms:
        return Skipped("loss per term", "no `loss` keys in metrics.jsonl")
    fig, axes = new_figure(len(terms), ncols=2 if len(terms) > 1 else 1, title="Training loss per term")
    b_rows = [r for r in rows if is_b(r)]
    for ax, term in zip(axes, terms, strict=True):
        title, ylabel = TERM_LABELS.get(term, (term, f"{term} (unitless)"))
        xs, ys = series(rows, term)
        ax.plot(xs, ys, color="tab:blue", linewidth=1.4, label="every step")
        bx, by = series(b_rows, term)
        ax.scatter(bx, by, color=B_COLOR, s=point_size(len(bx)), zorder=3, label="Channel-B step")
        mark_x(ax, skips, SKIP_LABEL)
        if ys and max(ys) == min(ys) == 0:
            title += " (0 throughout)"
        label_axes(ax, f"{title}  [{term}]", STEP, ylabel, legend="inside" if ax is axes[0] else "none")
    name = "loss.png"
    save(fig, out_dir / name)
    caption = "Every logged loss term per optimizer step; orange dots are Channel-B steps"
    caption += ", dashed red lines skip-to-A steps." if skips else "."
    return Plot(name, "Loss per term", caption)


def rollout_plot(rows: Sequence[Row], out_dir: Path) -> Plot | Skipped:
    b_rows = [r for r in rows if number(r, ROLLOUT_F1) is not None]
    if not b_rows:
        return Skipped("rollout precision/recall/F1", "no Channel-B step with rollout metrics in this run")
    fig, (ax, ax_valid) = new_figure(2, title="Channel-B rollouts (the rollouts each B step trained on)")
    for key, label, marker, style in PRF:
        xs, ys = series(b_rows, f"rollout/{key}")
        ax.plot(
            xs,
            ys,
            marker=marker,
            markersize=line_marker_size(len(xs)),
            linestyle=style,
            linewidth=1.4,
            label=label,
        )
    fraction_axis(ax)
    label_axes(ax, "rollout precision / recall / F1 against the ground truth", STEP, "score (0–1)")
    for key, label in (("invalid_rate", "invalid (unparseable)"), ("parse_truncated_rate", "truncated")):
        xs, ys = series(b_rows, f"rollout/{key}")
        ax_valid.plot(xs, ys, marker="o", markersize=line_marker_size(len(xs)), linewidth=1.3, label=label)
    fraction_axis(ax_valid)
    label_axes(ax_valid, "rollouts that failed the strict parse", STEP, "fraction of rollouts (0–1)")
    name = "rollout.png"
    save(fig, out_dir / name)
    return Plot(name, "Rollout precision / recall / F1", "Per Channel-B step, on that step's own rollouts.")


def eval_plot(eval_rows: Sequence[Row], out_dir: Path) -> Plot | Skipped:
    if not series(eval_rows, "f1")[1]:
        return Skipped("held-out eval", "eval.jsonl has no `f1` values")
    fig, (ax,) = new_figure(1, title="Held-out evaluation (COCO AP; precision / recall / F1 at IoU 0.5)")
    for key, label, marker, style in (*PRF, *AP_LINES, *LABEL_LINES):
        xs, ys = series(eval_rows, key)
        if not xs:
            continue  # rows written before the COCO / label metrics
        ax.plot(
            xs,
            ys,
            marker=marker,
            markersize=line_marker_size(len(xs)),
            linestyle=style,
            linewidth=1.4,
            label=label,
        )
    fraction_axis(ax)
    label_axes(ax, "eval AP / precision / recall / F1", STEP, "score (0–1)")
    name = "eval.png"
    save(fig, out_dir / name)
    return Plot(
        name,
        "Held-out eval",
        "Rows of `eval.jsonl`: COCO AP (IoU .50:.95), AP50 and class-agnostic AP next to the box-only F1, the "
        "desc-aware F1 and desc accuracy on matched pairs (box vs label: docs/evaluation.md).",
    )


def pr_curve_plot(metrics: Row, title: str, out_dir: Path) -> Plot | Skipped:
    """The precision-recall curve of one eval (IoU 0.5, all sizes, 100 detections, mean over classes)."""
    curve = metrics.get("pr_curve_iou50")
    if not isinstance(curve, dict) or not curve.get("recall"):
        return Skipped("precision-recall curve", "the eval has no `pr_curve_iou50`")
    fig, (ax,) = new_figure(1, title=title)
    ax.plot(curve["recall"], curve["precision"], linewidth=1.6, label=f"AP50 = {metrics.get('AP50', 0):.3f}")
    fraction_axis(ax)
    ax.set_xlim(0, 1)
    label_axes(
        ax, "precision vs recall at IoU 0.5 (mean over classes)", "recall", "precision", legend="inside"
    )
    ax.xaxis.set_major_locator(AutoLocator())  # recall is a fraction, not a count
    name = "pr_curve.png"
    save(fig, out_dir / name)
    return Plot(
        name, "Precision-recall curve", "COCO's 101 recall points at IoU 0.5, objects ranked by score."
    )


def b_ratio_plot(rows: Sequence[Row], target: Fraction | None, skips: list[float], out_dir: Path) -> Plot:
    steps = [number(r, "step") or 0.0 for r in rows]
    wanted: list[float] = []
    for n, row in enumerate(rows, start=1):
        wanted.append(((wanted[-1] * (n - 1)) + wants_b(row)) / n if wanted else float(wants_b(row)))
    fig, (ax,) = new_figure(1, title="Channel-B share: realised vs target")
    ax.plot(steps, realised_b_ratio(rows), color=B_COLOR, linewidth=1.8, label="realised (B steps trained)")
    ax.plot(steps, wanted, color="tab:green", linestyle=":", linewidth=1.6, label="schedule (B steps wanted)")
    if target is not None:
        ax.axhline(
            float(target),
            color="black",
            linestyle="--",
            linewidth=1.0,
            label=f"target b_ratio {fmt_ratio(target)}",
        )
    mark_x(ax, skips, SKIP_LABEL)
    fraction_axis(ax)
    label_axes(ax, "cumulative share of Channel-B steps", STEP, "B steps / steps so far (0–1)")
    name = "b_ratio.png"
    save(fig, out_dir / name)
    return Plot(
        name, "Realised vs target B ratio", "Cumulative share of optimizer steps that trained Channel-B."
    )


def queue_plot(rows: Sequence[Row], out_dir: Path) -> Plot | Skipped:
    xs, depth = series(rows, ASYNC + "queue_depth")
    if not depth:
        return Skipped("async queue depth / ver_lag", NOT_ASYNC)
    fig, (ax, ax_lag) = new_figure(2, title="Async ready-pack queue")
    ax_lag.sharex(ax)  # B steps under the queue depth they were trained from
    ax.step(xs, depth, where="post", color="tab:blue", linewidth=1.5, label="queue depth")
    count_axis(ax, depth)
    label_axes(ax, "ready packs queued after each step (sum over ranks)", STEP, "packs")
    lag_x, lag = series(rows, ASYNC + "ver_lag")
    if lag:
        ax_lag.plot(
            lag_x,
            lag,
            marker="o",
            markersize=line_marker_size(len(lag)),
            color=B_COLOR,
            linewidth=1.2,
            label="ver_lag",
        )
    else:
        note_empty(ax_lag, "no Channel-B step: no ver_lag logged")
    count_axis(ax_lag, lag)
    label_axes(ax_lag, "ver_lag of each B step (policy version − trained packs' version)", STEP, "versions")
    name = "async_queue.png"
    save(fig, out_dir / name)
    return Plot(
        name,
        "Queue depth and ver_lag",
        "Async mode: queued ready packs and how stale the trained packs were.",
    )


def drops_plot(rows: Sequence[Row], skips: list[float], out_dir: Path) -> Plot | Skipped:
    if not is_async(rows):
        return Skipped("stale/oldest drops and skip-to-A", NOT_ASYNC)
    fig, (ax, ax_skip) = new_figure(2, title="Async drops and skipped B steps")
    drops: list[float] = []
    for key, label, style in (
        ("drop_stale_total", "stale (outside the version window)", "-"),
        ("drop_oldest_total", "oldest (queue full)", "--"),
    ):
        xs, ys = series(rows, ASYNC + key)
        ax.step(xs, ys, where="post", linewidth=1.6, linestyle=style, label=label)
        drops += ys
    count_axis(ax, drops)
    label_axes(ax, "dropped ready packs (running total, sum over ranks)", STEP, "packs")
    steps = [number(r, "step") or 0.0 for r in rows]
    cumulative: list[float] = []
    for row in rows:
        cumulative.append((cumulative[-1] if cumulative else 0) + is_skip_to_a(row))
    ax_skip.step(
        steps, cumulative, where="post", color="tab:red", linewidth=1.6, label="skip-to-A steps so far"
    )
    mark_x(ax_skip, skips, SKIP_LABEL)
    count_axis(ax_skip, cumulative)
    label_axes(ax_skip, "steps that wanted B but trained A (running total)", STEP, "steps")
    name = "async_drops.png"
    save(fig, out_dir / name)
    return Plot(name, "Stale/oldest drops and skip-to-A steps", "Running totals as logged by rank 0.")


def timing_plot(rows: Sequence[Row], out_dir: Path) -> Plot | Skipped:
    xs, step_s = series(rows, STEP_S)
    if not step_s:
        return Skipped("step time and throughput", "no `time/step_s` in metrics.jsonl")
    fig, (ax, ax_tps) = new_figure(2, title="Step time and throughput")
    ax.plot(xs, step_s, color="tab:blue", linewidth=1.4, label="whole step")
    wx, wait = series(rows, WAIT_S)
    if any(wait):
        ax.plot(wx, wait, color="tab:purple", linewidth=1.2, label="waiting for rollouts / packs")
    bx, b_step_s = series([r for r in rows if is_b(r)], STEP_S)
    ax.scatter(bx, b_step_s, color=B_COLOR, s=point_size(len(bx)), zorder=3, label="Channel-B step")
    ax.set_ylim(bottom=0)
    label_axes(ax, "wall time per optimizer step", STEP, "seconds")
    tps = [
        (x, tokens / t)
        for r in rows
        if (x := number(r, "step")) is not None
        and (tokens := number(r, TOKENS)) is not None
        and (t := number(r, STEP_S))
    ]
    ax_tps.plot([p[0] for p in tps], [p[1] for p in tps], color="tab:green", linewidth=1.4, label="tokens/s")
    ax_tps.set_ylim(bottom=0)
    label_axes(ax_tps, "trained tokens per second of step time (all ranks)", STEP, "tokens/s")
    name = "timing.png"
    save(fig, out_dir / name)
    return Plot(name, "Step time and throughput", "Wall time per step and trained tokens per second.")


def optimizer_plot(rows: Sequence[Row], out_dir: Path) -> Plot | Skipped:
    """Gradient norm and the share of elements each optimizer step moved (`optim/update_nonzero_frac`):
    a share near 0 at a non-zero learning rate means the updates are rounded away (bf16 parameters)."""
    xs, moved = series(rows, UPDATE_NONZERO_FRAC)
    if not moved:
        return Skipped("optimizer updates", "no `optim/update_nonzero_frac` in metrics.jsonl (an older run)")
    fig, (ax, ax_norm) = new_figure(2, title="Optimizer updates")
    ax.plot(xs, moved, color="tab:blue", linewidth=1.4, marker="o", markersize=line_marker_size(len(xs)))
    fraction_axis(ax)
    label_axes(ax, "share of trainable elements the step changed", STEP, "fraction", legend="none")
    nx, norm = series(rows, GRAD_NORM)
    ax_norm.plot(nx, norm, color="tab:orange", linewidth=1.4)
    ax_norm.set_ylim(bottom=0)
    label_axes(ax_norm, "gradient norm before clipping", STEP, "L2 norm", legend="none")
    name = "optimizer.png"
    save(fig, out_dir / name)
    return Plot(
        name,
        "Optimizer updates",
        "Share of trainable elements each step changed (near 0 at a non-zero learning rate: updates lost to "
        "low-precision parameters) and the gradient norm.",
    )
